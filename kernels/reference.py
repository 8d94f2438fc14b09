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

from kernels.metadata import AttentionMetadata


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, Hkv, D] at their slots of kv_cache [2, num_blocks, block_size, Hkv, D]."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


@dataclass(slots=True)
class _DecodePlan:
    rows: torch.Tensor  # [Bd] flattened row of each decode query
    slots: torch.Tensor  # [Bd, L] cache slot of each key position (clamped where masked)
    mask: torch.Tensor  # [Bd, 1, 1, L] True where the key is visible


@dataclass(slots=True)
class _ChunkPlan:
    start: int  # first flattened row
    end: int
    slots: torch.Tensor  # [L] cache slots of key positions lo..seq_len-1
    mask: torch.Tensor | None  # [Q, L] True where visible; None when plain causal with no context


@dataclass(slots=True)
class _Plan:
    decodes: _DecodePlan | None
    chunks: list[_ChunkPlan]


def _seq_slots(meta: AttentionMetadata, b: int, lo: int, hi: int) -> torch.Tensor:
    pos = torch.arange(lo, hi, device=meta.block_tables.device)
    blocks = meta.block_tables[b].to(torch.int64)[pos // meta.block_size]
    return blocks * meta.block_size + pos % meta.block_size


def _build_plan(meta: AttentionMetadata, window: int | None) -> _Plan:
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    device = meta.block_tables.device
    decode_seqs = [b for b in range(len(seq_lens)) if qsl[b + 1] - qsl[b] == 1]
    decodes = None
    if decode_seqs:
        idx = torch.tensor(decode_seqs, device=device)
        lens = meta.seq_lens.to(torch.int64)[idx]  # [Bd]
        width = max(seq_lens[b] for b in decode_seqs)
        pos = torch.arange(width, device=device)
        visible = pos[None, :] < lens[:, None]
        if window is not None:
            visible &= pos[None, :] >= (lens[:, None] - window)
        safe = torch.where(visible, pos[None, :], torch.zeros_like(pos)[None, :])
        blocks = torch.gather(meta.block_tables.to(torch.int64)[idx], 1, safe // meta.block_size)
        slots = blocks * meta.block_size + safe % meta.block_size
        rows = torch.tensor([qsl[b] for b in decode_seqs], device=device)
        decodes = _DecodePlan(rows=rows, slots=slots, mask=visible[:, None, None, :])
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
        chunks.append(_ChunkPlan(start=qsl[b], end=qsl[b + 1], slots=slots, mask=mask))
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
    key = ("reference_plan", sliding_window)
    plan = meta.cache.get(key)
    if plan is None:
        plan = meta.cache[key] = _build_plan(meta, sliding_window)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = kv_cache.shape[-2]
    group = num_heads // num_kv
    k_flat = kv_cache[0].view(-1, num_kv, head_dim)
    v_flat = kv_cache[1].view(-1, num_kv, head_dim)
    out = torch.empty_like(q)
    if plan.decodes is not None:
        d = plan.decodes
        n, width = d.slots.shape
        # GQA without copying KV: the `group` query heads sharing a KV head become its query rows.
        qd = q[d.rows].view(n, num_kv, group, head_dim)
        kd = k_flat[d.slots.reshape(-1)].view(n, width, num_kv, head_dim).transpose(1, 2).to(q.dtype)
        vd = v_flat[d.slots.reshape(-1)].view(n, width, num_kv, head_dim).transpose(1, 2).to(q.dtype)
        od = _sdpa(qd, kd, vd, d.mask, scale, softcap)
        out[d.rows] = od.reshape(n, num_heads, head_dim)
    for c in plan.chunks:
        q_len = c.end - c.start
        qc = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        kc = k_flat[c.slots].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, L, D]
        vc = v_flat[c.slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
        if c.mask is None:
            oc = _sdpa(qc, kc, vc, None, scale, softcap, is_causal=True)
        else:
            oc = _sdpa(qc, kc, vc, c.mask, scale, softcap)
        out[c.start : c.end] = oc[0].transpose(0, 1).reshape(q_len, num_heads, head_dim)
    return out
