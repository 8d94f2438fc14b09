"""CUDA graphs for decode-only forwards: captured once per batch-size bucket, replayed with new inputs.

A decode step of a small model on a GPU is bound by its kernel launches, not its arithmetic: a
36-layer model launches hundreds of kernels per forward, each costing microseconds of host time. A
CUDA graph records them once and replays them with one launch (vLLM's CUDA graphs are the model).

What a graph needs, and how this module provides it:
- Fixed shapes and addresses. Every input of the forward lives in a static buffer sized for its bucket
  (input ids, positions, slot mapping, sequence lengths, a block table as wide as max_model_len). A
  batch of n decodes replays the smallest bucket B >= n: its first n rows are the batch, the other
  B - n are padding rows that write nothing to the cache (slot -1) and attend to one key.
- A fixed launch plan. The Triton launch plan (kernels/triton_launch.py) is decided from host values
  at capture: the split-KV segment count is the one a batch of B decodes of the longest possible
  context gets, and serves every shorter context (an empty segment contributes nothing).
- The engine's own KV cache: the graph records its addresses, so capture happens after the cache is
  allocated and writes nothing into it (every slot is -1 while capturing).

The graphs share one memory pool, captured largest first (as vLLM does), so they cost the activations of
the largest bucket once. Outputs equal eager's mathematically, not bitwise: the GEMMs' reductions depend
on the row count (a bucket's padded batch may pick another cuBLAS kernel than n rows would), and the
attention sums a context in the capture plan's segments where eager picks its own count from n and the
longest real context (often no split at all), so logprobs differ in their last bits (fp32 on the CPU
under the interpreter: tests/engine/test_cuda_graphs.py) and a bf16 near-tie can pick another token.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ladle.kernels import AttentionMetadata

log = logging.getLogger(__name__)


MAX_GRAPH_BATCH = 512  # larger decode batches run eager: their launches are a small part of their time


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 up to 64 and of 32 beyond, and
    max_num_seqs itself, so a batch pads by at most 7 rows up to 64 and 31 beyond; none above
    MAX_GRAPH_BATCH (as vLLM's default capture sizes stop at 512)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = {1, 2, 4, 8} | set(range(16, min(top, 64) + 1, 8)) | set(range(96, top + 1, 32))
    sizes.add(top)
    return sorted(s for s in sizes if s <= top)


def _staging(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    return tensor.pin_memory() if pin else tensor


@dataclass(slots=True)
class _Graph:
    replay: Callable[[], None]  # runs the recorded forward on the static buffers
    meta: AttentionMetadata  # holds the static tensors and the launch plans the graph recorded
    hidden: torch.Tensor  # [B, hidden]: the forward's output, rewritten by every replay
    graph: object = None  # the torch.cuda.CUDAGraph (kept alive with its pool)


class GraphSet:
    """What every set of captured forwards shares: the model and the engine's KV cache, the capture loop
    (largest first into one pool, the compiled forward with the eager one as fallback, no garbage
    collection while capturing) and the forward a graph records. A subclass holds the static buffers
    (`input_ids`, `positions` at least) and says what a bucket's metadata is (`_meta`)."""

    input_ids: torch.Tensor
    positions: torch.Tensor

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], sizes: list[int],
                 backend: str) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.sizes = sizes
        # model.compile: record the compiled forward (inductor's fused kernels: on a 0.6B model at batch 1,
        # 1.6 ms of GPU time per step against the eager forward's 2.6, docs/benchmarks.md section 4); the eager
        # one if that capture fails.
        self.records_compiled = bool(getattr(model, "compiled", False))
        self.graphs: dict[int, _Graph] = {}
        self.pool = None  # the memory pool the graphs share (passed on to another set's capture)

    def bucket(self, n: int) -> int | None:
        """The smallest captured size that holds n (decodes, or a mixed forward's tokens); None: too many,
        run eager."""
        return next((size for size in self.sizes if size >= n), None)

    def _meta(self, size: int) -> AttentionMetadata:
        raise NotImplementedError

    def capture(self, pool=None) -> float:
        """Capture every bucket (largest first, one shared pool: `pool`, another set's, when given).
        Returns the seconds it took."""
        t0 = time.perf_counter()
        failed = False
        try:
            self._capture_all(pool)
        except Exception:  # any failure of the compiled capture: fall back to the eager forward
            if not self.records_compiled:
                raise
            log.warning("capturing the compiled forward into CUDA graphs failed; recording the eager forward "
                        "instead (model.compile=false avoids the attempt)", exc_info=True)
            failed = True
        if failed:  # outside the handler, so the failed graphs are not kept alive by its traceback
            self.graphs.clear()
            self.records_compiled = False
            self._capture_all(pool)
        return time.perf_counter() - t0

    def _capture_all(self, pool) -> None:
        cuda = self.input_ids.is_cuda
        # torch.cuda.graph leaves its capture stream current when ending the capture raises: restore ours.
        stream = torch.cuda.current_stream(self.input_ids.device) if cuda else None
        # A garbage collection during a capture may destroy a graph left in a reference cycle (an earlier
        # engine's in this process, held by a patch of its runner: seen in a GPU test run), which CUDA forbids
        # while a stream captures, and the capture fails. torch >= 2.9 no longer collects before capturing:
        # collect here, and not again until the captures end (as vLLM and SGLang do).
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with self._on_device():
                for size in reversed(self.sizes):
                    self.graphs[size] = self._capture(size, pool)
                    graph = self.graphs[size].graph
                    pool = graph.pool() if graph is not None else pool
        finally:
            if collecting:
                gc.enable()
            if stream is not None:
                torch.cuda.set_stream(stream)
        self.pool = pool
        if cuda:
            torch.cuda.synchronize(self.input_ids.device)

    def _forward(self, meta: AttentionMetadata) -> torch.Tensor:
        """The forward a graph records: `meta`'s bucket of the static buffers, through the compiled forward
        when the model has one and records_compiled, else the eager one. Both write every row's keys through
        the attention backend (meta keeps every row), whose Triton write skips the padding slot -1."""
        size = meta.num_tokens
        ids, pos = self.input_ids[:size], self.positions[:size]
        if getattr(self.model, "compiled", False) and not self.records_compiled:
            return self.model._forward(ids, pos, self.kv_caches, meta)
        return self.model(ids, pos, self.kv_caches, meta)

    @torch.inference_mode()
    def _capture(self, size: int, pool) -> _Graph:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels and workspace), then
        record the forward of the bucket `size` (its token count) into a CUDA graph."""
        meta = self._meta(size)
        device = self.input_ids.device
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(meta)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self._forward(meta)
        return _Graph(graph.replay, meta, hidden, graph)

    def _on_device(self):
        """Make the buffers' GPU the current device (model.device=cuda:N): captures, copies and replays
        run on its current stream, and the staging's event is recorded there."""
        device = self.input_ids.device
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class DecodeGraphs(GraphSet):
    """The captured graphs of one model and KV cache: `stage` a batch of one-token sequences into the
    static buffers of the bucket that holds it, then `replay` that bucket."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 max_model_len: int, max_num_seqs: int, backend: str = "auto") -> None:
        super().__init__(model, kv_caches, bucket_sizes(max_num_seqs), backend)
        self.block_size = block_size
        self.max_model_len = max_model_len
        device = kv_caches[0].device
        largest = self.sizes[-1]
        # One set of static inputs at the largest size; each bucket's graph reads a prefix of it. Token
        # ids, positions and slots share one tensor so a replay's inputs arrive in three copies in all.
        width = -(-max_model_len // block_size)  # blocks of the longest sequence: the persistent table's width
        # Inference tensors, as every input the compiled forward is traced and called with (the warm-up's,
        # the runner's): a plain tensor has another dispatch key set, which fails dynamo's guard and would
        # compile the whole forward a second time at capture.
        with torch.inference_mode():
            self._tokens = torch.zeros(3, largest, dtype=torch.long, device=device)
            self.input_ids, self.positions, self.slot_mapping = self._tokens[0], self._tokens[1], self._tokens[2]
            self.slot_mapping.fill_(-1)
            self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
            self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros(largest, width, dtype=torch.int32, device=device)
        # Their host staging (pinned on CUDA, so the copies are asynchronous DMA), written through numpy:
        # a replay's inputs cost no torch op on the host beyond the copies.
        pin = device.type == "cuda"
        self._host_tokens = _staging(torch.zeros(3, largest, dtype=torch.long), pin)
        self._host_seq_lens = _staging(torch.ones(largest, dtype=torch.int32), pin)
        self._host_tables = _staging(torch.zeros(largest, width, dtype=torch.int32), pin)
        self._np_tokens, self._np_seq_lens = self._host_tokens.numpy(), self._host_seq_lens.numpy()
        self._np_tables = self._host_tables.numpy()
        self._copied = torch.cuda.Event() if pin else None  # the staging may be rewritten once it is set

    def _meta(self, size: int) -> AttentionMetadata:
        """Static metadata of a bucket. The host lists describe the longest context a decode can have,
        so the launch plan (split-KV segments) decided from them holds for every batch replayed."""
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            positions=self.positions[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[self.max_model_len] * size,
            backend=self.backend,
        )
        meta.restrict_outputs([0] * size)  # every row is read
        return meta

    @torch.inference_mode()  # the static buffers are inference tensors
    def stage(self, input_ids: list[int], positions: list[int], table_rows: list[int],
              table: torch.Tensor) -> int:
        """Put n one-token sequences in the static buffers: token ids, positions, and their rows of the
        persistent host block table [rows, max_blocks] (int32). Slots and lengths are derived here (numpy,
        no torch op), the bucket's padding rows set (slot -1: store nothing; length 1; position 0), and
        three non-blocking copies made. Returns the bucket size to `replay`."""
        n = len(input_ids)
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"no CUDA graph holds {n} decodes (largest: {self.sizes[-1]})")
        if self._copied is not None:
            self._copied.synchronize()  # the previous copies have read the staging: it may be rewritten
        pos = np.asarray(positions, dtype=np.int64)
        rows = np.asarray(table_rows, dtype=np.int64)
        host_table = table.numpy()
        tokens, seq_lens, tables = self._np_tokens, self._np_seq_lens, self._np_tables
        tokens[0, :n] = input_ids
        tokens[1, :n] = pos
        tokens[2, :n] = host_table[rows, pos // self.block_size].astype(np.int64) * self.block_size \
            + pos % self.block_size
        seq_lens[:n] = pos + 1
        tables[:n] = host_table[rows, : tables.shape[1]]
        tokens[:, n:size] = ((0,), (0,), (-1,))  # padding rows: token 0 at position 0, stored nowhere
        seq_lens[n:size] = 1  # and attending to one key (block ids left from earlier rows stay in range)
        with self._on_device():
            self._tokens.copy_(self._host_tokens, non_blocking=True)
            self.seq_lens.copy_(self._host_seq_lens, non_blocking=True)
            self.block_tables[:size].copy_(self._host_tables[:size], non_blocking=True)
            if self._copied is not None:
                # On the copies' stream: the current stream of the buffers' device (explicit, as with
                # model.device=cuda:N it is not device 0's)
                self._copied.record(torch.cuda.current_stream(self._tokens.device))
        return size

    def replay(self, size: int, n: int) -> torch.Tensor:
        """Replay bucket `size` on what `stage` put there; hidden [n, hidden] of the n staged rows (a view
        of the graph's output: read it before the next replay)."""
        entry = self.graphs[size]
        with self._on_device():
            entry.replay()
        return entry.hidden[:n]
