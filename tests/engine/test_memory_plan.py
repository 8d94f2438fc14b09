"""The memory plan: a run that cannot fit stops before anything big is allocated, with the numbers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig
from ladle.engine.kv_spec import KVCacheSpec
from ladle.engine.memory import GIB, InsufficientMemory, activation_bytes, plan_kv_cache, profile_peak_bytes
from ladle.models import resolve_architecture

QWEN3_4B = {  # the published config.json's shapes (random weights: nothing is loaded here)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1e6, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}


def _config(**cache) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path=None, architecture=QWEN3_4B, device="cpu"),
                        cache=CacheConfig(max_model_len=4096, **cache), chunking=ChunkingConfig(size=256))


def _arch():
    return resolve_architecture(None, QWEN3_4B)[1]


def plan_for(config: EngineConfig, elem: int, **kw):
    """plan_kv_cache for the model in fp32 (elem 4) or bf16 (elem 2) on the CPU."""
    spec = KVCacheSpec.build(config.cache, _arch(), {4: torch.float32, 2: torch.bfloat16}[elem])
    return plan_kv_cache(config, _arch(), spec, torch.device("cpu"), **kw)


def test_qwen3_4b_fp32_on_a_24_gib_machine_with_other_work_is_refused_with_the_numbers():
    """The new user's `model=qwen3_4b chunking.size=256` in fp32: 16 GB of weights + a 4 GiB cache."""
    with pytest.raises(InsufficientMemory) as err:
        plan_for(_config(memory_gb=4.0), 4, available_bytes=18 * GIB)
    msg = str(err.value)
    assert "weights 15.0 GiB" in msg  # the packed copies are dropped first (they do not fit either) and "18.0 GiB of available host memory" in msg
    assert "model.dtype=bfloat16" in msg and "cache.memory_gb" in msg and "smaller model" in msg


def test_a_cache_size_ladle_chose_shrinks_to_what_is_left():
    plan, blocks = plan_for(_config(), 4, available_bytes=int(17.5 * GIB))
    assert plan.total_bytes <= 17.5 * GIB and blocks * 16 >= 4096  # still one full-length sequence
    roomy, roomy_blocks = plan_for(_config(), 4, available_bytes=64 * GIB)
    assert roomy.kv_bytes <= 4 * GIB + 16 * roomy.kv_bytes_per_token and roomy_blocks > blocks  # CPU cap


@pytest.mark.parametrize("elem", [4, 2])
def test_the_cpu_cap_and_memory_gb_count_the_gap_between_planes(elem):
    """The CPU cache's V plane sits up to 2 MiB past its K plane (engine/kv_spec.cpu_plane_stride): the 4 GiB
    cap and cache.memory_gb hold the pool with those gaps, and lose no more blocks to them than the gaps' bound."""
    for config, budget in ((_config(), 4 * GIB), (_config(memory_gb=1.5), int(1.5 * GIB))):
        spec = KVCacheSpec.build(config.cache, _arch(), {4: torch.float32, 2: torch.bfloat16}[elem])
        _plan, blocks = plan_for(config, elem, available_bytes=64 * GIB)
        used = blocks * spec.page_bytes + spec.gap_bytes(blocks, "cpu")
        assert spec.gap_bytes(blocks, "cpu") > 0 and used <= budget
        assert blocks >= (budget - spec.num_layers * 2 * 2**20) // spec.page_bytes


def test_not_even_one_full_length_sequence_fits():
    with pytest.raises(InsufficientMemory, match="cache.max_model_len"):
        plan_for(_config(), 4, available_bytes=int(15.5 * GIB))


def test_an_explicit_cache_size_is_not_shrunk_behind_the_users_back():
    with pytest.raises(InsufficientMemory):
        plan_for(_config(num_blocks=100_000), 2, available_bytes=20 * GIB)
    _plan, blocks = plan_for(_config(num_blocks=1000), 2, available_bytes=20 * GIB)
    assert blocks == 1000


def test_activations_grow_with_the_step_budget():
    from ladle.engine.memory import shape_of

    s = shape_of(_arch())
    small, mid, big = (activation_bytes(s, t, 64, 4096, 2) for t in (256, 512, 8192))
    assert big - small == (8192 - 256) // 256 * (mid - small) > 0  # linear in the step's tokens
    # Beyond the forward: the sampler's float32 copies of one logits row per running sequence.
    assert small > 2 * 64 * s.vocab_size * 4 * 6



def test_the_engine_refuses_before_loading_weights(monkeypatch):
    """The check runs on config files alone: the refused run never allocates the 16 GB of weights."""
    from ladle import models
    from ladle.engine import memory

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 8 * GIB)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(InsufficientMemory, match="8.0 GiB"):
        LLMEngine(_config())


def test_profile_run_runs_a_forward_at_the_step_width(tiny_hf_model_dir):
    from ladle.models import load_model

    model = load_model(str(tiny_hf_model_dir("qwen3")), None, torch.float32, "cpu")
    assert profile_peak_bytes(model, 300, 128) is None  # CPU: no allocator counter, the estimate stands


def test_prompt_logprob_logits_are_budgeted(monkeypatch):
    """Prompt logprobs materialise a bounded piece of [rows, vocab] logits (engine/logprobs.py) that the
    profile run never sees: the plan holds that piece's bytes (float32 copy + log_softmax + the model's
    own logits), at the rows token_logprobs really takes (qwen3_4b: 220 rows, ~383 MiB)."""
    import ladle.engine.logprobs as lp_mod
    from ladle.engine.memory import prompt_logprob_bytes, sampler_bytes, shape_of

    vocab = _arch().vocab_size
    widths = []

    def logits(h):
        widths.append(h.shape[0])
        return torch.zeros(h.shape[0], vocab)

    lp_mod.token_logprobs(logits, torch.zeros(500, 1), [0] * 500, 0, vocab, vocab)
    assert max(widths) * vocab * 12 <= prompt_logprob_bytes(vocab) < 400 * 2**20
    s = shape_of(_arch())
    assert activation_bytes(s, 256, 64, 4096, 2) >= 2 * sampler_bytes(64, vocab) + prompt_logprob_bytes(vocab)


def test_the_packed_linear_copies_are_planned_and_dropped_when_they_do_not_fit():
    """The CPU fast path holds a packed copy of every fp32 linear weight beside it (models/linear.py):
    the plan counts it where it fits and plans without it (slower GEMMs, same outputs) where not."""
    roomy, _ = plan_for(_config(), 4, available_bytes=64 * GIB)
    tight, _ = plan_for(_config(), 4, available_bytes=int(17.5 * GIB))
    assert roomy.packed_weight_bytes > 10 * GIB and roomy.weights_bytes > 25 * GIB
    assert tight.packed_weight_bytes == 0 and tight.weights_bytes < 16 * GIB


def test_more_memory_never_gives_a_smaller_kv_cache():
    """The packed copies are kept only where they cost the cache nothing (with them kept
    everywhere, 1.8x the memory gave an eighth of the cache)."""
    tokens = [plan_for(_config(), 4, available_bytes=int(gb * GIB))[0].kv_tokens for gb in range(18, 40)]
    assert tokens == sorted(tokens), tokens


def _available_after_garbage(device: torch.device, events: list[str]) -> int:
    """memory._available with an earlier engine left as garbage in a reference cycle (as a compiled model is:
    model._compiled -> model), the collector off: "collected" lands in events when the plan collects it."""
    import gc

    from ladle.engine import memory

    class EarlierEngine:
        def __init__(self):
            self.me = self

        def __del__(self):
            events.append("collected")

    gc.disable()
    try:
        EarlierEngine()
        return memory._available(device)
    finally:
        gc.enable()


def test_cuda_free_memory_is_read_after_an_earlier_engine_is_collected_and_the_cache_emptied(monkeypatch):
    """On CUDA the plan reads the driver's free memory, which counts what torch's caching allocator holds as
    used: a Hydra multirun's previous job (its KV cache ~90% of the GPU), freed or waiting in a reference
    cycle, would leave the next job ~10%. The plan collects garbage and empties the cache first."""
    from ladle.engine import memory

    events = []

    def mem_get_info(device):
        events.append("read")
        return 80 * GIB, 141 * GIB

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("emptied"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    available = _available_after_garbage(torch.device("cuda"), events)
    assert events == ["collected", "emptied", "read"]
    assert available == int(80 * GIB * memory.CUDA_UTILIZATION)


def test_host_memory_is_read_after_an_earlier_engine_is_collected_and_malloc_returns_its_pages(monkeypatch):
    """On the CPU the plan reads MemAvailable, which counts what malloc keeps of an earlier engine's memory
    (tcmalloc, which the CLI preloads, keeps freed spans): the plan collects garbage (a compiled model waits in a
    reference cycle), has malloc hand its free pages back, then reads."""
    from ladle.engine import memory

    events = []
    monkeypatch.setattr(memory, "return_free_host_memory", lambda: events.append("returned"))
    monkeypatch.setattr(memory, "available_host_bytes", lambda: events.append("read") or 7 * GIB)
    available = _available_after_garbage(torch.device("cpu"), events)
    assert events == ["collected", "returned", "read"]
    assert available == 7 * GIB


RSS_AFTER_FREE = """
import gc, torch
from ladle.engine.memory import return_free_host_memory

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

cache = [torch.ones(2**25, dtype=torch.float32) for _ in range(8)]  # 8 x 128 MiB, as a KV cache's layers
del cache
gc.collect()
kept = rss()
return_free_host_memory()
print(kept - rss())
"""


def test_returning_free_host_memory_lowers_the_resident_size_under_tcmalloc():
    """The real call, in a process with tcmalloc preloaded as the CLI runs: after 1 GiB of tensors is freed,
    tcmalloc still holds part of it (~128 MiB measured here) until asked to release it."""
    from ladle.runner import startup

    malloc = startup.find_malloc()
    if malloc is None or "tcmalloc" not in str(malloc):
        pytest.skip("tcmalloc is not installed (libtcmalloc-minimal4)")
    env = dict(os.environ, LD_PRELOAD=str(malloc), PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", RSS_AFTER_FREE], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert int(out.split()[-1]) > 32 * 2**20, out
