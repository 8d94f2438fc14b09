"""Every family through the public engine API under preemption: greedy outputs equal transformers' when a
KV pool too small for the batch makes the scheduler evict running requests and recompute them (the rest of
the matrix, chunk sizes x cache backends, prefix caching and chunked-vs-whole logits, is in tests/engine:
test_greedy_vs_hf, test_prefix_caching, test_chunked_prefill, test_deterministic); and the memory plan of the real MoE checkpoints, every expert counted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import ladle.models
from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig
from ladle.engine.kv_spec import KVCacheSpec
from ladle.engine.memory import GIB, InsufficientMemory, plan_kv_cache
from ladle.models import arch_from_config
from tests.conftest import build_tiny_hf_model
from tests.engine.helpers import GREEDY, drive, hf_greedy, make_engine, random_prompt

CONF = Path(__file__).resolve().parents[2] / "ladle" / "conf" / "model"
FAMILIES = ["llama", "qwen3", "gemma3", "qwen2", "mistral", "phi3", "qwen3_moe", "mixtral"]
LENGTHS = [40, 23, 57, 9]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_under_preemption(tiny_hf_model_dir, family):
    hf = build_tiny_hf_model(family)
    prompts = [random_prompt(n, seed=n) for n in LENGTHS]
    # 14 blocks of 8 tokens hold 112 tokens; the four requests end with 72 + 55 + 89 + 41 of them.
    eng = make_engine(tiny_hf_model_dir(family), block_size=8, num_blocks=14, prefix_caching=False, size=16)
    preempted, preempt = [], eng.scheduler._preempt
    eng.scheduler._preempt = lambda victim, out: (preempted.append(victim.request_id), preempt(victim, out))
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    done = drive(eng).finished
    assert preempted, "the pool was meant to force preemption"
    for rid, prompt in zip(ids, prompts):
        assert done[rid].output_token_ids == hf_greedy(hf, prompt), f"prompt of {len(prompt)} tokens"


# -- the memory plan counts every expert --------------------------------------------------------------

def preset_architecture(name: str) -> dict:
    return yaml.safe_load((CONF / f"{name}.yaml").read_text())["architecture"]


def moe_config(name: str, dtype: str = "bfloat16") -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=None, architecture=preset_architecture(name), random_weights=True, device="cpu",
                          dtype=dtype),
        cache=CacheConfig(max_model_len=4096, memory_gb=1.0), chunking=ChunkingConfig(size=256))


def plan(name: str, available_gib: float):
    config = moe_config(name)
    arch = arch_from_config(preset_architecture(name))
    spec = KVCacheSpec.build(config.cache, arch, torch.bfloat16)
    return arch, lambda: plan_kv_cache(config, arch, spec, torch.device("cpu"), available_bytes=int(available_gib * GIB))


def test_qwen3_30b_a3b_weights_count_all_128_experts():
    arch, make = plan("qwen3_30b_a3b", 80)
    memory_plan, _ = make()
    assert memory_plan.weights_bytes == 2 * arch.num_parameters()
    assert 30.4e9 < arch.num_parameters() < 30.6e9  # 3.3B of them active per token: the rest counted too
    arch, make = plan("qwen3_30b_a3b", 48)
    with pytest.raises(InsufficientMemory, match=f"weights {2 * arch.num_parameters() / GIB:.1f} GiB"):
        make()


def test_mixtral_8x7b_in_bf16_does_not_fit_80_gib():
    arch, make = plan("mixtral_8x7b", 80)
    with pytest.raises(InsufficientMemory, match=f"weights {2 * arch.num_parameters() / GIB:.1f} GiB"):
        make()


def test_mixtral_random_weights_refused_before_any_weight_is_made(monkeypatch):
    """model=mixtral_8x7b model.random_weights=true on this host: the plan refuses it with the numbers (174
    GiB of float32 weights) before the model is built."""
    def no_load(*args, **kwargs):
        raise AssertionError("the model must not be built")

    monkeypatch.setattr(ladle.models, "load_model", no_load)
    with pytest.raises(InsufficientMemory, match=r"weights 17\d\.\d GiB"):
        LLMEngine(moe_config("mixtral_8x7b", dtype="float32"))
