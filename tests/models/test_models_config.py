"""ModelArch parsing: the legacy and new config forms of RoPE, layer types, HF defaults."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ladle.models import arch_from_config
from ladle.models.layers import rope_inv_freq
from tests.conftest import _MODEL_CLASSES, TINY_HF_MODELS


def hf_config(name: str):
    config_name, kwargs = TINY_HF_MODELS[name]
    return getattr(transformers, config_name)(**kwargs)


def saved_form(name: str) -> dict:
    """config.json as transformers 5 writes it (rope_parameters, layer_types...)."""
    config = hf_config(name)
    return {**config.to_dict(), "architectures": [_MODEL_CLASSES[TINY_HF_MODELS[name][0]]]}


@pytest.mark.parametrize("name", list(TINY_HF_MODELS))
def test_legacy_and_saved_forms_agree(name):
    legacy = {"architectures": [_MODEL_CLASSES[TINY_HF_MODELS[name][0]]], **TINY_HF_MODELS[name][1]}
    with pytest.warns(UserWarning) if "softcap" in name else contextlib.nullcontext():
        a, b = arch_from_config(legacy), arch_from_config(saved_form(name))
    assert a == b
    config = hf_config(name)
    # Families without layer_types (Mistral, Phi-3, Mixtral) slide in every layer when a window is set.
    every = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    assert a.layer_types == list(getattr(config, "layer_types", None) or [every] * a.num_layers)
    assert a.head_dim == config.head_dim and a.num_kv_heads == config.num_key_value_heads


@pytest.mark.filterwarnings("ignore:Gemma 3 ignores attn_logit_softcapping")
def test_gemma_rope_per_layer_type():
    arch = arch_from_config(saved_form("gemma3_softcap"))
    assert arch.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}
    assert arch.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert arch.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert arch.window(0) == 8 and arch.window(1) is None
    assert arch.attn_logit_softcapping is None and arch.final_logit_softcapping == 3.0
    assert arch.attention_scale == 256**-0.5


@pytest.mark.filterwarnings("ignore:Gemma 3 ignores attn_logit_softcapping")
@pytest.mark.parametrize("name,layer_type", [("llama", None), ("gemma3_softcap", "full_attention")])
def test_inv_freq_matches_transformers(name, layer_type):
    config = hf_config(name)
    arch = arch_from_config(saved_form(name))
    params = arch.rope_parameters[layer_type or "full_attention"]
    kwargs = {"layer_type": layer_type} if layer_type else {}
    expected, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None, **kwargs)
    assert scaling == 1.0
    torch.testing.assert_close(rope_inv_freq(params, arch.head_dim), expected, atol=0, rtol=0)


def test_qwen3_sliding_window_only_when_enabled():
    base = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 4, "sliding_window": 8}
    assert arch_from_config({**base, "max_window_layers": 2}).sliding_window is None
    arch = arch_from_config({**base, "max_window_layers": 2, "use_sliding_window": True})
    assert arch.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2 and arch.sliding_window == 8


def test_defaults_follow_transformers_config_classes():
    for family, cls in [
        ("LlamaForCausalLM", "LlamaConfig"),
        ("Qwen3ForCausalLM", "Qwen3Config"),
        ("Gemma3ForCausalLM", "Gemma3TextConfig"),
    ]:
        ours = arch_from_config({"architectures": [family]})
        theirs = getattr(transformers, cls)()
        assert ours.num_layers == theirs.num_hidden_layers and ours.vocab_size == theirs.vocab_size
        their_types = getattr(theirs, "layer_types", None) or ["full_attention"] * theirs.num_hidden_layers
        assert ours.head_dim == theirs.head_dim and ours.layer_types == list(their_types)
        assert ours.max_position_embeddings == theirs.max_position_embeddings
        assert ours.tie_word_embeddings == theirs.tie_word_embeddings


def test_model_type_alone_is_enough_and_unsupported_rope_is_named():
    assert arch_from_config({"model_type": "gemma3_text"}).architecture == "Gemma3ForCausalLM"
    with pytest.raises(ValueError, match="yarn"):
        arch_from_config({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="text-only"):
        arch_from_config({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})


@pytest.mark.parametrize("config_name, extra", [
    ("Qwen3Config", {"attention_bias": True}),  # q/k/v and o
    ("Qwen2Config", {}),  # q/k/v only, always
    ("MistralConfig", {"attention_bias": True}),  # never, whatever the key says
    ("Phi3Config", {"attention_bias": True}),
    ("LlamaConfig", {"attention_bias": True}),
])
def test_attention_biases_are_transformers_own(config_name, extra, tmp_path):
    """The checkpoint tensors ladle expects are those transformers writes, biases included."""
    from ladle.models import build_model
    from ladle.models.loader import checkpoint_pieces, checkpoint_targets

    kwargs = dict(TINY_HF_MODELS["llama_tied"][1], **extra)
    config = getattr(transformers, config_name)(**kwargs)
    hf = getattr(transformers, config_name.replace("Config", "ForCausalLM"))(config)
    arch = arch_from_config({**config.to_dict(), "architectures": [type(hf).__name__]})
    ours = set(checkpoint_targets(build_model(arch, torch.float32, "meta")))
    theirs = {piece for name in hf.state_dict() for piece, _ in checkpoint_pieces(arch, name)}
    assert {n for n in ours if n.endswith(".bias")} == {n for n in theirs if n.endswith(".bias")}
    assert ours == theirs - ({"lm_head.weight"} if arch.tie_word_embeddings else set())
