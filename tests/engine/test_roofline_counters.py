"""benchmarks/experiments/roofline.py counts each kernel call's work: its attention FLOP and byte counts must be the causal
pairs and visible K/V a brute-force count gives, and its wrappers must see every call the engine makes (a
model that stopped calling the kernels through their modules would leave the report silently empty)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ladle.engine import SamplingParams
from ladle.kernels import cpu_gemm, cpu_layers, cpu_paged
from tests.engine.helpers import make_engine, random_prompt

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / "experiments"), str(BENCHMARKS)]  # the script, and benchutil / vs_vllm it imports
roofline = pytest.importorskip("roofline")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_attention_work_is_the_causal_pairs_and_the_one_row_queries_bytes():
    heads, kv_heads, dim = 4, 2, 8
    q_lens, contexts = [5, 1, 3, 1], [0, 9, 7, 30]  # a first chunk, a decode, a later chunk, a decode
    seq_lens = [c + n for c, n in zip(contexts, q_lens)]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = SimpleNamespace(query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)
    q = torch.zeros(starts[-1], heads, dim)
    k = torch.zeros(starts[-1], kv_heads, dim)
    cache = torch.zeros(2, 4, 16, kv_heads, dim, dtype=torch.bfloat16)
    kind, flops, kv_bytes = roofline.attention_work(q, k, cache, meta)
    pairs = sum(pos + 1 for c, n in [(0, 5), (7, 3)] for pos in range(c, c + n))  # each query sees keys 0..itself
    assert kind == "calls with prefill rows"
    assert flops == 4 * pairs * heads * dim
    assert kv_bytes == (10 + 31) * kv_heads * dim * 2 * 2  # K and V, bf16
    decode_meta = SimpleNamespace(query_start_loc_cpu=[0, 1, 2], seq_lens_cpu=[10, 31])
    assert roofline.attention_work(q[:2], k[:2], cache, decode_meta)[:2] == ("calls of one-row queries only", 0.0)


@pytest.fixture
def kernels_restored(monkeypatch):
    """roofline.install replaces module attributes for good: put every one back after the test (a wrapper left
    behind would run inside the compiled models of later tests, where its timer calls cannot be traced)."""
    for module, name in roofline.wrapped_attributes():
        monkeypatch.setattr(module, name, getattr(module, name))
    stack = cpu_layers.enabled()  # install() switches the layer stack off
    yield  # monkeypatch undoes the setattrs after the test
    cpu_layers.set_enabled(stack)


def test_the_counters_see_every_kernel_call(tiny_hf_model_dir, kernels_restored):
    if not (cpu_gemm.available() and cpu_paged.load_library() is not None):
        pytest.skip("the CPU GEMM or attention kernel is not built here")
    eng = make_engine(tiny_hf_model_dir("qwen3"), size=64, max_num_seqs=4, device="cpu")  # the CPU kernels' counters
    counters = roofline.Counters(peak_gflops=100.0, bandwidth_gbs=20.0)
    roofline.install(counters)
    outs = eng.generate([random_prompt(n, seed=n) for n in (5, 23, 40)],
                        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert [len(o.output_token_ids) for o in outs] == [3, 3, 3]
    # Every linear layer ran through kernels/cpu_gemm, so the GEMM counters saw all of the linear work.
    assert roofline.outside_cpu_gemm(eng.model) == []
    layers = eng.model.arch.num_layers
    attention_calls = sum(c[0] for c in counters.attn.values())
    assert attention_calls > 0 and attention_calls % layers == 0  # every layer of every forward
    by_shape = [v for key, v in counters.gemm.items() if not key.startswith("rows")]
    by_rows = [v for key, v in counters.gemm.items() if key.startswith("rows")]
    assert by_shape and by_rows
    # Each call is counted once by its shape and once by its row count: the two views agree.
    assert sum(v[0] for v in by_shape) == sum(v[0] for v in by_rows) > 0
    assert sum(v[2] for v in by_shape) == sum(v[2] for v in by_rows) > 0
    assert sum(v[3] for v in by_shape) == pytest.approx(sum(v[3] for v in by_rows))
    # A call's floor is the longer of its FLOPs at the peak and its weight's bytes at the bandwidth: the tiny
    # model's few-row calls are bound by the weight's bytes, so the floors add up to more than the FLOPs' time.
    flops_time = sum(v[2] for v in by_rows) / 100e9
    assert sum(v[3] for v in by_rows) > flops_time
    assert counters.fused["add_rms_norm"][0] > 0


def test_a_layer_outside_cpu_gemm_is_named_and_a_zero_row_call_has_no_floor(tiny_hf_model_dir, monkeypatch,
                                                                              kernels_restored):
    if not cpu_gemm.available():
        pytest.skip("the CPU GEMM kernel is not built here")
    eng = make_engine(tiny_hf_model_dir("qwen3"), size=64, max_num_seqs=4, device="cpu")  # the CPU kernels' counters
    eng.generate([random_prompt(7, seed=1)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    from ladle.models.linear import Linear

    name, layer = next((n, m) for n, m in eng.model.named_modules() if isinstance(m, Linear))
    packed = layer._packed
    monkeypatch.setattr(layer, "_packed", layer.weight.detach().clone())  # as a oneDNN-packed layer holds
    assert roofline.outside_cpu_gemm(eng.model) == [name]
    counters = roofline.Counters(peak_gflops=100.0, bandwidth_gbs=20.0)
    roofline.install(counters)
    out = cpu_gemm.gemm(torch.zeros(0, packed.in_features), packed)  # the kernel returns before reading
    assert out.shape == (0, packed.out_features)
    calls, _, flops, floor = counters.gemm["rows 1-8"]
    assert (calls, flops, floor) == (1, 0.0, 0.0)


def _result(**over) -> dict:
    r = {"threads": 1, "peak_gflops": 100.0, "peak_one_gflops": 100.0, "bandwidth_gbs": 20.0, "seconds": 2.0,
         "wall_seconds": 2.0, "outside_cpu_gemm": [], "gemm": {}, "attention": {}, "fused": {}}
    r.update(over)
    return r


def test_the_report_survives_missing_parts_and_says_what_it_could_not_count():
    text = roofline.table(_result(peak_gflops=0.0, outside_cpu_gemm=["model.layers.0.mlp.down_proj"]), 3.0)
    assert "no floors" in text and "model.layers.0.mlp.down_proj" in text
    # The peer line compares wall with wall: 1.2x over 3.0 s needs 2.5 s, this run's wall is 2.0 s.
    assert "already there" in text
    text = roofline.table(_result(gemm={"64 x 64": [3, 1.0, 2e9, 0.02], "rows 1-8": [3, 1.0, 2e9, 0.02]},
                                  seconds=1.5, wall_seconds=3.6), 3.0)
    assert "2.0 GFLOP/s" in text and "1.10 s less than this run's 3.60 s wall" in text
    assert "| **the timed generate** |  |  | 1.50 |  | 0.02 | 1.48 |" in text
    two = roofline.table(_result(threads=2, peak_gflops=105.0, peak_one_gflops=100.0), None)
    assert "1.05x one thread's" in two

