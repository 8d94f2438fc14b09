"""The fused CPU kernels inside the models (models/layers.py): taken where they should be (CPU fp32
eager inference), not elsewhere, and a forward through them equals the torch-op forward within fp32
rounding, with the same greedy tokens, for Llama (no qk-norm), Qwen3 and Gemma 3 (offset norms, GELU)."""

from __future__ import annotations

import pytest
import torch

from ladle.kernels import AttentionMetadata, cpu_fused
from ladle.models import load_model
from ladle.models.layers import fused_cpu
from ladle.models.op_count import MATMUL_OPS, count_layer_ops
from tests.conftest import TINY_HF_MODELS
from tests.models.ladle_driver import make_kv_caches

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(cpu_fused.load_library() is None, reason="no C++ compiler for the fused kernels"),
]

ARCHS = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "gemma3": ("Gemma3ForCausalLM", {}),
    "qwen3_odd": ("Qwen3ForCausalLM", {"intermediate_size": 1000, "hidden_size": 72}),
}


@pytest.fixture
def fused_switch():
    before = cpu_fused.enabled()
    yield cpu_fused.set_enabled
    cpu_fused.set_enabled(before)


def build(name: str):
    cls, overrides = ARCHS[name]
    family = name.removesuffix("_odd")
    arch = {"architectures": [cls], **TINY_HF_MODELS[family][1], **overrides, "initializer_range": 0.08}
    return load_model(None, arch, torch.float32, "cpu", seed=3)


def forward(model, seqs: list[list[int]]) -> torch.Tensor:
    """One mixed forward: every sequence's tokens as a prefill from position 0; last rows' logits."""
    block = 16
    per_seq = max(-(-len(s) // block) for s in seqs)
    caches = make_kv_caches(model, per_seq * len(seqs) + 1, block)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(seqs))]
    lens = [len(s) for s in seqs]
    meta = AttentionMetadata.build(lens, lens, tables, block)
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        hidden = model(ids, positions, caches, meta)
        return model.compute_logits(hidden[torch.tensor(lens).cumsum(0) - 1])


@pytest.mark.parametrize("name", list(ARCHS))
def test_fused_forward_equals_torch_forward(name, fused_switch):
    model = build(name)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (1, 9, 40, 3, 77)]
    fused_switch(True)
    fused = forward(model, seqs)
    fused_switch(False)
    reference = forward(model, seqs)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused.argmax(-1), reference.argmax(-1))


def test_fused_path_is_taken_only_for_cpu_fp32_inference(fused_switch):
    x = torch.ones(2, 8)
    fused_switch(True)
    with torch.no_grad():
        assert fused_cpu(x)
        assert not fused_cpu(x.bfloat16())
    assert not fused_cpu(x)  # autograd on: the torch ops keep the graph
    fused_switch(False)
    with torch.no_grad():
        assert not fused_cpu(x)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_fused_layers_run_fewer_ops(name, fused_switch):
    """The layer's norms, RoPE and activation leave torch: fewer aten ops per layer, the four matmuls kept."""
    model = build(name)
    caches = make_kv_caches(model, 3, 16)
    args = (torch.tensor([5, 6]), torch.tensor([12, 7]), caches, AttentionMetadata.build([1, 1], [13, 8], [[1], [2]], 16))
    counts = {}
    for on in (True, False):
        fused_switch(on)
        counter, scopes = count_layer_ops(model, *args)
        counts[on] = sum(counter.compute_ops(s) for s in scopes) / len(scopes)
        matmuls = sum(counter.counts[s][op] for s in scopes for op in MATMUL_OPS)
        assert matmuls == 4 * len(scopes) + 1  # the last layer's q apart from its k|v
    assert counts[True] <= counts[False] - 8, counts
