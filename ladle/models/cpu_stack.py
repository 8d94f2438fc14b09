"""Which decoder layers of a CPU float32 forward run as one native call, and their arguments.

kernels/cpu_layers runs a stack of Llama / Qwen3 layers with no Python between the kernels. This module
decides whether a forward's layers (all but the last, whose rows the caller may cut down) qualify, and
builds what the stack reads: each layer's packed weights, norm weights and cache planes, and the step's
buffers and attention arguments. A layer qualifies only where models/llama.LlamaDecoderLayer itself would
call exactly these kernels (the packed GEMM for every linear, the gated GEMM for the MLP, the fused norm and
q/k norm + RoPE kernels, the paged attention kernel on a float32 cache); anything else (a bias, Gemma's
offset norms, another attention backend, a soft-cap, autograd) runs op by op, with the same bits either way.

Eager calls `run_layers`; the compiled forward, where `stackable` holds at compile time, calls the
`ladle::decoder_stack` custom op (opaque to inductor, like every CPU kernel), which reads the step's metadata
and caches from the forward context and runs `run_layers`, or the layers op by op where a step does not
qualify.
"""

from __future__ import annotations

import ctypes
import itertools
import weakref

import torch
from torch import nn

from ladle.kernels import AttentionMetadata, cpu_fused, cpu_gemm, cpu_layers, cpu_paged
from ladle.kernels import cpu_build as attention_build
from ladle.kernels.dispatch import get_backend
from ladle.models.attention_op import forward_context
from ladle.models.layers import MLP, Linear, fused_cpu
from ladle.models.llama import LlamaDecoderLayer

_ops: list[cpu_layers.StackOps] = []  # the kernels' entry points, taken once


def _stack_ops() -> cpu_layers.StackOps:
    if not _ops:
        _ops.append(cpu_layers.ops(cpu_fused.load_library(), cpu_gemm.load_library(),
                                   attention_build.load_library()))
    return _ops[0]


def _linear(layer: Linear) -> cpu_layers.StackLinear | None:
    if layer.bias is not None or not layer.packable():
        return None
    packed = layer.current_pack()
    if not isinstance(packed, cpu_gemm.PackedWeight):
        return None
    return cpu_layers.StackLinear(packed.data.data_ptr(), packed.out_features, packed.in_features, packed.kb)


def _vector(weight: torch.Tensor | None, numel: int) -> int | None:
    """The address of a float32 weight the kernels read as `numel` consecutive floats, else None."""
    if weight is None or weight.dtype != torch.float32 or not weight.is_contiguous() or weight.numel() != numel:
        return None
    return weight.data_ptr()


def _hooked(layer: nn.Module) -> bool:
    """Whether a forward hook would see (or change) something inside the layer: the stack calls no module."""
    from torch.nn.modules import module as hooks

    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules())


def _weights(layer: nn.Module) -> cpu_layers.StackLayer | None:
    """The stack's view of one layer's weights (no cache planes yet), or None when the layer must run op by
    op whatever the step: what LlamaDecoderLayer would compute with other kernels or other arguments."""
    if type(layer) is not LlamaDecoderLayer or _hooked(layer):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if type(mlp) is not MLP or attn.rotary_dim != attn.head_dim:
        return None  # a mixture of experts, partial rotary: op by op
    if attn.split_q or attn.softcap is not None or attn.head_dim > cpu_fused.MAX_HEAD_DIM \
            or attn.num_heads % attn.num_kv_heads != 0 or not cpu_fused.enabled():
        return None
    if mlp.act_name not in cpu_gemm.GATED_ACTIVATIONS or not cpu_gemm.gated_available():
        return None
    linears = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if norms[1].eps != norms[0].eps or (attn.q_norm is not None and attn.k_norm.eps != attn.q_norm.eps):
        return None  # the step passes one eps for both norms, one for both q and k
    hidden = attn.qkv_proj.in_features
    norm_weights = [None if n.offset else _vector(n.weight, hidden) for n in norms]
    if any(x is None for x in [*linears, *norm_weights]):
        return None
    qk_norm = None
    if attn.q_norm is not None:
        if attn.q_norm.offset:
            return None
        # derive_weights made it: [q + kv heads, head_dim], each head's own norm weight
        qk_norm = _vector(getattr(attn, "qk_norm_weight", None), (attn.num_heads + attn.num_kv_heads) * attn.head_dim)
        if qk_norm is None:
            return None
    return cpu_layers.StackLayer(*norm_weights, qk_norm, *linears)


def _knobs(layer: LlamaDecoderLayer) -> tuple:
    """What the stack's shared step (buffers, attention arguments, eps) assumes equal in every layer."""
    a, m = layer.self_attn, layer.mlp
    return (a.num_heads, a.num_kv_heads, a.head_dim, a.scale, a.sliding_window, m.act_name, m.down_proj.in_features,
            a.qkv_proj.in_features, layer.input_layernorm.eps, None if a.q_norm is None else a.q_norm.eps)


def _stack(layers: list[nn.Module]) -> list[cpu_layers.StackLayer] | None:
    """The layers' weights for the stack, or None when any of them must run op by op (or they differ in a
    knob the shared step assumes equal)."""
    stack = [_weights(layer) for layer in layers]
    if not stack or any(entry is None for entry in stack):
        return None
    knobs = _knobs(layers[0])
    if any(_knobs(layer) != knobs for layer in layers[1:]):
        return None
    return stack


def stackable(layers: list[nn.Module]) -> bool:
    """Whether `layers` can run as a stack whenever the step allows it (a float32 cache through the cpu_paged
    kernel): the compiled forward decides at compile time between the stack op and the layers' own ops."""
    return cpu_layers.enabled() and _stack(layers) is not None


def _cache_ok(cache: torch.Tensor, first: torch.Tensor, meta: AttentionMetadata) -> bool:
    return (
        cache.dtype == torch.float32 and cache.stride(-1) == 1 and cache.shape == first.shape
        and cache.stride() == first.stride()
        and get_backend(cache.device, meta.backend, torch.float32) == "cpu_paged"
    )


def run_layers(
    layers: list[nn.Module], x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
    kv_caches: list[torch.Tensor], meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Run `layers` (the forward's first ones, from the embedding x, no residual yet) as one native call:
    (the last one's MLP output, the residual stream), what the op-by-op loop would hand the next layer.
    None, with nothing computed, when the stack is off or any of them must run op by op. x is only read."""
    if not layers or not cpu_layers.enabled() or not fused_cpu(x) or x.dim() != 2 or not x.is_contiguous():
        return None
    if not all(_cache_ok(cache, kv_caches[0], meta) for cache in kv_caches):
        return None
    stack = _stack(layers)
    if stack is None:
        return None
    for entry, cache in zip(stack, kv_caches, strict=True):
        entry.k_cache = cache.data_ptr()
        entry.v_cache = entry.k_cache + cache.stride(0) * cache.element_size()
    return _run(stack, layers[0], x, rope, kv_caches[0], meta)


def _run(stack: list[cpu_layers.StackLayer], first: LlamaDecoderLayer, x: torch.Tensor,
         rope: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor,
         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    attn, mlp = first.self_attn, first.mlp
    t, hidden = x.shape
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def buffer(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32)

    out_x, residual, h, o = buffer(t, hidden), buffer(t, hidden), buffer(t, hidden), buffer(t, hidden)
    qkv, qk, out = buffer(t, (hq + 2 * hkv) * d), buffer(t, hq + hkv, d), buffer(t, hq, d)
    gate_up = buffer(t, 2 * mlp.down_proj.in_features)
    # The attention kernel's arguments, as cpu_paged_attention fills them for one layer (q and k: the
    # normed, rotated heads; v: straight from the projection); the stack sets each layer's cache planes.
    args = cpu_paged.call_args(qk[:, :hq], qk[:, hq:], qkv[:, (hq + hkv) * d:].view(t, hkv, d), cache, meta, out,
                               scale=attn.scale, sliding_window=attn.sliding_window, softcap=None)
    cos, sin = (r.reshape(t, d).contiguous() for r in rope)
    base = ctypes.addressof(args)
    step = cpu_layers.StackStep(
        t, hidden, hq, hkv, d, cpu_gemm.GATED_ACTIVATIONS[mlp.act_name], cpu_fused.torch_lanes(),
        torch.get_num_threads(), first.input_layernorm.eps, 0.0 if attn.q_norm is None else attn.q_norm.eps,
        cos.data_ptr(), sin.data_ptr(), cos.stride(0), sin.stride(0),
        x.data_ptr(), out_x.data_ptr(), residual.data_ptr(),
        h.data_ptr(), qkv.data_ptr(), qk.data_ptr(), out.data_ptr(), o.data_ptr(), gate_up.data_ptr(),
        base, base + type(args).k_cache.offset, base + type(args).v_cache.offset,
    )
    cpu_layers.run(_stack_ops(), step, (cpu_layers.StackLayer * len(stack))(*stack))
    return out_x, residual


# -- the compiled forward's op --------------------------------------------------------------------
_keys = itertools.count()
_stacks: weakref.WeakValueDictionary[int, nn.ModuleList] = weakref.WeakValueDictionary()


def register(layers: nn.ModuleList) -> torch.Tensor:
    """A key for `decoder_stack_op` to find these layers by (a 0-d CPU int64 tensor: a graph input, not a
    constant the graph would guard on; see models/linear.cpu_linear_op)."""
    key = next(_keys)
    _stacks[key] = layers
    return torch.tensor(key, dtype=torch.int64, device="cpu")


@torch.library.custom_op("ladle::decoder_stack", mutates_args=())
def decoder_stack_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key: torch.Tensor,
                     count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` layers of the registered stack `key` on the context's metadata and caches
    (models/attention_op.attention_context): (MLP output, residual) of the last of them. The layers qualified
    when the model compiled (`stackable`); where a step does not (another attention backend, a cache of
    another dtype) they run op by op here, eagerly: the same bits as the compiled graph's own ops would give,
    every kernel being a custom op there too."""
    layers = _stacks.get(int(key))
    if layers is None:
        raise RuntimeError(f"ladle::decoder_stack: no live model with key {int(key)}")
    context = forward_context()
    layers, caches, meta = list(layers[:count]), context.kv_caches[:count], context.meta
    done = run_layers(layers, x, (cos, sin), caches, meta)
    if done is None:  # some layer must run op by op: as eager runs it (the same kernels, the same bits)
        residual = None
        for layer, cache in zip(layers, caches, strict=True):
            x, residual = layer(x, residual, (cos, sin), cache, meta)
        done = x, residual
    return done[0].contiguous(), done[1].contiguous()


@decoder_stack_op.register_fake
def _decoder_stack_fake(x, cos, sin, key, count):
    return torch.empty_like(x), torch.empty_like(x)
