"""CUDA graphs for forwards that carry prefill chunks: captured once per padded token count, replayed.

A step with a 512-token chunk beside 32 decodes of a 4B model launches as many kernels as a decode step
and runs eager, bound by those launches on a GPU (docs/benchmarks.md section 4). These graphs record whole
forwards of mixed batches (decodes and chunks together), keyed by the padded token count, as vLLM V1's
full graphs over its unified Triton attention do.

Why full graphs and not piecewise ones (attention eager between captured pieces): ladle's Triton
attention (kernels/triton_attention.py) already takes any mix of query lengths in one launch whose grid
is an upper bound from the token count and the number of sequences, never from per-sequence lengths read
on the host. Fix both, and every batch of at most that many tokens and sequences runs the same launch.
A piecewise graph would still launch attention eagerly once per layer (36 launches on the 4B shape),
which is the cost the graphs are there to remove.

What a bucket of `size` tokens records, over static buffers:
- `size` token rows: the batch's tokens first, then padding tokens (id 0, position 0, slot -1: stored
  nowhere; their rows of the output are garbage nobody reads).
- `max_num_seqs` sequence rows: the batch's sequences first, then padding sequences with an empty query
  (query_start_loc repeats the batch's token count) and sequence length 0: their attention programs exit
  before reading a key or the block table.
- One launch plan: the 2D kernel's tile for a query of `size` tokens and its grid `size // BLOCK_Q +
  max_num_seqs`, decided from host lists that list no decode row, so the split-KV path is never taken
  (its device list of decode rows would be fixed at capture). Decode rows ride in the 2D kernel, as they
  do in eager mixed steps with enough decodes to fill the GPU.
- Every row's hidden state (the last layer is not cut to the rows that are read, which change per step):
  the runner picks the rows it reads after the replay.

The graphs share one memory pool with the decode graphs (engine/cuda_graphs.py), captured first since
their largest bucket is the larger; the memory plan counts the pool (engine/memory.graph_pool_bytes).
"""

from __future__ import annotations

import numpy as np
import torch

from ladle.engine.cuda_graphs import GraphSet, _staging
from ladle.kernels import AttentionMetadata
from ladle.kernels.metadata import OutputRows

MIXED_GRAPH_TOKENS = 2048  # default largest bucket: above it a step's arithmetic dwarfs its launches


def token_buckets(largest: int) -> list[int]:
    """Token counts to capture: 8, 16, 32, 64, then four per doubling (80, 96, 112, 128, 160, ...) up to
    `largest`, and `largest` itself: from 64 tokens on a step pads by at most a quarter."""
    sizes = {s for s in (8, 16, 32, 64) if s <= largest}
    base = 64
    while base < largest:
        sizes |= {base + k * base // 4 for k in range(1, 5) if base + k * base // 4 <= largest}
        base *= 2
    sizes.add(largest)
    return sorted(sizes)


class MixedGraphs(GraphSet):
    """The captured mixed-step graphs of one model and KV cache: `stage` a forward's rows into the static
    buffers of the bucket that holds its tokens, then `replay` it."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 max_model_len: int, max_num_seqs: int, max_tokens: int, backend: str = "auto") -> None:
        if max_tokens < 1:
            raise ValueError(f"mixed-step graphs need max_tokens >= 1, got {max_tokens}")
        super().__init__(model, kv_caches, token_buckets(max_tokens), backend)
        self.block_size, self.max_model_len, self.max_seqs = block_size, max_model_len, max_num_seqs
        device = kv_caches[0].device
        largest, seqs = self.sizes[-1], max_num_seqs
        width = -(-max_model_len // block_size)  # the persistent block table's width
        with torch.inference_mode():  # inference tensors, as in DecodeGraphs (the compiled forward's guard)
            self._tokens = torch.zeros(3, largest, dtype=torch.long, device=device)
            self.input_ids, self.positions, self.slot_mapping = self._tokens[0], self._tokens[1], self._tokens[2]
            self.slot_mapping.fill_(-1)
            self.seq_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
            self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros(seqs, width, dtype=torch.int32, device=device)
        pin = device.type == "cuda"  # pinned staging: the copies are asynchronous DMA
        self._host_tokens = _staging(torch.zeros(3, largest, dtype=torch.long), pin)
        self._host_seq_lens = _staging(torch.zeros(seqs, dtype=torch.int32), pin)
        self._host_qsl = _staging(torch.zeros(seqs + 1, dtype=torch.int32), pin)
        self._host_tables = _staging(torch.zeros(seqs, width, dtype=torch.int32), pin)
        self._copied = torch.cuda.Event() if pin else None  # the staging may be rewritten once it is set

    def why_eager(self, num_tokens: int, num_seqs: int) -> tuple[str, str] | None:
        """Why a forward of this shape cannot replay, as (kind, explanation with the numbers); None: it can."""
        if num_tokens > self.sizes[-1]:
            return "tokens", (f"{num_tokens} tokens, above the largest mixed-step graph ({self.sizes[-1]} tokens; "
                    "model.mixed_graph_tokens raises it, within the step budget)")
        if num_seqs > self.max_seqs:
            return "sequences", f"{num_seqs} sequences, above the graphs' {self.max_seqs} rows (max_num_seqs)"
        return None

    def _meta(self, size: int) -> AttentionMetadata:
        """Static metadata of a bucket. The host lists give one sequence all `size` tokens and the others
        none: the launch plan takes the tile of the longest possible query and no split-KV path, and
        holds for every batch replayed. Every row is returned (the rows read change per step)."""
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping[:size],
            positions=self.positions[:size],
            max_query_len=size,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            query_start_loc_cpu=[0] * self.max_seqs + [size],
            seq_lens_cpu=[self.max_model_len] * self.max_seqs,
            backend=self.backend,
        )
        rows = torch.arange(size, dtype=torch.int64, device=self.input_ids.device)
        meta.outputs = OutputRows(rows, meta, every_row=True)
        return meta

    @torch.inference_mode()  # the static buffers are inference tensors
    def stage(self, input_ids: list[int], query_lens: list[int], seq_lens: list[int], table_rows: list[int],
              table: torch.Tensor) -> int:
        """Put a forward's rows in the static buffers: its token ids, each sequence's query length and KV
        length after the forward, and its rows of the persistent host block table (int32). Positions and
        slots are derived with numpy (no torch op), padding tokens and sequences set, and four non-blocking
        copies made. Returns the bucket size to `replay`."""
        num_tokens, n = len(input_ids), len(query_lens)
        size = self.bucket(num_tokens)
        if size is None or n > self.max_seqs:
            raise ValueError(f"no mixed-step graph holds {num_tokens} tokens in {n} sequences "
                             f"(largest: {self.sizes[-1]} tokens, {self.max_seqs} sequences)")
        if self._copied is not None:
            self._copied.synchronize()  # the previous copies have read the staging: it may be rewritten
        q, s = np.asarray(query_lens, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
        ends = np.cumsum(q)
        seq_of_token = np.repeat(np.arange(n), q)
        pos = np.arange(num_tokens) + np.repeat(s - ends, q)  # token i of b sits at context_b + i - start_b
        host_table, rows = table.numpy(), np.asarray(table_rows, dtype=np.int64)
        tokens = self._host_tokens.numpy()
        tokens[0, :num_tokens] = input_ids
        tokens[1, :num_tokens] = pos
        tokens[2, :num_tokens] = host_table[rows[seq_of_token], pos // self.block_size].astype(np.int64) \
            * self.block_size + pos % self.block_size
        tokens[:, num_tokens:size] = ((0,), (0,), (-1,))  # padding tokens: token 0 at position 0, stored nowhere
        qsl, lens, tables = self._host_qsl.numpy(), self._host_seq_lens.numpy(), self._host_tables.numpy()
        qsl[0], qsl[1 : n + 1], qsl[n + 1 :] = 0, ends, num_tokens  # padding sequences: empty queries
        lens[:n], lens[n:] = s, 0  # and no keys
        tables[:n] = host_table[rows, : tables.shape[1]]
        with self._on_device():
            self._tokens.copy_(self._host_tokens, non_blocking=True)
            self.query_start_loc.copy_(self._host_qsl, non_blocking=True)
            self.seq_lens.copy_(self._host_seq_lens, non_blocking=True)
            self.block_tables[:n].copy_(self._host_tables[:n], non_blocking=True)
            if self._copied is not None:
                self._copied.record(torch.cuda.current_stream(self._tokens.device))
        return size

    def replay(self, size: int, num_tokens: int) -> torch.Tensor:
        """Replay bucket `size` on what `stage` put there; hidden [num_tokens, hidden] of the staged rows (a
        view of the graph's output: read it before the next replay)."""
        entry = self.graphs[size]
        with self._on_device():
            entry.replay()
        return entry.hidden[:num_tokens]
