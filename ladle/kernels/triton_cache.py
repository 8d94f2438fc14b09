"""Triton KV-cache write: store each new token's keys and values at its slot of the paged cache.

The cache is one tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]; slot `s` is
row `s % block_size` of block `s // block_size` (the layout `AttentionMetadata.slot_mapping` uses).
One program copies one token: its [num_kv_heads, head_dim] keys and values, cast to the cache dtype.
A negative slot means "do not store" (padding rows), as in vLLM.

To run on CPU tensors (tests), TRITON_INTERPRET=1 must be set before the process first imports
triton (see kernels/triton_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D] (kv_cache[0])
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D] (kv_cache[1])
    slot_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides: block, row in block, head (the head_dim stride is 1)
    stride_cs,
    stride_ch,
    block_size,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_KV_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    row = slot % block_size

    heads = tl.arange(0, NUM_KV_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV) & (dims < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    dst = block * stride_cb + row * stride_cs + heads * stride_ch + dims
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def triton_write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k/v [T, Hkv, D] at slot_mapping[T] of kv_cache [2, num_blocks, block_size, Hkv, D]."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    num_tokens, num_kv, head_dim = k.shape
    if v.shape != k.shape or tuple(kv_cache.shape[-2:]) != (num_kv, head_dim):
        raise ValueError(
            f"k {tuple(k.shape)}, v {tuple(v.shape)} and cache heads {tuple(kv_cache.shape[-2:])} disagree"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must have one slot per token: {tuple(slot_mapping.shape)}")
    jit = triton.runtime.jit.JITFunction
    if k.device.type != "cuda" and (isinstance(_write_kv_kernel, jit) or isinstance(tl.zeros, jit)):
        raise RuntimeError(
            f"the Triton KV-cache write got {k.device.type} tensors: it needs CUDA, or TRITON_INTERPRET=1 "
            "set before the process first imports triton"
        )
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        kv_cache.shape[2],
        NUM_KV=num_kv,
        HEAD_DIM=head_dim,
        NUM_KV_PAD=triton.next_power_of_2(num_kv),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )
