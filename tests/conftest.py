"""Shared fixtures: tiny random HF models (transformers' own config classes), saved with save_pretrained.

    def test_x(tiny_hf_model_dir):
        path = tiny_hf_model_dir("qwen3")      # a directory: config.json, generation_config.json, safetensors
        model = ladle.models.load_model(str(path), None, torch.float32, "cpu")

Names: see TINY_HF_MODELS. Each is built once per pytest session. `build_tiny_hf_model(name)` returns the
transformers model itself (fp32, eager attention) for use as a reference.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

_COMMON = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

_LLAMA3_ROPE = {
    # A small original context so that high, medium and low frequencies all occur with head_dim 16.
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# The device the engine and model tests run on: LADLE_TEST_DEVICE=cuda runs them on the GPU (the Triton
# kernels compiled, not interpreted); CPU-only tests (the C++ kernels, op counts) stay on the CPU.
TEST_DEVICE = os.environ.get("LADLE_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"LADLE_TEST_DEVICE={TEST_DEVICE!r}: use cpu or cuda")
if TEST_DEVICE == "cuda" and not torch.cuda.is_available():
    raise pytest.UsageError("LADLE_TEST_DEVICE=cuda but torch sees no GPU: unset it to test on the CPU")


def triton_subprocess_env() -> dict[str, str]:
    """The environment of a test that runs the engine's Triton kernels in a subprocess: on the CPU they run
    interpreted (TRITON_INTERPRET=1); with LADLE_TEST_DEVICE=cuda, compiled on the GPU, where an
    interpreted run would test the interpreter (Triton 3.6's failed on NumPy 2.5 there) and not the code."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), LADLE_TEST_DEVICE=TEST_DEVICE)
    if TEST_DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env

# name -> (config class name, kwargs)
TINY_HF_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        dict(_COMMON, rope_theta=10000.0, rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=False),
    ),
    "llama_tied": ("LlamaConfig", dict(_COMMON, rope_theta=500000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(_COMMON, rope_theta=1000000.0, tie_word_embeddings=True)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            _COMMON,
            num_hidden_layers=4,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            query_pre_attn_scalar=24,
        ),
    ),
    "gemma3_softcap": (
        "Gemma3TextConfig",
        dict(
            _COMMON,
            sliding_window=8,
            sliding_window_pattern=2,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
            attn_logit_softcapping=5.0,  # stored but unused by transformers' Gemma 3 (and so by ladle)
            final_logit_softcapping=3.0,
        ),
    ),
    # q/k/v biases; layers 1 and 2 slide (max_window_layers=1), window 16
    "qwen2": (
        "Qwen2Config",
        dict(_COMMON, rope_theta=10000.0, use_sliding_window=True, sliding_window=16, max_window_layers=1),
    ),
    "mistral": ("MistralConfig", dict(_COMMON, rope_theta=10000.0, sliding_window=16)),
    # partial rotary (8 of 16 dims), LongRoPE whose switch (320) falls inside a 300-token prompt's
    # continuation, attention factor from max/original positions; tied embeddings as Phi-4-mini
    "phi3": (
        "Phi3Config",
        dict(
            _COMMON,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=320,
            rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 2.1, 3.7],
                          "long_factor": [1.1, 2.5, 6.0, 11.0]},
            tie_word_embeddings=True,
        ),
    ),
    # 8 experts, top 2, renormalised (as Qwen3-30B-A3B); layer 1 a dense MLP (mlp_only_layers)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(_COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
             mlp_only_layers=[1], rope_theta=1000000.0),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(_COMMON, num_local_experts=4, num_experts_per_tok=2, rope_theta=1000000.0),
    ),
}

_MODEL_CLASSES = {
    "LlamaConfig": "LlamaForCausalLM",
    "Qwen3Config": "Qwen3ForCausalLM",
    "Gemma3TextConfig": "Gemma3ForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "MistralConfig": "MistralForCausalLM",
    "Phi3Config": "Phi3ForCausalLM",
    "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
    "MixtralConfig": "MixtralForCausalLM",
}


def build_tiny_hf_model(name: str, seed: int = 0):
    """A transformers model for TINY_HF_MODELS[name], fp32, eager attention, deterministic random weights.

    Weights are drawn wider than HF's default init (and norms perturbed) so that logits are far from
    uniform and every parameter, including the norm weights, affects the output.
    """
    import transformers

    config_name, kwargs = TINY_HF_MODELS[name]
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, _MODEL_CLASSES[config_name])(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="session")
def tiny_hf_model_dir(tmp_path_factory) -> Callable[..., Path]:
    """tiny_hf_model_dir(name, max_shard_size=None) -> a save_pretrained directory, built once per pytest session."""
    cache: dict[tuple[str, str | None], Path] = {}

    def get(name: str, max_shard_size: str | None = None) -> Path:
        key = (name, max_shard_size)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"hf_{name}")
            model = build_tiny_hf_model(name)
            if max_shard_size:
                model.save_pretrained(path, max_shard_size=max_shard_size)
            else:
                model.save_pretrained(path)
            cache[key] = path
        return cache[key]

    return get


@pytest.fixture(params=[1, 2], ids=["threads1", "threads2"])
def threads(request):
    """Run the test at 1 and at 2 torch threads (the value), restoring the count after. Modules whose
    `threads` means something else (other counts, or only the restore) define their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
