"""Attention metadata for one flattened mixed batch (decodes and prefill chunks together).

The model runner builds one of these per forward; every layer of the model reads it. Sequences are
ordered in the batch as the scheduler listed them; `query_start_loc[b]:query_start_loc[b+1]` are the
rows of sequence b in the flattened tensors. A sequence's context (tokens already in the cache before
this forward) is `seq_lens[b] - query_len[b]`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32, on the model's device
    seq_lens: torch.Tensor  # [B] int32: KV length of each sequence after this forward
    block_tables: torch.Tensor  # [B, max_blocks] int32: cache blocks of each sequence, in order
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies: the torch reference plans its gathers from these without a device sync.
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # Position of each new token in its sequence [T] int64 (what RoPE needs), on the model's device.
    positions: torch.Tensor | None = None
    # Rows of the flattened batch whose logits are needed (last token of a finishing prefill, decodes).
    logits_indices: torch.Tensor | None = None
    # Per-forward scratch shared by all layers (e.g. the reference's gather plan per window size).
    cache: dict[Any, Any] = field(default_factory=dict)
    # Attention implementation for this forward: auto | triton | cpu_paged | torch (set per engine, so two
    # engines in one process never see each other's choice).
    backend: str = "auto"
    # The rows whose hidden state the caller reads (None: all). The model's last layer computes only
    # those (see OutputRows), and the forward returns only those, in order.
    outputs: OutputRows | None = None

    def restrict_outputs(self, keep_from: list[int]) -> OutputRows:
        """Set `outputs` to each sequence's query rows from offset keep_from[b] on (a suffix of its rows;
        keep_from[b] = its query length keeps none) and return it. The suffix shape is what keeps the
        last layer's attention an ordinary causal batch: a kept row sees every key before it."""
        qsl, seq_lens = self.query_start_loc_cpu, self.seq_lens_cpu
        if len(keep_from) != len(seq_lens):
            raise ValueError(f"keep_from has {len(keep_from)} entries for {len(seq_lens)} sequences")
        seqs, query_lens, kept_seq_lens, rows = [], [], [], []
        for b, first in enumerate(keep_from):
            q = qsl[b + 1] - qsl[b]
            if not 0 <= first <= q:
                raise ValueError(f"keep_from[{b}]={first} outside the sequence's {q} query rows")
            if first < q:
                seqs.append(b)
                query_lens.append(q - first)
                kept_seq_lens.append(seq_lens[b])
                rows.extend(range(qsl[b] + first, qsl[b + 1]))
        device = self.slot_mapping.device
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        if len(rows) == self.num_tokens:
            self.outputs = OutputRows(index, self, every_row=True)
            return self.outputs
        kept = AttentionMetadata(
            query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device),
            seq_lens=torch.tensor(kept_seq_lens, dtype=torch.int32, device=device),
            block_tables=self.block_tables.index_select(0, torch.tensor(seqs, dtype=torch.int64, device=device)),
            slot_mapping=self.slot_mapping.index_select(0, index),
            positions=None if self.positions is None else self.positions.index_select(0, index),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(kept_seq_lens, default=0),
            block_size=self.block_size,
            query_start_loc_cpu=[0, *itertools.accumulate(query_lens)],
            seq_lens_cpu=kept_seq_lens,
            backend=self.backend,
        )
        self.outputs = OutputRows(index, kept, every_row=False)
        return self.outputs

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]] | torch.Tensor,
        block_size: int,
        device: torch.device | str = "cpu",
        logits_indices: list[int] | None = None,
        backend: str = "auto",
    ) -> AttentionMetadata:
        """Build metadata from the query length and KV length after the forward of each sequence, and
        its block ids: lists, or a host int32 tensor [B, >= blocks of the longest] (the engine's
        persistent block table rows, which it keeps valid)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        qsl = [0]
        for q, s in zip(query_lens, seq_lens):
            if q < 1 or s < q:
                raise ValueError(f"invalid sequence: query_len={q}, seq_len={s}")
            qsl.append(qsl[-1] + q)
        if isinstance(block_tables, torch.Tensor):
            need = -(-max(seq_lens, default=1) // block_size)
            if block_tables.shape[1] < need:
                raise ValueError(f"block table of width {block_tables.shape[1]} cannot hold {max(seq_lens)} tokens")
            table = block_tables[:, : max(need, 1)].to(torch.int32).contiguous()
        else:
            table = _table_from_lists(block_tables, seq_lens, block_size)
        # Slot of every new token, vectorised: its sequence's block at pos // block_size, plus offset.
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
        starts = torch.tensor(qsl[:-1], dtype=torch.int64)
        ctx = torch.tensor(seq_lens, dtype=torch.int64) - q_lens
        pos = torch.arange(qsl[-1], dtype=torch.int64) - starts[seq_of_token] + ctx[seq_of_token]
        blocks_of_token = table.to(torch.int64)[seq_of_token, pos // block_size]
        slots = blocks_of_token * block_size + pos % block_size
        return AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            slot_mapping=slots.to(device),
            positions=pos.to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            block_size=block_size,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=list(seq_lens),
            logits_indices=(
                torch.tensor(logits_indices, dtype=torch.int64, device=device)
                if logits_indices is not None
                else None
            ),
            backend=backend,
        )


@dataclass(slots=True)
class OutputRows:
    """The rows of a forward whose final hidden state is read (sampling rows, prompt-logprob rows).

    Every layer but the last must run on all rows (later layers read their keys and values); the last
    layer's keys and values are written for all rows, but its attention output, MLP and everything after
    are needed only here: on a prefill chunk that is one row of hundreds. `meta` describes the kept rows
    as a batch of their own (same sequences, same cache, query lengths cut to the kept suffix)."""

    rows: torch.Tensor  # [R] int64, ascending: the kept rows of the full batch
    meta: AttentionMetadata  # the kept rows' attention metadata (the full batch's when every_row)
    every_row: bool  # nothing to drop: the last layer runs as the others


def _table_from_lists(block_tables: list[list[int]], seq_lens: list[int], block_size: int) -> torch.Tensor:
    for blocks, s in zip(block_tables, seq_lens):
        if len(blocks) * block_size < s:
            raise ValueError(f"{len(blocks)} blocks of {block_size} cannot hold {s} tokens")
    width = max((len(b) for b in block_tables), default=1) or 1
    table = torch.zeros((len(block_tables), width), dtype=torch.int32)
    for i, blocks in enumerate(block_tables):
        if blocks:
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return table
