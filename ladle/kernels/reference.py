"""Torch reference for the attention op: CPU path and the oracle the Triton kernel is tested against.

Decodes (query length 1) run as one batched SDPA over their gathered cache; each prefill chunk runs
as its own SDPA with a mask for causality by absolute position and the sliding window. The gather
plan (slot indices and masks) depends only on the metadata and the window, so it is built once per
forward and shared by every layer through `meta.cache`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ladle.kernels.metadata import AttentionMetadata


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, Hkv, D] at their slots of kv_cache [2, num_blocks, block_size, Hkv, D]
    (any block layout: the CPU cache is head-major inside a block, engine/kv_cache.py). Every slot must
    be >= 0: unlike the Triton write, this one has no "store nothing" slot (skipping would need a mask,
    a host sync), so CUDA-graph padding rows (slot -1) go through the attention backend's Triton write
    (a graph's forward keeps every row, so even the last layer writes through it: models/attention_op.py)."""
    if kv_cache.is_contiguous():
        flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
        flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
        return
    block_size = kv_cache.shape[2]
    blocks, within = slot_mapping // block_size, slot_mapping % block_size
    kv_cache[0].index_put_((blocks, within), k.to(kv_cache.dtype))
    kv_cache[1].index_put_((blocks, within), v.to(kv_cache.dtype))


def cache_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """kv_cache [2, num_blocks, block_size, Hkv, D] as rows of its memory [k|v, row, D], and where a key's
    row is: block b, token i, head h at row b * sb + i * st + h * sh for the returned (sb, st, sh). Any
    layout whose rows are head_dim contiguous elements (token-major blocks: row = slot * Hkv + h). The K->V
    plane stride is free (the CPU cache's is not a multiple of head_dim: engine/kv_cache.layer_cache)."""
    d = kv_cache.shape[-1]
    strides = kv_cache.stride()
    if strides[-1] != 1 or any(x % d for x in strides[1:-1]):
        raise ValueError(f"a KV cache's rows must be contiguous head_dim elements (strides {strides})")
    sb, st, sh = (x // d for x in strides[1:4])
    rows = 1 + sum((n - 1) * x for n, x in zip(kv_cache.shape[1:4], (sb, st, sh)))
    return kv_cache.as_strided((2, rows, d), (strides[0], d, 1)), (sb, st, sh)


@dataclass(slots=True)
class _DecodePlan:
    rows: torch.Tensor  # [Bd] flattened row of each decode query
    rows_idx: torch.Tensor  # [Bd * Hkv * L] rows of the cache (cache_rows), head-major
    width: int  # L: keys gathered per sequence (the longest visible span, others masked)
    mask: torch.Tensor | None  # [Bd, 1, 1, L] True where the key is visible; None when all are
    every_row: bool  # rows are 0..T-1 in order (an all-decode batch): no gather/scatter of q and out


@dataclass(slots=True)
class _ChunkPlan:
    start: int  # first flattened row
    end: int
    rows_idx: torch.Tensor  # [Hkv * L] cache rows of key positions lo..seq_len-1, head-major
    width: int
    mask: torch.Tensor | None  # [Q, L] True where visible; None when plain causal with no context


@dataclass(slots=True)
class _Plan:
    decodes: list[_DecodePlan]
    chunks: list[_ChunkPlan]


def _seq_slots(meta: AttentionMetadata, b: int, lo: int, hi: int) -> torch.Tensor:
    pos = torch.arange(lo, hi, device=meta.block_tables.device)
    blocks = meta.block_tables[b].to(torch.int64)[pos // meta.block_size]
    return blocks * meta.block_size + pos % meta.block_size


@dataclass(frozen=True, slots=True)
class _Rows:
    """Where the cache keeps a key's row (cache_rows): shared by every layer of a forward."""

    num_kv: int
    block_size: int
    strides: tuple[int, int, int]  # rows per block, per token in a block, per head


def _head_major_rows(slots: torch.Tensor, where: _Rows) -> torch.Tensor:
    """Cache rows for slots [..., L] in the order [..., Hkv, L]: gathering them from the cache's rows
    (cache_rows) yields keys already laid out as SDPA wants them, in a single copy."""
    sb, st, sh = where.strides
    heads = torch.arange(where.num_kv, device=slots.device)
    base = slots // where.block_size * sb + slots % where.block_size * st
    rows = base.unsqueeze(-2) + heads[:, None] * sh  # [..., Hkv, L]
    return rows.reshape(-1)


def _decode_plan(meta: AttentionMetadata, seqs: list[int], window: int | None, where: _Rows) -> _DecodePlan:
    """One batched SDPA over `seqs` (all decodes), keys padded to the longest visible span."""
    device = meta.block_tables.device
    idx = torch.tensor(seqs, device=device)
    lens = meta.seq_lens.to(torch.int64)[idx]  # [Bd]
    longest = max(meta.seq_lens_cpu[b] for b in seqs)
    # Column j of sequence b holds key position first[b] + j: with a window, only the last
    # `window` keys are gathered, so a long context costs nothing beyond the window.
    width = longest if window is None else min(longest, window)
    first = (lens - width).clamp(min=0)
    pos = first[:, None] + torch.arange(width, device=device)[None, :]
    visible = pos < lens[:, None]
    if window is not None:
        visible &= pos >= (lens[:, None] - window)
    safe = torch.where(visible, pos, torch.zeros_like(pos))
    blocks = torch.gather(meta.block_tables.to(torch.int64)[idx], 1, safe // meta.block_size)
    slots = blocks * meta.block_size + safe % meta.block_size
    row_list = [meta.query_start_loc_cpu[b] for b in seqs]
    rows = torch.tensor(row_list, device=device)
    # Once per forward, shared by every layer: an all-visible mask (equal spans) costs SDPA three ops.
    mask = None if bool(visible.all()) else visible[:, None, None, :]
    every_row = row_list == list(range(meta.num_tokens))
    return _DecodePlan(
        rows=rows, rows_idx=_head_major_rows(slots, where), width=width, mask=mask, every_row=every_row
    )


def _build_plan(meta: AttentionMetadata, window: int | None, where: _Rows) -> _Plan:
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    # Decodes are batched by visible span in power-of-two buckets, so one long context does not
    # make every short one gather (and attend over) its length: padding stays under 2x.
    buckets: dict[int, list[int]] = {}
    for b in range(len(seq_lens)):
        if qsl[b + 1] - qsl[b] == 1:
            span = seq_lens[b] if window is None else min(seq_lens[b], window)
            buckets.setdefault((span - 1).bit_length(), []).append(b)
    decodes = [_decode_plan(meta, seqs, window, where) for _, seqs in sorted(buckets.items())]
    device = meta.block_tables.device
    chunks = []
    for b in range(len(seq_lens)):
        q_len = qsl[b + 1] - qsl[b]
        if q_len == 1:
            continue
        seq_len = seq_lens[b]
        ctx = seq_len - q_len
        # Keys before `lo` are outside every query's window: skip gathering them.
        lo = 0 if window is None else max(0, ctx - window + 1)
        slots = _seq_slots(meta, b, lo, seq_len)
        mask = None
        if ctx > 0 or window is not None:
            q_pos = torch.arange(ctx, seq_len, device=device)[:, None]
            k_pos = torch.arange(lo, seq_len, device=device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        chunks.append(
            _ChunkPlan(
                start=qsl[b], end=qsl[b + 1], rows_idx=_head_major_rows(slots, where),
                width=seq_len - lo, mask=mask,
            )
        )
    return _Plan(decodes=decodes, chunks=chunks)


def _sdpa(q, k, v, mask, scale, softcap, is_causal=False):
    """q [N, H, M, D], k/v [N, Hkv, L, D] (H a multiple of Hkv), mask broadcastable to [N, H, M, L]."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=gqa
        )
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        m, length = scores.shape[-2:]
        mask = torch.ones(m, length, dtype=torch.bool, device=q.device).tril(length - m)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def _gather_kv(kv_rows: torch.Tensor, rows_idx: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype):
    """Keys and values at `rows_idx` of both cache planes in one gather, each viewed as `shape`."""
    kv = kv_rows.index_select(1, rows_idx)
    return kv[0].view(shape).to(dtype), kv[1].view(shape).to(dtype)


def _decode_attention(q, kv_rows, d: _DecodePlan, num_kv: int, scale, softcap) -> torch.Tensor:
    """q [n, H, D] of the bucket's decodes -> [n, H, D]."""
    n, num_heads, head_dim = q.shape
    # GQA without copying KV: the `group` query heads sharing a KV head become its query rows.
    qd = q.reshape(n, num_kv, num_heads // num_kv, head_dim)
    kd, vd = _gather_kv(kv_rows, d.rows_idx, (n, num_kv, d.width, head_dim), q.dtype)
    return _sdpa(qd, kd, vd, d.mask, scale, softcap).reshape(n, num_heads, head_dim)


def reference_attention(
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
    """q [T, H, D], k/v [T, Hkv, D]; writes k/v into the cache, returns [T, H, D]."""
    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = kv_cache.shape[-2]
    kv_rows, strides = cache_rows(kv_cache)  # [k|v, row, D]
    key = ("reference_plan", sliding_window, strides)
    plan = meta.cache.get(key)
    if plan is None:
        plan = meta.cache[key] = _build_plan(meta, sliding_window, _Rows(num_kv, kv_cache.shape[2], strides))
    if len(plan.decodes) == 1 and plan.decodes[0].every_row:
        # The whole batch is one decode bucket: q is read and the output returned as they are.
        return _decode_attention(q, kv_rows, plan.decodes[0], num_kv, scale, softcap)
    out = torch.empty_like(q)
    for d in plan.decodes:
        out[d.rows] = _decode_attention(q[d.rows], kv_rows, d, num_kv, scale, softcap)
    for c in plan.chunks:
        q_len = c.end - c.start
        qc = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        kc, vc = _gather_kv(kv_rows, c.rows_idx, (1, num_kv, c.width, head_dim), q.dtype)
        if c.mask is None:
            oc = _sdpa(qc, kc, vc, None, scale, softcap, is_causal=True)
        else:
            oc = _sdpa(qc, kc, vc, c.mask, scale, softcap)
        out[c.start : c.end] = oc[0].transpose(0, 1).reshape(q_len, num_heads, head_dim)
    return out
