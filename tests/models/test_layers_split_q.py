"""The last layer projects its queries for the kept rows alone, q apart from k|v (models/layers.Attention,
`split_q`): bitwise what one packed q|k|v matmul gives for those rows on the CPU fp32 path, for Llama (no
qk-norm), Qwen3 (qk-norm) and Gemma 3 (offset qk-norm), and the whole forward's kept rows with it."""

from __future__ import annotations

import copy

import pytest
import torch

from ladle.kernels import AttentionMetadata
from ladle.models import load_model
from ladle.models.layers import PackedLinear
from tests.conftest import TINY_HF_MODELS
from tests.models.ladle_driver import make_kv_caches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def build(family: str, dtype: torch.dtype = torch.float32):
    arch = {"architectures": [CLASSES[family]], **TINY_HF_MODELS[family][1], "initializer_range": 0.08}
    return load_model(None, arch, dtype, "cpu", seed=1)


def unsplit(attn):
    """A copy of a split attention with one packed q|k|v projection instead."""
    twin = copy.deepcopy(attn)
    twin.split_q = False
    q, kv = twin.q_proj, twin.kv_proj
    del twin.q_proj, twin.kv_proj
    twin.qkv_proj = PackedLinear(
        q.in_features, {"q_proj": twin.q_size, "k_proj": twin.kv_size, "v_proj": twin.kv_size}, bias=q.bias is not None
    )
    with torch.no_grad():
        twin.qkv_proj.weight.copy_(torch.cat((q.weight, kv.weight)))
        if q.bias is not None:
            twin.qkv_proj.bias.copy_(torch.cat((q.bias, kv.bias)))
    twin.qkv_proj.requires_grad_(False)
    twin.qkv_proj.derive_weights()
    return twin


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("t,rows", [(37, [36]), (37, [3, 20, 36]), (5, [0, 1, 2, 3, 4]), (1, [0])])
def test_split_queries_are_the_packed_projection_bitwise(family, t, rows):
    model = build(family)
    layers = model.model.layers
    attn = layers[-1].self_attn
    assert attn.split_q and not any(layer.self_attn.split_q for layer in layers[:-1])
    twin = unsplit(attn)
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, model.arch.hidden_size, generator=gen)
    positions = torch.randint(0, 200, (t,), generator=gen)
    rope = model.rope[model._layer_types[-1]](positions, 256, torch.float32)
    kept = torch.tensor(rows)
    with torch.inference_mode():
        q, k, v = attn._project(x, rope, kept)
        q_all, k_all, v_all = attn._project(x, rope, None)
        q_ref, k_ref, v_ref = twin._project(x, rope, None)
    assert q.shape == (len(rows), attn.num_heads, attn.head_dim)
    assert torch.equal(q, q_ref[kept]) and torch.equal(q_all, q_ref)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref) and torch.equal(k_all, k_ref) and torch.equal(v_all, v_ref)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_forward_with_split_queries_is_the_packed_forward_bitwise(family):
    """Two prefill chunks and a decode: the kept rows' logits, and every row's keys and values in the
    cache, equal those of the same model with the last layer's q|k|v packed as one."""
    model = build(family)
    reference = copy.deepcopy(model)
    reference.model.layers[-1].self_attn = unsplit(model.model.layers[-1].self_attn)
    block = 16
    caches, ref_caches = make_kv_caches(model, 8, block), make_kv_caches(reference, 8, block)
    ids = torch.randint(3, model.arch.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.build([23, 1], [23, 9], [[1, 2], [3]], block)
    meta.restrict_outputs([20, 0])  # the chunk's last 3 rows and the decode
    positions = torch.cat((torch.arange(23), torch.tensor([8])))
    with torch.inference_mode():
        out = model(ids[:24], positions, caches, meta)
        ref = reference(ids[:24], positions, ref_caches, meta)
    assert out.shape[0] == 4 and torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches, strict=True))


# (hidden, q, k|v width): Qwen3-0.6B, Llama-3.2-1B, an odd one. oneDNN picks its blocking from the shape,
# so the tiny models' 64-wide layers alone do not show that a column's bits ignore its neighbours here.
REAL_SHAPES = [(1024, 2048, 1024), (2048, 2048, 512), (1000, 96, 40)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("h,q,kv", REAL_SHAPES, ids=[f"{h}-{q}-{kv}" for h, q, kv in REAL_SHAPES])
@torch.inference_mode()
def test_split_projections_are_the_packed_columns_at_real_shapes(h, q, kv, threads):
    """q_proj on the kept rows and kv_proj on every row give the packed q|k|v's columns bit for bit, biases
    included, at the row counts a step produces (one row, exact small widths, padded larger ones)."""
    from ladle.models.linear import Linear, onednn_available

    if not onednn_available():
        pytest.skip("needs torch built with oneDNN")
    gen = torch.Generator().manual_seed(h + q)
    packed = PackedLinear(h, {"q_proj": q, "k_proj": kv, "v_proj": kv}, bias=True).requires_grad_(False)
    q_proj, kv_proj = Linear(h, q, bias=True).requires_grad_(False), PackedLinear(h, {"k": kv, "v": kv}, bias=True)
    kv_proj.requires_grad_(False)
    packed.weight.copy_(torch.randn(q + 2 * kv, h, generator=gen) * 0.05)
    packed.bias.copy_(torch.randn(q + 2 * kv, generator=gen))
    q_proj.weight.copy_(packed.weight[:q]), q_proj.bias.copy_(packed.bias[:q])
    kv_proj.weight.copy_(packed.weight[q:]), kv_proj.bias.copy_(packed.bias[q:])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in (1, 3, 17, 40, 300):
            x = torch.randn(t, h, generator=gen)
            kept = torch.arange(t - 1, -1, -max(1, t // 4)).flip(0)  # the last row and a few before it
            full = packed(x)
            assert torch.equal(kv_proj(x), full[:, q:]), t
            assert torch.equal(q_proj(x.index_select(0, kept)), full[kept, :q]), t
    finally:
        torch.set_num_threads(before)
