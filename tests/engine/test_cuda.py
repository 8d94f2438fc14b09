"""On a CUDA GPU: greedy outputs equal transformers' in bf16, and CUDA-graph decodes equal eager ones.

Skipped without a GPU. `LADLE_TEST_DEVICE=cuda pytest` also runs the engine and model suites on the
GPU (tests/conftest.py); these tests are the GPU's own: bf16 against transformers on the same device,
and the decode graphs (engine/cuda_graphs.py) against eager forwards of the same engine.
"""

from __future__ import annotations

import math

import pytest
import torch

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from tests.conftest import build_tiny_hf_model
from tests.engine.helpers import random_prompt, run_to_completion

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW_TOKENS = 24


def cuda_engine(path, dtype: str, *, graphs: bool = True, max_num_seqs: int = 8, size: int = 64) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(path=str(path), dtype=dtype, device="cuda", cuda_graphs=graphs),
        cache=CacheConfig(max_model_len=512, num_blocks=512),
        chunking=ChunkingConfig(size=size),
        max_num_seqs=max_num_seqs,
    ))


@torch.inference_mode()
def hf_greedy_with_margins(hf, prompt: list[int], n: int) -> tuple[list[int], list[float], list[float]]:
    """transformers' greedy tokens, and at each step the gap between its best and second-best logit and
    the best logit's magnitude (what says whether a bf16 rounding can flip the choice)."""
    ids = torch.tensor([prompt], device="cuda")
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                      eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps, tops = [], []
    for scores in out.scores:
        top2 = scores[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        tops.append(float(top2[0].abs()))
    return tokens, gaps, tops


def near_tie(gap: float, top: float) -> bool:
    """Two logits within 4 bf16 units in the last place of the larger: the two systems' roundings
    (Triton's and transformers' attention, different GEMM kernels) may order them either way."""
    ulp = 2.0 ** (math.floor(math.log2(max(top, 1e-3))) - 7)
    return gap <= 4 * ulp


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_bf16_greedy_on_cuda_matches_transformers(tiny_hf_model_dir, name):
    hf = build_tiny_hf_model(name).to("cuda", torch.bfloat16)
    eng = cuda_engine(tiny_hf_model_dir(name), "bfloat16")
    prompts = [random_prompt(n, seed=n) for n in (1, 17, 100, 300)]  # 300: chunked, past Gemma's window
    outs = eng.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    compared = 0
    for prompt, out in zip(prompts, outs):
        ref, gaps, tops = hf_greedy_with_margins(hf, prompt, NEW_TOKENS)
        ours = out.output_token_ids
        for i, (a, b) in enumerate(zip(ours, ref)):
            if a != b:
                assert near_tie(gaps[i], tops[i]), (
                    f"{name}, prompt of {len(prompt)}: token {i} differs ({a} vs transformers' {b}) where "
                    f"transformers' top-2 gap is {gaps[i]:.4f} at |logit| {tops[i]:.2f}: not a rounding tie")
                break  # past a tie the continuations are different texts
            compared += 1
    # A tie cuts a comparison short; most tokens must still have been compared (not a vacuous pass).
    assert compared >= 0.5 * NEW_TOKENS * len(prompts), f"only {compared} tokens compared before ties"
    assert eng.model_runner.graph_steps > 0  # the decodes ran from CUDA graphs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decodes_equal_eager(tiny_hf_model_dir, dtype):
    """Batches of every size 1..7 (so padded buckets too), requests leaving at different steps."""
    path = tiny_hf_model_dir("qwen3")
    prompts = [random_prompt(n, seed=n) for n in (3, 40, 17, 90, 5, 64, 33)]
    params = [SamplingParams(max_tokens=4 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    results = {}
    for graphs in (False, True):
        eng = cuda_engine(path, dtype, graphs=graphs)
        results[graphs] = [o.output_token_ids for o in eng.generate(prompts, params)]
        assert (eng.model_runner.graph_steps > 0) == graphs
        assert (eng.graph_capture_s is not None) == graphs
    assert results[True] == results[False]


def test_cuda_graphs_keep_the_cache_and_blocks_intact(tiny_hf_model_dir):
    """Padding rows write nothing: a second pass served from prefix-cached blocks gives the same tokens."""
    eng = cuda_engine(tiny_hf_model_dir("gemma3"), "float32", max_num_seqs=6)
    prompts = [random_prompt(n, seed=100 + n) for n in (33, 48, 70)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    first = sorted((o.request_id, o.output_token_ids) for o in run_to_completion(eng).values())
    again = [o.output_token_ids for o in eng.generate(prompts, params)]
    assert [t for _, t in first] == again
    assert eng.model_runner.graph_steps > 0


def test_a_graph_left_in_a_cycle_does_not_fail_a_later_capture(tiny_hf_model_dir):
    """A collection during a capture that destroys another graph fails the capture ("operation not permitted
    when stream is capturing"): seen in a GPU run where an earlier engine's graphs sat in a reference cycle (a
    test's patch of its runner made it; a user's patch, or a compiled model for its weights, can too).
    Here a collection runs inside the capture whenever the collector is on (as an automatic one would), with
    a captured graph in a cycle as garbage: the captures collected it first and kept the collector off."""
    import gc

    path = tiny_hf_model_dir("qwen3")
    eng = cuda_engine(path, "float32", max_num_seqs=4)
    prompts = [random_prompt(n, seed=n) for n in (5, 21)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = [o.output_token_ids for o in eng.generate(prompts, params)]

    graphs = eng.model_runner.graphs
    forward = graphs._forward

    def collecting_forward(meta):
        if torch.cuda.is_current_stream_capturing() and gc.isenabled():
            gc.collect()
        return forward(meta)

    class Cycle:
        def __init__(self, graph):
            self.graph, self.me = graph, self

    gc.disable()  # the cycle stays uncollected until the capture
    try:
        stray = torch.cuda.CUDAGraph()
        with torch.cuda.graph(stray):
            torch.zeros(1, device="cuda").add_(1)
        Cycle(stray)
        del stray
    finally:
        gc.enable()
    graphs._forward = collecting_forward
    graphs.graphs.clear()
    try:
        graphs.capture()
    finally:
        del graphs._forward  # the class's method again: the patch would hold the graphs in a cycle
    steps = eng.model_runner.graph_steps
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == before
    assert eng.model_runner.graph_steps > steps
