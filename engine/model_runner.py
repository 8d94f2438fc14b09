"""Turns a scheduled step into forward passes: the flattened batch, its attention metadata, logits.

All scheduled tokens (decodes and prefill chunks of many requests) go through ONE forward, unless
chunking.ubatch caps the physical width: then the step's tokens are cut, in order, into forwards of
at most ubatch tokens. A chunk cut in two is just two consecutive pieces of the same sequence; the
second sees the first's keys in the cache. The LM head runs only on rows that sample.

A step's host work is O(batch) plus O(new tokens): input ids are slices of each request's prompt or
output (never prompt + output rebuilt), positions and slots are computed by torch from the lengths,
and block tables come from the persistent table (engine/block_table.py), which copies only new ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.block_table import PersistentBlockTable
from engine.kv_cache import KVCacheManager
from engine.scheduler import ScheduledRequest
from kernels import AttentionMetadata


@dataclass(slots=True)
class _Piece:
    item: ScheduledRequest
    start: int  # position of its first token
    num_tokens: int
    samples: bool  # the piece ends the step's tokens of a request that samples


def split_into_forwards(scheduled: list[ScheduledRequest], ubatch: int | None) -> list[list[_Piece]]:
    """Cut the step's token list into forwards of at most `ubatch` tokens (one forward if None)."""
    forwards: list[list[_Piece]] = [[]]
    room = ubatch if ubatch is not None else float("inf")
    for item in scheduled:
        start, left = item.start, item.num_tokens
        while left > 0:
            if room == 0:
                forwards.append([])
                room = ubatch
            n = int(min(left, room))
            forwards[-1].append(_Piece(item, start, n, samples=item.samples and n == left))
            start, left, room = start + n, left - n, room - n
    return [f for f in forwards if f]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCacheManager,
        device: torch.device,
        ubatch: int | None,
        attention_backend: str = "auto",
    ):
        self.model = model
        self.attention_backend = attention_backend
        self.kv = kv
        self.device = device
        self.ubatch = ubatch
        self.block_table = PersistentBlockTable(kv.blocks_needed(kv.config.max_model_len))
        self.num_forwards = 0  # of the last step
        self.prepare_time = 0.0  # seconds spent building batches/metadata in the last step

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """Run the step; returns float32 logits [S, vocab], one row per sampling request in order."""
        rows: list[torch.Tensor] = []
        self.prepare_time = 0.0
        forwards = split_into_forwards(scheduled, self.ubatch)
        for pieces in forwards:
            logits = self._forward(pieces)
            if logits is not None:
                rows.append(logits)
        self.num_forwards = len(forwards)
        if not rows:
            return torch.empty(0, 0, device=self.device)
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def release(self, request_id: str) -> None:
        """A finished request: its persistent block-table row is free again."""
        self.block_table.release(request_id)

    def _forward(self, pieces: list[_Piece]) -> torch.Tensor | None:
        t0 = time.perf_counter()
        input_ids: list[int] = []
        query_lens, seq_lens, logits_indices = [], [], []
        for p in pieces:
            end = p.start + p.num_tokens
            input_ids.extend(p.item.request.token_slice(p.start, end))
            query_lens.append(p.num_tokens)
            seq_lens.append(end)
            if p.samples:
                logits_indices.append(len(input_ids) - 1)
        reqs = [p.item.request for p in pieces]
        rows = self.block_table.rows([r.request_id for r in reqs], [r.block_ids for r in reqs])
        tables = self.block_table.table.index_select(0, torch.tensor(rows))
        meta = AttentionMetadata.build(
            query_lens,
            seq_lens,
            tables,
            self.kv.block_size,
            device=self.device,
            logits_indices=logits_indices,
            backend=self.attention_backend,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        self.prepare_time += time.perf_counter() - t0
        hidden = self.model(ids, meta.positions, self.kv.kv_caches, meta)
        if not logits_indices:
            return None
        return self.model.compute_logits(hidden[meta.logits_indices])
