"""Triton device functions shared by the attention kernels (the 2D kernel and the split-KV kernel)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf (exp overflow gives 1, underflow gives -1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _mma(a, b, acc, FP32_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc + a @ b with fp32 accumulation.

    FP32_DOT: fp32 inputs use 3xTF32 (about fp32 accuracy, on tensor cores) instead of plain TF32;
    exact "ieee" dots run on FMA units and spill registers at these tile sizes.
    UPCAST_DOT: the Triton interpreter (3.8) multiplies bf16 operands as their raw uint16 bits, so
    under the interpreter bf16 operands are widened to fp32 first. Widening is exact: the operands'
    bf16 rounding (of P in particular) is still what the GPU's bf16 tensor-core dot sees.
    """
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if FP32_DOT:
        return tl.dot(a, b, acc, input_precision="tf32x3")
    return tl.dot(a, b, acc)


@triton.jit
def attend_key_tile(
    q, q_pos, m_i, l_i, acc, start, kv_end, window, softcap, qk_scale, block_row,
    k_cache_ptr, v_cache_ptr, kv_head, stride_cb, stride_cs, stride_ch, dims, dim_ok,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Fold the keys [start, min(start + BLOCK_N, kv_end)) into the online softmax (m_i, l_i, acc) of
    the query rows q (absolute positions q_pos). Shared by the 2D kernel and the split-KV kernel."""
    # Physical cache row of each key position, through the block table.
    k_pos = start + tl.arange(0, BLOCK_N)
    k_ok = k_pos < kv_end
    block = tl.load(block_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    kv_off = block * stride_cb + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_cs + kv_head * stride_ch
    k = tl.load(
        k_cache_ptr + kv_off[None, :] + dims[:, None], mask=dim_ok[:, None] & k_ok[None, :], other=0.0
    )  # [HEAD_DIM_PAD, BLOCK_N]: K^T
    v = tl.load(
        v_cache_ptr + kv_off[:, None] + dims[None, :], mask=k_ok[:, None] & dim_ok[None, :], other=0.0
    )  # [BLOCK_N, HEAD_DIM_PAD]

    s = _mma(q, k.to(q.dtype), tl.zeros([q.shape[0], BLOCK_N], tl.float32), FP32_DOT, UPCAST_DOT)
    s = s * qk_scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap) * 1.4426950408889634

    visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
    if HAS_WINDOW:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))

    # Online softmax. A row that has seen no visible key yet keeps m = -inf; m_safe avoids
    # (-inf) - (-inf) there (its p and alpha are then exp2(-inf) = 0).
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = _mma(p.to(q.dtype), v.to(q.dtype), acc, FP32_DOT, UPCAST_DOT)
    return m_new, l_i, acc
