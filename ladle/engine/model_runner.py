"""Turns a scheduled step into forward passes: the flattened batch, its attention metadata, logits.

All scheduled tokens (decodes and prefill chunks of many requests) go through ONE forward, unless
chunking.ubatch caps the physical width: then the step's tokens are cut, in order, into forwards of
at most ubatch tokens. A chunk cut in two is just two consecutive pieces of the same sequence; the
second sees the first's keys in the cache. The LM head runs only on rows that sample, and on the
prefill positions of requests that ask for prompt logprobs (engine/logprobs.py), a few rows at a time.

A step's host work is O(batch) plus O(new tokens): input ids are slices of each request's prompt or
output (never prompt + output rebuilt), positions and slots are computed by torch from the lengths,
and block tables come from the persistent table (engine/block_table.py), which copies only new ids.
On CUDA a forward of one-token sequences (decodes) that fits a captured graph skips the metadata: its
inputs are staged from the host plan and the graph replayed (engine/cuda_graphs.py); any other forward
within the largest mixed-step graph replays one of those (engine/mixed_graphs.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ladle.engine.block_table import PersistentBlockTable
from ladle.engine.kv_cache import KVCacheManager
from ladle.engine.logprobs import TopK, token_logprobs
from ladle.engine.request import Request
from ladle.engine.scheduler import ScheduledRequest
from ladle.kernels import AttentionMetadata

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Piece:
    item: ScheduledRequest
    start: int  # position of its first token
    num_tokens: int
    produces_token: bool  # the piece ends the step's tokens of a request that samples


@dataclass(slots=True)
class _Batch:
    input_ids: torch.Tensor  # [T]
    meta: AttentionMetadata  # with `outputs` set: the rows the forward returns


@dataclass(slots=True)
class _Rows:
    """A forward's rows planned on the host: what the metadata is built from, and what is read after."""

    input_ids: list[int]
    query_lens: list[int]
    seq_lens: list[int]  # KV length of each sequence after the forward
    keep_from: list[int]  # per sequence: its first row the forward returns (meta.restrict_outputs)
    logits_rows: list[int]  # rows of the forward's output that sample, in step order
    prompt_rows: list[tuple[Request, int, int, int]]  # request, first output row, prompt positions [lo, hi)
    requests: list[Request]


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of a run of prompt positions one forward computed (engine/logprobs.py)."""

    request: Request
    first: int  # prompt index of the first token scored
    logprobs: list[float]
    top: list[TopK]


@dataclass(slots=True)
class RunnerOutput:
    """What one step's forwards produced."""

    logits: torch.Tensor  # float32 [S, vocab]: one row per request that samples, in step order
    prompt_logprobs: list[PromptLogprobs]  # in step order; the update appends them
    num_forwards: int  # > 1 when chunking.ubatch splits the step
    prepare_time: float  # seconds building batches and metadata (within the forwards' time)


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
            forwards[-1].append(_Piece(item, start, n, produces_token=item.produces_token and n == left))
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
        logprob_vocab: int | None = None,
    ):
        self.model = model
        self.attention_backend = attention_backend
        self.kv = kv
        self.device = device
        self.ubatch = ubatch
        self.block_table = PersistentBlockTable(kv.spec.blocks_for(kv.spec.max_model_len))
        self.logprob_vocab = logprob_vocab  # ids reported as top-k alternatives: [0, logprob_vocab)
        self.graphs = None  # engine/cuda_graphs.DecodeGraphs once captured (CUDA, model.cuda_graphs)
        self.mixed_graphs = None  # engine/mixed_graphs.MixedGraphs once captured (model.mixed_graph_tokens)
        self.graph_steps = 0  # forwards replayed from a CUDA graph (tests and benchmarks read it)
        self.mixed_graph_steps = 0  # of those, forwards replayed from a mixed-step graph
        self.eager_fallbacks: dict[str, int] = {}  # forwards run eager while graphs exist, per reason

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> RunnerOutput:
        """Run the step's forwards: logits rows of the requests that sample, and prompt logprobs."""
        rows: list[torch.Tensor] = []
        prompt_logprobs: list[PromptLogprobs] = []
        forwards = split_into_forwards(scheduled, self.ubatch)
        prepare_time = 0.0
        for pieces in forwards:
            logits, seconds = self._forward(pieces, prompt_logprobs)
            prepare_time += seconds
            if logits is not None:
                rows.append(logits)
        if not rows:
            logits = torch.empty(0, 0, device=self.device)
        else:
            logits = torch.cat(rows) if len(rows) > 1 else rows[0]
        return RunnerOutput(logits, prompt_logprobs, len(forwards), prepare_time)

    def release(self, seq_key: str | tuple[str, int]) -> None:
        """A finished request (Request.seq_key): its persistent block-table row is free again."""
        self.block_table.release(seq_key)

    def _forward(self, pieces: list[_Piece],
                 prompt_logprobs: list[PromptLogprobs]) -> tuple[torch.Tensor | None, float]:
        """One forward; its sampling rows' logits (None if none) and the seconds spent preparing it."""
        t0 = time.perf_counter()
        rows = self._plan_rows(pieces)
        run = self._prepare(rows)
        prepare_time = time.perf_counter() - t0
        hidden = run()
        vocab = self.model.arch.vocab_size
        for req, row, lo, hi in rows.prompt_rows:
            targets = req.prompt_token_ids[lo + 1 : hi + 1]
            chosen, tops = token_logprobs(self.model.compute_logits, hidden[row : row + hi - lo], targets,
                                          req.params.prompt_logprobs, vocab, self.logprob_vocab or vocab)
            prompt_logprobs.append(PromptLogprobs(req, lo + 1, chosen, tops))
        if not rows.logits_rows:
            return None, prepare_time
        if len(rows.logits_rows) == hidden.shape[0]:  # every returned row samples (a decode batch)
            return self.model.compute_logits(hidden), prepare_time
        index = torch.tensor(rows.logits_rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, index)), prepare_time

    def _prepare(self, rows: _Rows) -> Callable[[], torch.Tensor]:
        """Stage the forward's inputs for a CUDA graph, or build its eager batch; returns what runs it (the
        hidden states of the rows the forward returns, meta.outputs)."""
        if self._graph_fits(rows):
            size = self._stage(rows)
            self.graph_steps += 1
            return lambda: self._replay(rows, size)
        if self._mixed_fits(rows):
            table_rows = self._table_rows(rows)
            size = self.mixed_graphs.stage(rows.input_ids, rows.query_lens, rows.seq_lens, table_rows,
                                           self.block_table.table)
            self.graph_steps += 1
            self.mixed_graph_steps += 1
            return lambda: self._replay_mixed(rows, size)
        batch = self._batch(rows)
        return lambda: self.model(batch.input_ids, batch.meta.positions, self.kv.kv_caches, batch.meta)

    def _graph_fits(self, rows: _Rows) -> bool:
        """A captured graph can run this forward: one query row per sequence, and a bucket large enough."""
        return (self.graphs is not None and all(q == 1 for q in rows.query_lens)
                and self.graphs.bucket(len(rows.query_lens)) is not None)

    def _mixed_fits(self, rows: _Rows) -> bool:
        """A mixed-step graph can run this forward; when graphs are in use and none can, say why (once per
        reason at info level, later ones at debug)."""
        if self.graphs is None and self.mixed_graphs is None:
            return False  # an eager engine: nothing falls back
        if self.mixed_graphs is None:
            why = ("off", "mixed-step graphs are off (model.mixed_graph_tokens=0)")
        else:
            why = self.mixed_graphs.why_eager(len(rows.input_ids), len(rows.query_lens))
        if why is None:
            return True
        kind, text = why
        self.eager_fallbacks[kind] = self.eager_fallbacks.get(kind, 0) + 1
        level = logging.INFO if self.eager_fallbacks[kind] == 1 else logging.DEBUG
        log.log(level, "a forward runs eager instead of from a CUDA graph: %s", text)
        return False

    def _stage(self, rows: _Rows) -> int:
        """A graph's inputs staged from the host plan, without building metadata; the bucket size."""
        positions = [s - 1 for s in rows.seq_lens]
        table_rows = self._table_rows(rows)  # first: it may grow (reallocate) the table read next
        return self.graphs.stage(rows.input_ids, positions, table_rows, self.block_table.table)

    def _replay(self, rows: _Rows, size: int) -> torch.Tensor:
        """The staged forward from its CUDA graph: hidden states of the rows the forward returns (keep_from
        0), as the eager forward would return them."""
        hidden = self.graphs.replay(size, len(rows.query_lens))
        if all(k == 0 for k in rows.keep_from):
            return hidden
        kept = [b for b, k in enumerate(rows.keep_from) if k == 0]  # a 1-token prefill chunk nobody reads
        return hidden.index_select(0, torch.tensor(kept, dtype=torch.int64, device=self.device))

    def _replay_mixed(self, rows: _Rows, size: int) -> torch.Tensor:
        """The staged forward from its mixed-step graph, which returns every row: the rows eager would
        return (each sequence's rows from keep_from on), picked after the replay."""
        hidden = self.mixed_graphs.replay(size, len(rows.input_ids))
        if all(k == 0 for k in rows.keep_from):
            return hidden
        kept: list[int] = []
        start = 0
        for q, first in zip(rows.query_lens, rows.keep_from):
            kept.extend(range(start + first, start + q))
            start += q
        return hidden.index_select(0, torch.tensor(kept, dtype=torch.int64, device=self.device))

    def _plan_rows(self, pieces: list[_Piece]) -> _Rows:
        """The rows of a forward on the host: token ids, lengths, and the rows read after it (sampling
        rows, prompt-logprob runs) numbered among the rows the forward returns (meta.outputs): a suffix
        of each sequence's rows, from the first one read."""
        input_ids: list[int] = []
        query_lens, seq_lens, keep_from = [], [], []
        logits_rows: list[int] = []
        prompt_rows: list[tuple[Request, int, int, int]] = []  # request, first output row, positions [lo, hi)
        kept = 0  # output rows so far
        for p in pieces:
            end = p.start + p.num_tokens
            req = p.item.request
            first = p.num_tokens - 1 if p.produces_token else p.num_tokens
            run = None
            if req.needs_prompt_logprobs:
                # Position i predicts prompt[i + 1]; positions whose logprob exists (from before a
                # preemption) are skipped, and the last prompt position is the sampling row.
                lo, hi = max(p.start, len(req.prompt_logprobs) - 1), min(end, req.num_prompt_tokens - 1)
                if lo < hi:
                    run = (lo, hi)
                    first = min(first, lo - p.start)
            if run is not None:
                prompt_rows.append((req, kept + run[0] - p.start - first, *run))
            kept += p.num_tokens - first
            if p.produces_token:
                logits_rows.append(kept - 1)
            input_ids.extend(req.token_slice(p.start, end))
            query_lens.append(p.num_tokens)
            seq_lens.append(end)
            keep_from.append(first)
        return _Rows(input_ids, query_lens, seq_lens, keep_from, logits_rows, prompt_rows,
                     [p.item.request for p in pieces])

    def _table_rows(self, rows: _Rows) -> list[int]:
        """The forward's sequences' rows of the persistent block table, brought up to date."""
        reqs = rows.requests
        return self.block_table.rows([r.seq_key for r in reqs], [r.block_ids for r in reqs])

    def _batch(self, rows: _Rows) -> _Batch:
        """The flattened batch of an eager forward and its metadata (meta.outputs: the rows read)."""
        reqs = rows.requests
        tables = self.block_table.gather([r.seq_key for r in reqs], [r.block_ids for r in reqs])
        meta = AttentionMetadata.build(rows.query_lens, rows.seq_lens, tables, self.kv.block_size,
                                       device=self.device, backend=self.attention_backend)
        meta.restrict_outputs(rows.keep_from)
        ids = torch.tensor(rows.input_ids, dtype=torch.long, device=self.device)
        return _Batch(ids, meta)
