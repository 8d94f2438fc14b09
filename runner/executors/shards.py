"""Replica shares of a source for executor=ray: which rows a replica runs, and reading only those.

Rows are routed in blocks: rows [b*B, (b+1)*B) (B = executor.batch_size) go to replica b % n. A
replica reads its share without the driver touching the prompts:
- Parquet: only the row groups that hold a row of its blocks (row counts come from the footers);
- JSONL: every line is counted, only its own lines are parsed (`Source.keep`);
- Arrow, HF datasets, synthetic: the source is streamed and other replicas' rows are dropped.
Row indices stay global, so ids, per-row seeds and error rows are those of executor=local.
Duplicate ids are found once, by the driver, over the id column alone (`duplicate_indices`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.config import WorkloadConfig
from runner.source import ParquetSource, Row, Source, duplicate_id_error, open_source


@dataclass(frozen=True)
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


class ShardSource(Source):
    """Replica k's rows of `inner`, in source order, with duplicate ids marked as error rows."""

    def __init__(self, inner: Source, k: int, routing: Routing, duplicates: set[int] | None = None,
                 id_column: str | None = None, crash_after: int | None = None,
                 crash_marker: Path | None = None) -> None:
        self.inner, self.k, self.routing = inner, k, routing
        self.duplicates, self.id_column = duplicates or set(), id_column
        self.crash_after, self.crash_marker = crash_after, crash_marker  # test-only fault injection
        self.total = None if inner.total is None else routing.share_size(k, inner.total)
        self.description = f"{inner.description} (replica {k} of {routing.num_replicas})"

    def __getattr__(self, name: str) -> Any:  # cfg, columns, calibration, rates ... are the inner source's
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("vocab_size", "calibration"):
            setattr(self.inner, name, value)
        object.__setattr__(self, name, value)

    def _mine(self, index: int) -> bool:
        return self.routing.owner(index) == self.k

    def _all_rows(self) -> Iterator[list[Row]]:
        if isinstance(self.inner, ParquetSource):
            return self._parquet_rows(self.inner)
        self.inner.keep = self._mine  # JSONL skips other replicas' lines unparsed; others ignore it
        return self.inner.batches()

    def _parquet_rows(self, src: ParquetSource) -> Iterator[list[Row]]:
        import pyarrow.parquet as pq

        limit, bs, cols = src.cfg.limit, src.cfg.batch_size, src.columns
        offset = 0  # global index of the row group's first row, in the order ParquetSource scans
        for frag in src.dataset.get_fragments():
            pf = pq.ParquetFile(frag.path)
            for rg in range(pf.num_row_groups):
                n = pf.metadata.row_group(rg).num_rows
                end = offset + n if limit is None else min(offset + n, limit)
                if self.routing.owns_any(self.k, offset, end):
                    start = offset
                    for b in pf.iter_batches(batch_size=bs, row_groups=[rg], columns=cols, use_threads=False):
                        rows = src._rows({c: b.column(c).to_pylist() for c in cols}, start)
                        start += b.num_rows
                        yield [r for r in rows if limit is None or r.index < limit]
                offset += n
                if limit is not None and offset >= limit:
                    return

    def batches(self) -> Iterator[list[Row]]:
        seen = 0
        for batch in self._all_rows():
            mine = [r for r in batch if self._mine(r.index)]
            for r in mine:
                if r.index in self.duplicates:
                    r.error = r.error or duplicate_id_error(r.id, self.id_column)
            if mine:
                yield mine
            seen += len(mine)
            if self.crash_after is not None and seen >= self.crash_after and not self.crash_marker.exists():
                self.crash_marker.touch()
                os._exit(1)  # test-only: the actor dies mid-job


def duplicate_indices(w: WorkloadConfig, routing: Routing) -> dict[int, set[int]]:
    """Per replica, the indices of its rows whose id appeared at a lower index (executor=local makes
    those error rows). Reads the id column alone; holds the set of ids, as executor=local does."""
    if not w.id_column or w.kind == "synthetic":  # synthetic ids are unique by construction
        return {}
    only_ids = dataclasses.replace(w, prompt_column=w.id_column, max_tokens_column=None, class_column=None,
                                   class_arrivals={}, arrivals=dataclasses.replace(w.arrivals, process="offline"))
    seen: set[str] = set()
    dups: dict[int, set[int]] = {}
    for batch in open_source(only_ids).batches():
        for r in batch:
            if r.id in seen:
                dups.setdefault(routing.owner(r.index), set()).add(r.index)
            seen.add(r.id)
    return dups
