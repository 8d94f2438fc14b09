"""load_model: safetensors (single and sharded), the local HF cache, random weights, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ladle.models import RandomWeightsWarning, load_model
from tests.conftest import TINY_HF_MODELS
from tests.models.ladle_driver import prompt_logits

QWEN3_ARCH = {"architectures": ["Qwen3ForCausalLM"], **TINY_HF_MODELS["qwen3"][1]}


def load(path, architecture=None, **kw):
    return load_model(None if path is None else str(path), architecture, torch.float32, "cpu", **kw)


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError) as err:
        load(None, {"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    msg = str(err.value)
    assert "FalconForCausalLM" in msg
    for supported in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen2ForCausalLM",
                      "MistralForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        assert supported in msg


def test_missing_tensor_is_named(tiny_hf_model_dir, tmp_path):
    path = copy_model(tiny_hf_model_dir("qwen3"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\[128, 64\]"):
        load(path)


def test_misshaped_tensor_names_both_shapes(tiny_hf_model_dir, tmp_path):
    path = copy_model(tiny_hf_model_dir("qwen3"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        load(path)
    msg = str(err.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "[16, 64]" in msg and "[32, 64]" in msg


def test_repo_id_not_in_local_cache_says_where_it_looked(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    with pytest.raises(FileNotFoundError) as err:
        load("acme/not-downloaded")
    msg = str(err.value)
    assert str(tmp_path / "hf-cache") in msg and "model.path" in msg and "acme/not-downloaded" in msg


def test_repo_id_not_cached_is_an_error_even_with_an_architecture(tmp_path, monkeypatch):
    """A preset (path + architecture) whose weights are not cached stops and says how to choose,
    instead of silently running on random weights."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    with pytest.raises(FileNotFoundError) as err:
        load("acme/not-downloaded", QWEN3_ARCH)
    msg = str(err.value)
    assert "acme/not-downloaded" in msg and str(tmp_path / "hf-cache") in msg and "model.random_weights=true" in msg


def test_random_weights_are_taken_only_when_asked(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    with pytest.warns(RandomWeightsWarning, match="model.random_weights=true"):
        model = load("acme/not-downloaded", QWEN3_ARCH, random_weights=True)
    assert model.arch.architecture == "Qwen3ForCausalLM"


def test_random_weights_of_a_real_checkpoint_use_its_config(tiny_hf_model_dir):
    path = tiny_hf_model_dir("gemma3")
    with pytest.warns(RandomWeightsWarning):
        model = load(path, random_weights=True, seed=1)
    assert model.arch.family == "gemma3"
    with torch.no_grad():
        assert not torch.equal(model.model.embed_tokens.weight, load(path).model.embed_tokens.weight)


def test_a_typo_in_a_local_path_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load(tmp_path / "modles" / "qwen", QWEN3_ARCH)
    assert str(tmp_path / "modles" / "qwen") in str(err.value) and "does not exist" in str(err.value)


def test_repo_id_resolves_through_the_local_cache(tiny_hf_model_dir, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--acme--tiny-qwen3"
    shutil.copytree(tiny_hf_model_dir("qwen3"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert_same_weights(load("acme/tiny-qwen3"), load(tiny_hf_model_dir("qwen3")))


def test_sharded_checkpoint_loads(tiny_hf_model_dir):
    sharded = tiny_hf_model_dir("llama", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert_same_weights(load(sharded), load(tiny_hf_model_dir("llama")))


def test_random_init_is_deterministic_per_seed():
    with pytest.warns(RandomWeightsWarning, match="RANDOM"):
        a, b, c = (load(None, QWEN3_ARCH, seed=s) for s in (3, 3, 4))
    assert_same_weights(a, b)
    w_a, w_c = a.model.layers[0].mlp.gate_up_proj.weight, c.model.layers[0].mlp.gate_up_proj.weight
    assert not torch.equal(w_a, w_c)
    assert abs(w_a.std().item() - 0.02) < 0.002 and w_a.mean().abs().item() < 0.002
    assert torch.equal(a.model.norm.weight, torch.ones(64))
    assert torch.equal(a.model.layers[0].self_attn.q_norm.weight, torch.ones(16))


def test_gemma_random_norms_are_zero_because_they_scale_by_one_plus_weight():
    arch = {"architectures": ["Gemma3ForCausalLM"], **TINY_HF_MODELS["gemma3"][1]}
    with pytest.warns(RandomWeightsWarning):
        model = load(None, arch)
    assert torch.equal(model.model.layers[0].pre_feedforward_layernorm.weight, torch.zeros(64))


def test_random_init_in_bf16_draws_directly_in_bf16():
    with pytest.warns(RandomWeightsWarning):
        model = load_model(None, QWEN3_ARCH, torch.bfloat16, "cpu", seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    logits = prompt_logits(model, list(range(3, 40)))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_config_without_weights_is_an_error_unless_random_weights(tiny_hf_model_dir, tmp_path):
    (tmp_path / "config.json").write_text((tiny_hf_model_dir("gemma3") / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights.*model.random_weights=true"):
        load(tmp_path)
    with pytest.warns(RandomWeightsWarning):
        model = load(tmp_path, random_weights=True)
    assert model.arch.family == "gemma3" and model.arch.sliding_window == 16


def test_missing_local_path_without_architecture_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path"):
        load(tmp_path / "nowhere")


def test_eos_ids_come_from_generation_config_then_config(tiny_hf_model_dir, tmp_path):
    path = copy_model(tiny_hf_model_dir("qwen3"), tmp_path / "m")
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 7]
    (path / "generation_config.json").write_text(json.dumps(gen))
    assert load(path).arch.eos_token_ids == [2, 7]
    (path / "generation_config.json").unlink()
    assert load(path).arch.eos_token_ids == [2]


def test_tied_and_untied_lm_head(tiny_hf_model_dir):
    tied = load(tiny_hf_model_dir("llama_tied"))
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    untied = load(tiny_hf_model_dir("llama"))
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_bf16_weights_track_fp32(tiny_hf_model_dir):
    path = tiny_hf_model_dir("gemma3")
    prompt = list(range(3, 60))
    ref = prompt_logits(load(path), prompt)
    model = load_model(str(path), None, torch.bfloat16, "cpu")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    logits = prompt_logits(model, prompt)
    assert logits.dtype == torch.float32
    assert (logits - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize("checkpoint,device,expected", [
    ("bfloat16", "cpu", torch.float32), ("float16", "cpu", torch.float32),
    ("bfloat16", "cuda", torch.bfloat16), ("float16", "cuda", torch.float16),
    ("float32", "cuda", torch.bfloat16), (None, "cuda", torch.bfloat16),
])
def test_dtype_auto_follows_the_checkpoint_on_cuda_and_is_fp32_on_cpu(checkpoint, device, expected):
    from ladle.models import arch_from_config, resolve_dtype

    arch = arch_from_config({**QWEN3_ARCH, "torch_dtype": checkpoint} if checkpoint else QWEN3_ARCH)
    assert resolve_dtype("auto", device, arch) == expected
    assert resolve_dtype("float16", device, arch) == torch.float16  # an explicit dtype always wins


def test_one_place_decides_dtype():
    from ladle.engine import llm_engine

    assert not hasattr(llm_engine, "resolve_device_dtype")
    with pytest.warns(RandomWeightsWarning):
        model = load_model(None, {**QWEN3_ARCH, "torch_dtype": "bfloat16"}, "auto", "cpu")
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_packed_projections_hold_the_checkpoint_tensors_row_for_row(tiny_hf_model_dir, name):
    """qkv_proj = cat(q, k, v) and gate_up_proj = cat(gate, up) of the checkpoint, in that order; the last
    layer's q_proj = q and kv_proj = cat(k, v)."""
    path = tiny_hf_model_dir(name)
    tensors = load_file(str(next(path.glob("*.safetensors"))))
    model = load(path)
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        qkv = [tensors[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"]
        gate_up = [tensors[f"{prefix}.mlp.{p}_proj.weight"] for p in ("gate", "up")]
        attn = layer.self_attn
        if i == len(model.model.layers) - 1:
            assert attn.split_q and not hasattr(attn, "qkv_proj")
            assert torch.equal(attn.q_proj.weight, qkv[0]) and torch.equal(attn.kv_proj.weight, torch.cat(qkv[1:]))
        else:
            assert torch.equal(attn.qkv_proj.weight, torch.cat(qkv))
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat(gate_up))
