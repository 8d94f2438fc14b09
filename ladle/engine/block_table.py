"""The running requests' block ids in one preallocated tensor, updated by what changed.

vLLM V1 keeps a persistent block table in its input batch instead of rebuilding one per step; so
does ladle. Each request that reaches the model gets a row; a step writes only the block ids a request
gained since its last step (a decode crosses into a new block once every block_size tokens), so a
decode step copies no block table at all. The forward then takes its rows with one index_select.

It relies on one invariant of KVCacheManager: a request's `block_ids` list is only ever extended in
place; when the request loses its blocks (preemption) or gets a new set (admission, a fork) it is
given a new list. A row remembers which list object it mirrors and how much of it, so a new list is
rewritten from its start and an extended one from where the row stopped.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch


class PersistentBlockTable:
    def __init__(self, max_blocks_per_seq: int, rows: int = 64) -> None:
        self.table = torch.zeros(max(rows, 1), max(max_blocks_per_seq, 1), dtype=torch.int32)
        self._row: dict[Hashable, int] = {}  # sequence key (Request.seq_key: the request id, or id + sample) -> row
        self._mirrored: dict[int, tuple[list[int], int]] = {}  # row -> (the block_ids list, ids written)
        self._free = list(range(self.table.shape[0] - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._row)

    def rows(self, request_ids: list[Hashable], block_ids: list[list[int]]) -> list[int]:
        """The rows of these requests, brought up to date with their block ids."""
        out = []
        for rid, blocks in zip(request_ids, block_ids):
            row = self._row.get(rid)
            if row is None:
                row = self._row[rid] = self._take_row()
                written = 0
            else:
                mirrored, written = self._mirrored[row]
                if mirrored is not blocks or len(blocks) < written:
                    written = 0  # a new list: the request's blocks were replaced
            if len(blocks) > written:
                self.table[row, written : len(blocks)] = torch.tensor(blocks[written:], dtype=torch.int32)
            self._mirrored[row] = (blocks, len(blocks))
            out.append(row)
        return out

    def gather(self, request_ids: list[Hashable], block_ids: list[list[int]]) -> torch.Tensor:
        """These requests' block-table rows [len(request_ids), max_blocks], up to date. The table is read
        only after `rows` made room: growing it replaces `self.table`, so a tensor bound before is stale."""
        rows = self.rows(request_ids, block_ids)
        return self.table.index_select(0, torch.tensor(rows, dtype=torch.int64))

    def release(self, request_id: Hashable) -> None:
        """A finished request gives its row back."""
        row = self._row.pop(request_id, None)
        if row is not None:
            self._mirrored.pop(row, None)
            self._free.append(row)

    def _take_row(self) -> int:
        if not self._free:  # more live requests than rows (preempted ones keep theirs): double
            n = self.table.shape[0]
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()
