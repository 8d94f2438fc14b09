"""The throwaway forwards of engine/profiling.py against the engine's own forward.

The engine's last decoder layer computes only the rows that are read (AttentionMetadata.restrict_outputs):
a timing of "the engine's forward of this shape" (LLMEngine.time_forward, which arrival calibration
divides prompt tokens by) must time that same work, while the memory profile must keep every row (a
prompt-logprobs step keeps them all: the most a forward of that shape can allocate).
"""

from __future__ import annotations

import pytest
import torch

from ladle.engine import SamplingParams
from ladle.engine.memory import profile_peak_bytes
from tests.engine.helpers import make_engine, random_prompt

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _last_mlp_rows(model) -> tuple[list[int], object]:
    """Rows of every call of the last decoder layer's MLP (a forward hook); the list and its handle."""
    rows: list[int] = []
    handle = model.model.layers[-1].mlp.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    return rows, handle


def test_time_forward_times_the_rows_the_engine_computes(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("qwen3"), size=64, max_num_seqs=2)
    rows, handle = _last_mlp_rows(eng.model)
    try:
        # The engine's step that prefills two whole prompts of 40 and 24 tokens.
        eng.generate([random_prompt(40, seed=1), random_prompt(24, seed=2)], SamplingParams(max_tokens=1))
        engine_rows = rows[0]
        rows.clear()
        eng.time_forward([40, 24], [40, 24])  # what calibration times for that shape
        timed_rows = rows[0]
        rows.clear()
        profile_peak_bytes(eng.model, 64, 40)  # the memory profile: sequences of 40 and 24 tokens
        profiled_rows = rows[0]
    finally:
        handle.remove()
    assert engine_rows == 2  # each sequence's sampling row
    assert timed_rows == engine_rows
    assert profiled_rows == 64  # every row: the upper bound


def _caches_seen(model) -> tuple[list[list[torch.Tensor]], object]:
    """The KV caches of every forward of `model` (a forward pre-hook); the list and its handle."""
    seen: list[list[torch.Tensor]] = []
    handle = model.register_forward_pre_hook(lambda _m, args: seen.append(list(args[2])))
    return seen, handle


def test_time_forward_reads_the_engine_cache_layout(tiny_hf_model_dir):
    """A timed forward attends over caches laid out as the engine's (on the CPU head-major blocks on 2 MiB
    pages, engine/kv_cache.layer_cache): a token-major throwaway cache times another kernel walk."""
    eng = make_engine(tiny_hf_model_dir("qwen3"), size=64, max_num_seqs=2, device="cpu")  # the CPU's layout
    seen, handle = _caches_seen(eng.model)
    try:
        eng.time_forward([1, 1], [40, 24])
    finally:
        handle.remove()
    timed = seen[0][0]
    engine = eng.kv.kv_caches[0]
    assert timed.shape[2:] == engine.shape[2:]
    # Same layout: block, token and head strides in the same ratio (the block counts differ).
    assert timed.stride()[2:] == engine.stride()[2:]
    assert timed.stride(1) == engine.stride(1) and not timed.is_contiguous()
