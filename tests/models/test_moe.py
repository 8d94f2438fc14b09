"""The mixture-of-experts layer: one call per active expert per forward, transformers' routing, and a row's
output bitwise the same alone or among any other rows (deterministic mode's batch invariance)."""

from __future__ import annotations

import pytest
import torch

from ladle.models import load_model
from ladle.models.moe import SparseMoE
from tests.conftest import build_tiny_hf_model

MOE_FAMILIES = ["qwen3_moe", "mixtral"]


def sparse_layers(model) -> list[tuple[int, SparseMoE]]:
    return [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_routed_expert_runs_once_per_forward(tiny_hf_model_dir, family):
    model = load_model(str(tiny_hf_model_dir(family)), None, torch.float32, "cpu")
    layers = sparse_layers(model)
    assert layers and (family != "qwen3_moe" or [i for i, _ in layers] == [0, 2])  # mlp_only_layers=[1]
    _, moe = layers[0]
    calls = [0] * moe.num_experts
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda *_, e=e: calls.__setitem__(e, calls[e] + 1))
    x = torch.randn(37, model.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        _, routed = moe.route(x)
        moe(x)
    assert calls == [1 if e in set(routed.flatten().tolist()) else 0 for e in range(moe.num_experts)]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_block_matches_transformers(tiny_hf_model_dir, family):
    hf = build_tiny_hf_model(family)
    model = load_model(str(tiny_hf_model_dir(family)), None, torch.float32, "cpu")
    i, moe = sparse_layers(model)[0]
    hf_block = hf.model.layers[i].mlp
    x = torch.randn(1, 50, model.arch.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf_block(x)
        got = moe(x[0])
    torch.testing.assert_close(got, ref[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_row_is_bitwise_the_same_alone_and_in_any_batch(tiny_hf_model_dir, family, threads):
    model = load_model(str(tiny_hf_model_dir(family)), None, torch.float32, "cpu")
    model.set_deterministic(True)
    _, moe = sparse_layers(model)[0]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, model.arch.hidden_size, generator=gen)
    with torch.inference_mode():
        alone = torch.cat([moe(x[r:r + 1]) for r in range(x.shape[0])])
        for rows in (2, 7, 64):
            perm = torch.randperm(x.shape[0], generator=gen)[:rows]
            assert torch.equal(moe(x[perm]), alone[perm]), rows


def test_compile_is_refused_with_the_fix(tiny_hf_model_dir):
    model = load_model(str(tiny_hf_model_dir("mixtral")), None, torch.float32, "cpu")
    with pytest.raises(ValueError, match="model.compile=false"):
        model.enable_compile()


def test_an_moe_model_is_run_without_cuda_graphs_and_a_dense_one_with(tiny_hf_model_dir):
    """CUDA graphs are on by default: an MoE model, whose routing reads host counts, must not be captured
    (the capture would fail the engine's start), while a dense model still is."""
    from ladle.engine.builder import graphs_capturable

    assert not graphs_capturable(load_model(str(tiny_hf_model_dir("mixtral")), None, torch.float32, "cpu"))
    assert graphs_capturable(load_model(str(tiny_hf_model_dir("qwen3")), None, torch.float32, "cpu"))


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen3_moe_block_with_and_without_renormalised_weights(norm_topk_prob):
    """transformers' Qwen3MoeConfig leaves norm_topk_prob False by default (the 30B-A3B checkpoint sets it)."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from ladle.models import arch_from_config

    config = transformers.Qwen3MoeConfig(hidden_size=48, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                         norm_topk_prob=norm_topk_prob, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(3)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    ours = SparseMoE(arch_from_config({**config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}))
    with torch.no_grad():
        ours.gate.weight.copy_(block.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(block.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(block.experts.down_proj[e])
    x = torch.randn(1, 40, 48, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        torch.testing.assert_close(ours(x[0]), block(x)[0], atol=1e-5, rtol=1e-5)
        empty = ours(x[0, :0])  # a forward whose last layer keeps no row
    assert empty.shape == (0, 48)
