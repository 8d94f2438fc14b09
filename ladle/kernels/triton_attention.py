"""Triton paged attention over a flattened mixed batch: one kernel for decodes and prefill chunks.

Layout (see kernels/metadata.py): queries q[T, H, D] of all sequences back to back, sequence b owning
rows query_start_loc[b]:query_start_loc[b+1]; the paged cache kv_cache[2, num_blocks, block_size,
Hkv, D]; block_tables[b, i] is the i-th cache block of sequence b. A query at local index i of
sequence b sits at absolute position p = context + i, where context = seq_lens[b] - query_len[b], and
attends to the keys at positions [max(0, p - window + 1), p] of b, read in place from the cache.

Grid and tiles
--------------
The grid is (query tiles, KV heads). A program owns BLOCK_Q consecutive query tokens of ONE sequence
and ONE KV head, and processes all GROUP = H / Hkv query heads that share that KV head together: its
tile has BLOCK_M = BLOCK_Q * GROUP rows (row r = token r // GROUP, head r % GROUP), so every key/value
tile is loaded once per KV head and serves the whole head group (GQA without copies). BLOCK_M
follows the longest query of the batch (see kernels/triton_launch.tile_config): a decode-only batch gets the smallest
tile, the head group padded to tl.dot's 16 rows; batches with chunks get up to 32-64 rows, and their
decodes ride in such a tile too (one kernel launch, masked spare rows).

Finding the sequence: query tiles never straddle two sequences. Sequence b's tiles are numbered from
query_start_loc[b] // BLOCK_Q + b, which leaves room for its ceil(query_len / BLOCK_Q) tiles whatever
its alignment, so the grid needs only T // BLOCK_Q + B programs along axis 0 (a host-side bound that
needs no device sync), and each program finds its sequence by a binary search over query_start_loc
(log2(B) scalar loads). Programs left over past a sequence's last tile exit at once.

KV loop: keys are visited in tiles of BLOCK_N positions, independent of the cache block size. The
physical row of key position `pos` is block_tables[b, pos // block_size] * block_size + pos %
block_size, so any block size works: 16 for the paged cache, or one block of max_model_len per
sequence for the contiguous cache. Only the needed range is iterated: up to the last query of the
tile (causal upper bound) and, with a sliding window, from the first key the tile's first query can
see (tiles entirely before the window are skipped). Inside the range a mask applies causality and
the window per row. Scores are QK^T * scale, optionally soft-capped (cap * tanh(s / cap)) before
masking, and folded in with an online softmax in fp32 (exp2 domain); tl.dot with fp32 accumulators
for QK^T and PV (P is rounded to the input dtype for PV, as in FlashAttention).

Small decode batches: when decode rows x KV heads are too few programs to fill the GPU, the launch
plan (kernels/triton_launch.py, prepared once per forward) sends the decode rows to the split-KV
kernels (kernels/triton_split_kv.py) and this kernel, told so by `skip_decodes`, leaves them alone.

Head dims: any head_dim, padded to a power of two >= 16 (masked); 64/128/256 are the real ones.

To run on CPU tensors (tests), TRITON_INTERPRET=1 must be set before the process first imports
triton: Triton decides interpreter or compiler when a function is decorated, its own library's
functions included (see is_interpreted and tests/kernels/test_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle.kernels.metadata import AttentionMetadata
from ladle.kernels.triton_cache import triton_write_kv_cache
from ladle.kernels.triton_launch import launch_plan
from ladle.kernels.triton_split_kv import launch_split_kv
from ladle.kernels.triton_tiles import attend_key_tile


@triton.jit
def _find_sequence(qsl_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with first_tile(b) = query_start_loc[b] // BLOCK_Q + b <= tile (binary search)."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs", "window", "skip_decodes", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]  (kv_cache[0])
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]  (kv_cache[1])
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    qsl_ptr,  # [B + 1] int32: query_start_loc
    num_seqs,
    skip_decodes,  # nonzero: sequences with one query row are left to the split-KV path
    scale,  # softmax scale (natural units)
    softcap,  # used when HAS_SOFTCAP
    window,  # used when HAS_WINDOW
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,  # cache strides: block, row in block, head (the head_dim stride is 1)
    stride_cs,
    stride_ch,
    stride_bt,  # block table row stride
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # power of two >= 16
    BLOCK_SIZE: tl.constexpr,  # cache block size (any positive integer)
    BLOCK_M: tl.constexpr,  # tile rows = BLOCK_Q tokens x GROUP heads (padded to a power of two)
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_N: tl.constexpr,  # keys per KV iteration
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    FP32_DOT: tl.constexpr,  # fp32 inputs: 3xTF32 dots instead of TF32 (see _mma)
    UPCAST_DOT: tl.constexpr,  # interpreter only: bf16 dot operands widened to fp32 (see _mma)
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)

    # --- Which sequence and which of its query tiles this program owns.
    seq = _find_sequence(qsl_ptr, tile_id, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q0 = (tile_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query (local index) of the tile
    if (q0 >= q_len) | ((skip_decodes != 0) & (q_len == 1)):
        return  # spare program past the sequence's last tile, or a decode the split-KV path owns
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    # --- Load the query tile: row r is token q0 + r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context + q_idx  # absolute position of each row's token
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # --- Key range of the tile: causal upper bound (its last query), window lower bound (its first).
    kv_end = context + tl.minimum(q0 + BLOCK_Q, q_len)  # exclusive
    kv_begin = 0
    if HAS_WINDOW:
        kv_begin = tl.maximum(context + q0 - window + 1, 0)
        kv_begin = (kv_begin // BLOCK_N) * BLOCK_N

    if HAS_SOFTCAP:
        qk_scale = scale
    else:
        qk_scale = scale * 1.4426950408889634  # fold log2(e) in: the softmax runs on exp2

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    for start in range(kv_begin, kv_end, BLOCK_N):
        m_i, l_i, acc = attend_key_tile(
            q, q_pos, m_i, l_i, acc, start, kv_end, window, softcap, qk_scale, block_row,
            k_cache_ptr, v_cache_ptr, kv_head, stride_cb, stride_cs, stride_ch, dims, dim_ok,
            BLOCK_SIZE, BLOCK_N, HAS_WINDOW, HAS_SOFTCAP, FP32_DOT, UPCAST_DOT,
        )

    # Every real row sees at least its own key, so l_i > 0 there; padding rows are not stored.
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def is_interpreted() -> bool:
    """True when the kernels run in the Triton interpreter.

    Triton fixes this when a function is decorated: its own library (tl.zeros, tl.max, ...) when
    `triton` is first imported, these kernels when this module is. Both must have seen
    TRITON_INTERPRET=1, so it must be set before the process first imports triton.
    """
    jit = triton.runtime.jit.JITFunction
    return not isinstance(_paged_attention_kernel, jit) and not isinstance(tl.zeros, jit)


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D]; writes k/v into the cache at meta.slot_mapping, returns [T, H, D]."""
    if q.device.type != "cuda" and not is_interpreted():
        raise RuntimeError(
            f"the Triton attention backend got {q.device.type} tensors: it needs CUDA, or "
            "TRITON_INTERPRET=1 set before the process first imports triton (or use the torch backend on CPU)"
        )
    if q.dim() != 3 or k.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"expected q [T,H,D], k/v [T,Hkv,D], kv_cache [2,blocks,block_size,Hkv,D]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(kv_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    num_kv = kv_cache.shape[3]
    if num_heads % num_kv or kv_cache.shape[4] != head_dim or k.shape[1:] != (num_kv, head_dim):
        raise ValueError(
            f"head shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, kv_cache {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[2] != meta.block_size:
        raise ValueError(f"kv_cache block size {kv_cache.shape[2]} != metadata block size {meta.block_size}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")

    if q.is_cuda and q.device.index is not None and q.device.index != torch.cuda.current_device():
        # Triton launches on the current device: make it the tensors' (model.device=cuda:N).
        with torch.cuda.device(q.device):
            return triton_attention(q, k, v, kv_cache, meta, scale=scale, sliding_window=sliding_window, softcap=softcap)

    triton_write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim")

    # Grids, tiles, the split-KV choice and its buffers: prepared by the forward's first layer.
    plan = launch_plan(meta, num_heads, num_kv, head_dim, q.dtype)
    upcast_dot = q.dtype == torch.bfloat16 and is_interpreted()
    if plan.split:
        launch_split_kv(out, q, kv_cache, meta, plan, scale=scale, sliding_window=sliding_window,
                        softcap=softcap, upcast_dot=upcast_dot)
    if plan.grid is None:  # every row was a decode, all done by the split path
        return out
    block_m, block_q, block_n, num_warps = plan.tiles
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _paged_attention_kernel[plan.grid](
        out,
        q,
        k_cache,
        v_cache,
        plan.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.num_seqs,
        int(plan.split),
        float(scale),
        float(softcap) if softcap is not None else 0.0,
        int(sliding_window) if sliding_window is not None else 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        plan.block_tables.stride(0),
        GROUP=num_heads // num_kv,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=plan.head_dim_pad,
        BLOCK_SIZE=meta.block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        FP32_DOT=q.dtype == torch.float32,
        UPCAST_DOT=upcast_dot,
        num_warps=num_warps,
    )
    return out
