"""conf/model/*.yaml: every preset parses, has the published size, and the tiny default runs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from ladle.models import (
    ByteTokenizer,
    RandomWeightsWarning,
    arch_from_config,
    build_model,
    load_model,
    load_tokenizer,
)
from tests.models.ladle_driver import greedy

CONF = Path(__file__).resolve().parents[2] / "ladle" / "conf" / "model"
PUBLISHED = {  # parameters (embeddings included, tied counted once), from the model cards
    "qwen3_0_6b": 0.596e9,
    "qwen3_4b": 4.02e9,
    "llama3_2_3b": 3.21e9,
    "gemma3_1b": 1.00e9,
    "qwen2_5_7b": 7.61e9,
    "mistral_7b_v0_3": 7.25e9,
    "phi4_mini": 3.836e9,
    "qwen3_30b_a3b": 30.5e9,
    "mixtral_8x7b": 46.7e9,
}


def preset(name: str) -> dict:
    return yaml.safe_load((CONF / f"{name}.yaml").read_text())


def test_every_preset_file_is_listed():
    assert {p.stem for p in CONF.glob("*.yaml")} == set(PUBLISHED) | {"tiny"}


@pytest.mark.parametrize("name", [*PUBLISHED, "tiny"])
def test_preset_parses_like_hydra_would(name):
    raw = preset(name)
    via_omegaconf = OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"), resolve=True)
    assert via_omegaconf == raw
    assert raw["name"] == name
    assert set(raw) <= {"name", "path", "architecture", "tokenizer", "dtype", "device", "seed"}
    arch = arch_from_config(raw["architecture"])
    with torch.device("meta"):
        model = build_model(arch, torch.bfloat16, "meta")
    counted = sum(p.numel() for p in model.parameters())
    assert counted == arch.num_parameters()
    if name in PUBLISHED:
        assert abs(counted - PUBLISHED[name]) / PUBLISHED[name] < 0.01, counted
        assert "/" in raw["path"]  # an HF repo id


def test_real_preset_details():
    gemma = arch_from_config(preset("gemma3_1b")["architecture"])
    assert gemma.sliding_window == 512 and gemma.eos_token_ids == [1, 106]
    assert [i for i, t in enumerate(gemma.layer_types) if t == "full_attention"] == [5, 11, 17, 23]
    assert gemma.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert gemma.rope_parameters["full_attention"]["rope_theta"] == 1e6
    llama = arch_from_config(preset("llama3_2_3b")["architecture"])
    assert llama.rope_parameters["full_attention"]["rope_type"] == "llama3"
    assert llama.eos_token_ids == [128001, 128008, 128009] and llama.tie_word_embeddings
    qwen = arch_from_config(preset("qwen3_4b")["architecture"])
    assert qwen.sliding_window is None and qwen.num_kv_heads == 8 and qwen.head_dim == 128


def test_new_family_preset_details():
    qwen2 = arch_from_config(preset("qwen2_5_7b")["architecture"])
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.sliding_window is None  # use_sliding_window
    mistral = arch_from_config(preset("mistral_7b_v0_3")["architecture"])
    assert mistral.sliding_window is None and mistral.layer_types == ["full_attention"] * 32  # an explicit null
    phi = arch_from_config(preset("phi4_mini")["architecture"])
    rope = phi.rope_parameters["full_attention"]
    assert phi.head_dim == 128 and phi.rotary_dim == 96 and phi.tie_word_embeddings
    assert rope["rope_type"] == "longrope" and len(rope["long_factor"]) == 48 and rope["original_max_position_embeddings"] == 4096
    assert rope["attention_factor"] == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    qwen_moe = arch_from_config(preset("qwen3_30b_a3b")["architecture"])
    assert (qwen_moe.num_experts, qwen_moe.num_experts_per_tok, qwen_moe.moe_intermediate_size) == (128, 8, 768)
    assert qwen_moe.norm_topk_prob and all(qwen_moe.sparse_layers) and qwen_moe.head_dim == 128
    mixtral = arch_from_config(preset("mixtral_8x7b")["architecture"])
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 14336)


def test_tiny_default_runs_with_the_byte_tokenizer():
    cfg = preset("tiny")
    assert cfg["path"] is None and cfg["tokenizer"] == "byte"
    with pytest.warns(RandomWeightsWarning):
        model = load_model(cfg["path"], cfg["architecture"], torch.float32, "cpu", seed=0)
    tok = load_tokenizer(cfg["path"], model.arch.vocab_size, cfg["tokenizer"])
    assert isinstance(tok, ByteTokenizer)
    assert model.arch.eos_token_ids == tok.eos_token_ids and model.arch.bos_token_id == tok.bos_token_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello, wörld!"}])
    _, out = greedy(model, prompt, 8)
    assert len(out) == 8 and all(0 <= t < model.arch.vocab_size for t in out)
    assert isinstance(tok.decode(out), str)
