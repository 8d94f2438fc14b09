"""Split-KV (segmented) decode attention: more programs per decode row when the batch is too small.

For the decode rows a LaunchPlan selects (see kernels/triton_launch.py for when), the grid is (decode
row, KV head, segment). Each program takes the row's GROUP query heads of one KV head (one tile, as
in the 2D kernel) and one segment of its visible key range [begin, seq_len): the range, in BLOCK_N
key tiles, is cut into S runs of ceil(tiles / S) tiles; segment s owns run s, and segments past the
last tile are empty (when S exceeds the row's tile count). A program writes its partial softmax: the
running max m (log2 units), the sum l of exp2(score - m) and the unnormalised output acc = sum
exp2(score - m) v, in fp32, whatever the input dtype. An empty segment writes m = -inf, l = 0, acc = 0.

The reduce kernel, one program per (decode row, query head), merges the S partials by log-sum-exp:
M = max_s m_s, w_s = exp2(m_s - M), out = sum_s w_s acc_s / sum_s w_s l_s, in fp32, cast to the
output dtype only at the store. The segment holding the row's own key is never empty, so M is finite.
vLLM's `kernel_unified_attention_3d` + `reduce_segments` are the model for this design.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle.kernels.triton_launch import MAX_SEGMENTS
from ladle.kernels.triton_tiles import attend_key_tile


@triton.jit(do_not_specialize=["num_segments", "window", "stride_bt"])
def _split_kv_decode_kernel(
    part_out_ptr,  # [N, H, S, HEAD_DIM_PAD] fp32
    part_max_ptr,  # [N, H, S] fp32
    part_sum_ptr,  # [N, H, S] fp32
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    qsl_ptr,  # [B + 1] int32
    decode_seqs_ptr,  # [N] int32: the sequence of each decode row
    num_segments,
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # GROUP padded to a power of two >= 16 (one token's heads)
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    FP32_DOT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = tl.load(decode_seqs_ptr + row)
    token = tl.load(qsl_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < GROUP
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)  # the decode token's position
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_off = token * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # --- This segment's keys: run `segment` of the visible range's BLOCK_N tiles.
    kv_begin = 0
    if HAS_WINDOW:
        kv_begin = tl.maximum(seq_len - window, 0)
        kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
    tiles = tl.cdiv(seq_len - kv_begin, BLOCK_N)
    tiles_per_segment = tl.cdiv(tiles, num_segments)
    seg_begin = kv_begin + segment * tiles_per_segment * BLOCK_N
    seg_end = tl.minimum(seg_begin + tiles_per_segment * BLOCK_N, seq_len)

    if HAS_SOFTCAP:
        qk_scale = scale
    else:
        qk_scale = scale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(seg_begin, seg_end, BLOCK_N):  # no iteration for an empty segment
        m_i, l_i, acc = attend_key_tile(
            q, q_pos, m_i, l_i, acc, start, seg_end, window, softcap, qk_scale, block_row,
            k_cache_ptr, v_cache_ptr, kv_head, stride_cb, stride_cs, stride_ch, dims, dim_ok,
            BLOCK_SIZE, BLOCK_N, HAS_WINDOW, HAS_SOFTCAP, FP32_DOT, UPCAST_DOT,
        )

    part = (row.to(tl.int64) * NUM_HEADS + head) * num_segments + segment  # [BLOCK_M]
    tl.store(part_max_ptr + part, m_i, mask=row_ok)
    tl.store(part_sum_ptr + part, l_i, mask=row_ok)
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_segments"])
def _reduce_segments_kernel(
    out_ptr,  # [T, H, D]
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    qsl_ptr,
    decode_seqs_ptr,
    num_segments,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SEGMENTS_PAD: tl.constexpr,  # power of two >= num_segments
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(decode_seqs_ptr + row)
    token = tl.load(qsl_ptr + seq).to(tl.int64)

    segs = tl.arange(0, SEGMENTS_PAD)
    seg_ok = segs < num_segments
    part = (row.to(tl.int64) * NUM_HEADS + head) * num_segments + segs
    m = tl.load(part_max_ptr + part, mask=seg_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=seg_ok, other=0.0)
    m_all = tl.max(m, axis=0)  # finite: the segment holding the row's own key saw it
    w = tl.exp2(m - m_all)  # 0 for empty (m = -inf) and padding segments
    total = tl.sum(l * w, axis=0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], mask=seg_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / total
    o_off = token * stride_ot + head * stride_oh + dims
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def launch_split_kv(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta,
    plan,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    upcast_dot: bool,
) -> None:
    """Attend the plan's decode rows with its segments, then merge the partials into `out`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = kv_cache.shape[3]
    block_m, _, block_n, num_warps = plan.split_tiles
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    segments = plan.num_segments
    _split_kv_decode_kernel[(plan.num_decodes, num_kv, segments)](
        plan.partial_out,
        plan.partial_max,
        plan.partial_sum,
        q,
        k_cache,
        v_cache,
        plan.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        plan.decode_seqs,
        segments,
        float(scale),
        float(softcap) if softcap is not None else 0.0,
        int(sliding_window) if sliding_window is not None else 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        plan.block_tables.stride(0),
        NUM_HEADS=num_heads,
        GROUP=num_heads // num_kv,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=plan.head_dim_pad,
        BLOCK_SIZE=meta.block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        FP32_DOT=q.dtype == torch.float32,
        UPCAST_DOT=upcast_dot,
        num_warps=num_warps,
    )
    _reduce_segments_kernel[(plan.num_decodes, num_heads)](
        out,
        plan.partial_out,
        plan.partial_max,
        plan.partial_sum,
        meta.query_start_loc,
        plan.decode_seqs,
        segments,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=plan.head_dim_pad,
        SEGMENTS_PAD=MAX_SEGMENTS,
        num_warps=4,
    )

