"""model.compile: the torch.compile'd forward gives the same greedy tokens as eager and transformers, in
one graph for every step width, compiled in the engine's warm-up (never inside a step).

Runs in CI on the CPU (inductor generates C++; gcc is needed). Tiny models keep each compile to a few
seconds; inductor's on-disk cache makes every compile of a graph already built almost free.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from tests.conftest import build_tiny_hf_model
from tests.engine.helpers import GREEDY, drive, hf_greedy, random_prompt

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROOT = Path(__file__).resolve().parents[2]
CAUSAL_LM = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
LENGTHS = [1, 7, 17, 40]  # a 1-token prefill; prompts within, at and across the chunk of 16


def make_engine(path, compile: bool, backend: str = "paged", max_num_seqs: int = 8, **chunking) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(path), dtype="float32", device="cpu", compile=compile),
            cache=CacheConfig(backend=backend, max_model_len=512),
            chunking=ChunkingConfig(**chunking),
            max_num_seqs=max_num_seqs,
        )
    )


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def hf_reference():
    cache = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            model = build_tiny_hf_model(family)
            cache[family] = [hf_greedy(model, random_prompt(n, seed=n)) for n in LENGTHS]
        return cache[family]

    return get


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen2", "mistral", "phi3"])  # MoE: refused
def test_compiled_greedy_equals_eager_and_transformers(tiny_hf_model_dir, hf_reference, family, backend):
    prompts = [random_prompt(n, seed=n) for n in LENGTHS]
    compiled = make_engine(tiny_hf_model_dir(family), True, backend, size=16)
    assert compiled.model.compiled and compiled.compile_seconds is not None
    eager = make_engine(tiny_hf_model_dir(family), False, backend, size=16)
    assert not eager.model.compiled
    got = [o.output_token_ids for o in compiled.generate(prompts, GREEDY)]
    assert got == [o.output_token_ids for o in eager.generate(prompts, GREEDY)]
    assert got == hf_reference(family)


def test_one_graph_for_every_width_and_no_compile_inside_steps(tiny_hf_model_dir):
    """200+ steps whose widths vary (1-token prefills, chunks, ragged decode batches, ubatch cuts):
    no step compiles (the 1-token width included: the token count is unbacked, never specialised)."""
    eng = make_engine(tiny_hf_model_dir("qwen3"), True, max_num_seqs=5, size=13, ubatch=9)
    before = graphs_compiled()
    # Positive control: count the forwards that go through the compiled function (the graph check below
    # would pass as well if the engine never took the compiled path).
    compiled, calls = eng.model._compiled, []

    def counted(*args, **kwargs):
        calls.append(1)
        return compiled(*args, **kwargs)

    eng.model._compiled = counted
    g = torch.Generator().manual_seed(0)
    lengths = [1, 1, 2, 3] + torch.randint(1, 60, (26,), generator=g).tolist()
    for i, n in enumerate(lengths):
        eng.add_request(random_prompt(n, seed=i), SamplingParams(max_tokens=int(5 + 13 * (i % 5)),
                                                                 temperature=0.0, ignore_eos=True))
    ran = drive(eng).steps
    steps, forwards = len(ran), sum(s.num_forwards for s in ran)
    widths = {s.decode_tokens + s.prefill_tokens for s in ran}
    assert steps >= 200 and len(widths) >= 5, (steps, widths)
    assert len(calls) == forwards >= steps, "every forward ran through the compiled function"
    assert before >= 1, "no graph was ever compiled: the counter below would not see one either"
    # No step compiled anything: the one graph was ready before the first step (the warm-up built it,
    # or an earlier engine of this architecture in this process did: instances share it).
    assert graphs_compiled() == before, "a step compiled a graph: the warm-up should have made the only one"


def test_compiles_without_triton(tiny_hf_model_dir):
    """On a CPU-only install (no triton package) the compiled forward still builds and runs."""
    path = tiny_hf_model_dir("llama")
    code = textwrap.dedent(f"""
        import sys
        sys.modules["triton"] = None  # import triton -> ImportError, as on a machine without it
        from ladle.engine import CacheConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
        eng = LLMEngine(EngineConfig(model=ModelConfig(path={str(path)!r}, dtype="float32", device="cpu",
                                                       compile=True), cache=CacheConfig(max_model_len=64)))
        out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert eng.model.compiled and len(out[0].output_token_ids) == 4, out
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         check=False)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_compiled_decode_launches_fewer_kernels_per_layer(family):
    """Inductor's graph per decoder layer: 4 matmuls (5 in the last), the attention op and ~4 fused kernels for every
    norm, residual add, RoPE and activation (eager: 29 / 36 / 53 aten ops)."""
    from ladle.models import load_model
    from ladle.models.op_count import compiled_kernels_per_layer, decode_ops_per_layer
    from tests.conftest import TINY_HF_MODELS

    cls = CAUSAL_LM[family]
    model = load_model(None, {"architectures": [cls], **TINY_HF_MODELS[family][1]}, torch.float32, "cpu")
    eager = decode_ops_per_layer(model, [40, 35, 33])["compute"]
    compiled = compiled_kernels_per_layer(model, [40, 35, 33])
    # 4 matmuls a layer, and the last one's q apart from its k|v (it projects the kept rows' queries only)
    layers = model.arch.num_layers
    assert compiled["library"] * layers == pytest.approx(4 * layers + 1) and compiled["attention"] == 1, compiled
    assert compiled["kernels"] <= 10 < eager, (compiled, eager)


def assert_compiled_is_eager_bitwise(model) -> None:
    """A 100-token prompt's logits (chunks of 37) and a 40-token greedy continuation, eager then compiled:
    the logits bit for bit, the tokens equal."""
    from tests.models.ladle_driver import greedy, prompt_logits

    ids = random_prompt(100, seed=0)
    with torch.inference_mode():
        eager_logits, eager_tokens = prompt_logits(model, ids, chunk=37), greedy(model, ids[:20], 40)[1]
        model.enable_compile()
        compiled_logits, compiled_tokens = prompt_logits(model, ids, chunk=37), greedy(model, ids[:20], 40)[1]
    torch.testing.assert_close(compiled_logits, eager_logits, atol=0, rtol=0)
    assert compiled_tokens == eager_tokens


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_compiled_bf16_is_bit_identical_to_eager(family):
    """bf16 (the CUDA default): the compiled forward rounds as eager does, so logits are bit-identical and
    greedy tokens equal (with inductor's defaults, fused fp32 intermediates and mm + residual -> addmm
    changed logits by up to 0.05 and llama's greedy continuation). On LADLE_TEST_DEVICE's device: inductor
    writes C++ on the CPU and Triton on a GPU."""
    from ladle.models import load_model
    from tests.conftest import TEST_DEVICE, TINY_HF_MODELS

    cls = CAUSAL_LM[family]
    arch = {"architectures": [cls], **TINY_HF_MODELS[family][1], "initializer_range": 0.08}
    model = load_model(None, arch, torch.bfloat16, TEST_DEVICE, seed=3)
    assert_compiled_is_eager_bitwise(model)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_compiled_fp32_cpu_is_bit_identical_to_eager(family):
    """fp32 on CPU: the compiled forward calls the fused C++ kernels (kernels/cpu_fused.py) as custom ops,
    the packed linear and the attention op as eager does, so its logits are eager's, bit for bit (with
    inductor's own code for the norms, RoPE and activation they differed in the last bits)."""
    from ladle.kernels import cpu_fused
    from ladle.models import load_model
    from tests.conftest import TINY_HF_MODELS

    if not cpu_fused.enabled():
        pytest.skip("the fused CPU kernels are not available here")
    cls = CAUSAL_LM[family]
    model = load_model(None, {"architectures": [cls], **TINY_HF_MODELS[family][1]}, torch.float32, "cpu", seed=3)
    assert_compiled_is_eager_bitwise(model)


def test_models_past_the_recompile_limit_share_one_graph():
    """More compiled fp32 models of one architecture in one process than dynamo's recompile limit (an
    engine sweep, a server reloading): all run on one graph, each with its own weights (the packed linear's
    module key is a graph input, not a guarded constant: with it constant, the ninth model's first
    forward raised FailOnRecompileLimitHit under fullgraph=True)."""
    from ladle.models import load_model
    from tests.conftest import TINY_HF_MODELS
    from tests.models.ladle_driver import prompt_logits

    arch = {"architectures": [CAUSAL_LM["qwen3"]], **TINY_HF_MODELS["qwen3"][1]}
    ids = random_prompt(12, seed=1)
    torch._dynamo.reset()
    before = graphs_compiled()
    for seed in range(torch._dynamo.config.recompile_limit + 2):  # other weights each time
        compiled = load_model(None, arch, torch.float32, "cpu", seed=seed)
        compiled.enable_compile()
        eager = load_model(None, arch, torch.float32, "cpu", seed=seed)
        with torch.inference_mode():
            got, want = prompt_logits(compiled, ids, chunk=5), prompt_logits(eager, ids, chunk=5)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert graphs_compiled() - before == 1


def test_copied_and_pickled_compiled_models_run_their_own_weights():
    """copy.deepcopy and torch.save/load of a compiled model give a compiled model of the copy's own
    modules (the compiled function was shared by the copy, so its forward ran the original's layers under
    the copy's LM head; and torch.save failed on it)."""
    import copy
    import io

    from ladle.models import load_model
    from tests.conftest import TINY_HF_MODELS
    from tests.models.ladle_driver import prompt_logits

    arch = {"architectures": [CAUSAL_LM["llama"]], **TINY_HF_MODELS["llama"][1]}
    ids = random_prompt(12, seed=2)
    original = load_model(None, arch, torch.float32, "cpu", seed=4)
    original.enable_compile()
    eager = load_model(None, arch, torch.float32, "cpu", seed=4)
    with torch.inference_mode():
        want = prompt_logits(eager, ids, chunk=5)
        assert torch.equal(prompt_logits(original, ids, chunk=5), want)
    buffer = io.BytesIO()
    torch.save(original, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(original)
    with torch.no_grad():
        for model in (copied, eager):
            for p in model.parameters():
                p.mul_(0.75)
            model.derive_weights()
    with torch.inference_mode():
        assert loaded.compiled and torch.equal(prompt_logits(loaded, ids, chunk=5), want)
        assert copied.compiled and torch.equal(prompt_logits(copied, ids, chunk=5), prompt_logits(eager, ids, chunk=5))
