"""benchmarks/experiments/forward_efficiency.py stands a timing proxy in for the engine's model: the engine must still
run through it, and its FLOP count must follow what the forward computes (the last layer runs o_proj
and the MLP on the rows the forward returns only: AttentionMetadata.restrict_outputs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ladle.engine import SamplingParams
from tests.engine.helpers import make_engine, random_prompt

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / "experiments"), str(BENCHMARKS)]  # the script, and benchutil / vs_vllm it imports
forward_efficiency = pytest.importorskip("forward_efficiency")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_the_engine_runs_through_the_timing_proxy(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("qwen3"), size=64, max_num_seqs=4)
    timed = forward_efficiency.TimedModel(eng.model)
    eng.model_runner.model = timed
    outs = eng.generate([random_prompt(n, seed=n) for n in (5, 23, 40)],
                        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert [len(o.output_token_ids) for o in outs] == [3, 3, 3]
    # The first step (a budget of 64): prompts of 5 and 23 whole, 36 of the 40 (a chunk that keeps no
    # row); the forward returns the two sampling rows.
    tokens, kept, _ = timed.forwards[0]
    assert (tokens, kept) == (64, 2)


def test_forward_flops_count_the_last_layer_at_its_kept_rows():
    shapes = [(12, 4), (4, 8), (16, 4), (4, 8)]  # qkv, o, gate_up, down
    weights = sum(o * i for o, i in shapes)
    flops = forward_efficiency.forward_flops
    assert flops(shapes, 3, 10, 10) == 2 * 10 * weights * 3  # every row returned: every GEMM at 10 rows
    # Rows dropped in the last layer: its o/gate_up/down at 1 row, its qkv still at every row.
    assert flops(shapes, 3, 10, 1) == 2 * (3 * 10 * 48 + (2 * 10 + 1) * (32 + 64 + 32))
