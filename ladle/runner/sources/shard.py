"""A replica's share of a source (executor=ray): the row filter every `Source` honours.

Rows are routed in blocks: rows [b*B, (b+1)*B) (B = executor.batch_size) go to replica b % n. A source
with a `Shard` yields only its replica's rows, in source order, with their global indices (so ids,
per-row seeds and error rows are those of executor=local), and marks the rows whose id the driver found
repeated. Readers that can skip rows unread ask `Source.owns(index)` (Parquet row groups, JSONL lines).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ladle.runner.sources.rows import Row, duplicate_id_error


@dataclass(frozen=True, slots=True)
class Routing:
    num_replicas: int
    block_rows: int

    def owner(self, index: int) -> int:
        return (index // self.block_rows) % self.num_replicas

    def owns_any(self, k: int, lo: int, hi: int) -> bool:
        """Whether replica k owns a row in [lo, hi)."""
        if hi <= lo:
            return False
        first, last = lo // self.block_rows, (hi - 1) // self.block_rows
        if last - first + 1 >= self.num_replicas:
            return True
        return any(b % self.num_replicas == k for b in range(first, last + 1))

    def share_size(self, k: int, total: int) -> int:
        """Rows of [0, total) that replica k owns."""
        n, b = self.num_replicas, self.block_rows
        full, rest = divmod(total, b)  # `full` whole blocks, then a partial one
        rows = (full // n + (1 if full % n > k else 0)) * b
        return rows + (rest if full % n == k else 0)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class Shard:
    """Replica k's rows; `duplicates`: indices of its rows whose id appeared at a lower index."""

    k: int
    routing: Routing
    duplicates: Collection[int] | None = None
    id_column: str | None = None
    crash_after: int | None = None  # test-only fault injection: die once after this many rows ...
    crash_marker: Path | None = None  # ... unless this file says it already did

    def __post_init__(self) -> None:
        self.duplicates = frozenset(self.duplicates or ())

    def owns(self, index: int) -> bool:
        return self.routing.owner(index) == self.k

    def size(self, total: int | None) -> int | None:
        return None if total is None else self.routing.share_size(self.k, total)

    def take(self, batches: Iterable[list[Row]]) -> Iterator[list[Row]]:
        """The shard's rows of `batches`, duplicate ids marked as error rows."""
        seen = 0
        for batch in batches:
            mine = [r for r in batch if self.owns(r.index)]
            for r in mine:
                if r.index in self.duplicates:
                    r.error = r.error or duplicate_id_error(r.id, self.id_column)
            if mine:
                yield mine
            seen += len(mine)
            if self.crash_after is not None and seen >= self.crash_after and not self.crash_marker.exists():
                self.crash_marker.touch()
                os._exit(1)  # test-only: the actor dies mid-job
