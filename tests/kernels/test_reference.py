"""The torch reference attention against a per-token, per-head loop written from the definition."""

import math

import pytest
import torch

from ladle.kernels import AttentionMetadata, reference_attention


def naive_attention(q, k_all, v_all, seq_positions, scale, window, softcap):
    """q [H, D] at position p; k_all/v_all [p+1, Hkv, D] for positions 0..p."""
    p = seq_positions
    num_heads, num_kv = q.shape[0], k_all.shape[1]
    out = torch.empty_like(q)
    lo = 0 if window is None else max(0, p - window + 1)
    for h in range(num_heads):
        kh = k_all[lo : p + 1, h // (num_heads // num_kv)]
        vh = v_all[lo : p + 1, h // (num_heads // num_kv)]
        s = (kh @ q[h]) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        out[h] = torch.softmax(s, 0) @ vh
    return out


def make_batch(seqs, block_size, num_kv, head_dim, num_heads, gen):
    """seqs: list of (context_len, query_len). Returns q, k, v, cache, meta and the full K/V per sequence."""
    blocks_needed = [math.ceil((c + q) / block_size) for c, q in seqs]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered blocks
    cache = torch.zeros(2, num_blocks, block_size, num_kv, head_dim)
    tables, full_k, full_v, qs, ks, vs = [], [], [], [], [], []
    for c, q in seqs:
        n = math.ceil((c + q) / block_size)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        kk = torch.randn(c + q, num_kv, head_dim, generator=gen)
        vv = torch.randn(c + q, num_kv, head_dim, generator=gen)
        for pos in range(c):  # the context is already cached
            cache[0, table[pos // block_size], pos % block_size] = kk[pos]
            cache[1, table[pos // block_size], pos % block_size] = vv[pos]
        full_k.append(kk)
        full_v.append(vv)
        qs.append(torch.randn(q, num_heads, head_dim, generator=gen))
        ks.append(kk[c:])
        vs.append(vv[c:])
    meta = AttentionMetadata.build(
        [q for _, q in seqs], [c + q for c, q in seqs], tables, block_size
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, full_k, full_v


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("block_size", [4, 16, 64])
@pytest.mark.parametrize("num_heads,num_kv", [(4, 4), (8, 2)])
def test_reference_matches_definition(window, softcap, block_size, num_heads, num_kv):
    gen = torch.Generator().manual_seed(block_size + num_heads)
    seqs = [(0, 1), (7, 1), (0, 9), (13, 6), (3, 1), (20, 17), (40, 1)]
    head_dim = 8
    q, k, v, cache, meta, full_k, full_v = make_batch(seqs, block_size, num_kv, head_dim, num_heads, gen)
    out = reference_attention(q, k, v, cache, meta, scale=0.3, sliding_window=window, softcap=softcap)
    row = 0
    for b, (c, qn) in enumerate(seqs):
        for i in range(qn):
            p = c + i
            want = naive_attention(q[row], full_k[b][: p + 1], full_v[b][: p + 1], p, 0.3, window, softcap)
            torch.testing.assert_close(out[row], want, atol=1e-5, rtol=1e-5)
            row += 1
    # The new keys/values landed in their slots.
    flat_k = cache[0].view(-1, num_kv, head_dim)
    torch.testing.assert_close(flat_k[meta.slot_mapping], k)
