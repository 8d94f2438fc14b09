"""Run sequences through the attention op on a schedule of forwards, as an engine would (shared by the kernel tests).

Each sequence has fixed inputs per position (q, k, v). A schedule is a list of forwards; a forward
lists (sequence, number of new tokens) pairs, each continuing that sequence where it stopped. Blocks
are handed out on demand from a shuffled free list (paged), or one block of `max_len` per sequence
(contiguous), so the same sequence lands in different physical blocks under different schedules. The
result is each sequence's output at every position, whatever forward computed it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ladle.kernels import AttentionMetadata


@dataclass(slots=True)
class SeqInputs:
    q: torch.Tensor  # [L, H, D]
    k: torch.Tensor  # [L, Hkv, D]
    v: torch.Tensor


def random_inputs(lengths: list[int], heads: int, kv_heads: int, head_dim: int, seed: int,
                  dtype: torch.dtype = torch.float32) -> list[SeqInputs]:
    gen = torch.Generator().manual_seed(seed)
    return [
        SeqInputs(*(torch.randn(n, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads)))
        for n in lengths
    ]


@dataclass(slots=True)
class CacheLayout:
    block_size: int = 16
    contiguous: bool = False  # one block of max_len per sequence
    max_len: int = 512
    seed: int = 0  # shuffles the free list
    spare_blocks: int = 7
    garbage: float = float("nan")  # what unwritten slots hold (the reference needs finite garbage)
    head_major: bool = False  # each block's memory [heads, block, dim] (the CPU engine's, engine/kv_cache.py)


@dataclass(slots=True)
class _State:
    done: dict[int, int] = field(default_factory=dict)
    tables: dict[int, list[int]] = field(default_factory=dict)


def run_schedule(
    seqs: list[SeqInputs],
    schedule: list[list[tuple[int, int]]],
    attention: Callable[..., torch.Tensor],
    layout: CacheLayout,
    *,
    scale: float = 0.25,
    window: int | None = None,
    softcap: float | None = None,
) -> list[torch.Tensor]:
    """Outputs [L, H, D] per sequence (NaN where no forward computed a position)."""
    s0 = seqs[0]
    kv_heads, head_dim, dtype = s0.k.shape[1], s0.k.shape[2], s0.k.dtype
    block = layout.max_len if layout.contiguous else layout.block_size
    if layout.contiguous:
        num_blocks = len(seqs) + layout.spare_blocks
    else:
        num_blocks = sum(-(-s.q.shape[0] // block) for s in seqs) + layout.spare_blocks
    free = list(range(num_blocks))
    random.Random(layout.seed).shuffle(free)
    # Garbage (NaN by default) in unwritten slots: the kernel must never read them.
    if layout.head_major:
        cache = torch.full((2, num_blocks, kv_heads, block, head_dim), layout.garbage, dtype=dtype).transpose(2, 3)
    else:
        cache = torch.full((2, num_blocks, block, kv_heads, head_dim), layout.garbage, dtype=dtype)
    outs = [torch.full(s.q.shape, float("nan"), dtype=s.q.dtype) for s in seqs]
    st = _State()
    for forward in schedule:
        query_lens, seq_lens, tables, rows = [], [], [], []
        for sid, n in forward:
            start = st.done.get(sid, 0)
            end = start + n
            table = st.tables.setdefault(sid, [])
            while len(table) * block < end:
                table.append(free.pop())
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(list(table))
            rows.append((sid, start, end))
            st.done[sid] = end
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, block)
        q = torch.cat([seqs[sid].q[a:b] for sid, a, b in rows])
        k = torch.cat([seqs[sid].k[a:b] for sid, a, b in rows])
        v = torch.cat([seqs[sid].v[a:b] for sid, a, b in rows])
        out = attention(q, k, v, cache, meta, scale=scale, sliding_window=window, softcap=softcap)
        at = 0
        for sid, a, b in rows:
            outs[sid][a:b] = out[at : at + b - a]
            at += b - a
    return outs


def chunks(total: int, sizes: list[int]) -> list[int]:
    """`total` cut into pieces of the given sizes in turn (the last one cut short)."""
    out, i = [], 0
    while total > 0:
        n = min(total, max(1, sizes[i % len(sizes)]))
        out.append(n)
        total -= n
        i += 1
    return out


def alone(sid: int, pieces: list[int]) -> list[list[tuple[int, int]]]:
    return [[(sid, n)] for n in pieces]


def interleave(plans: dict[int, list[int]], seed: int, max_batch: int) -> list[list[tuple[int, int]]]:
    """Forwards mixing the sequences' pieces: each forward takes the next piece of up to `max_batch`
    random sequences that still have pieces (a sequence's pieces stay in order)."""
    rng = random.Random(seed)
    queues = {sid: list(p) for sid, p in plans.items() if p}
    schedule = []
    while queues:
        picked = rng.sample(sorted(queues), min(len(queues), rng.randint(1, max_batch)))
        rng.shuffle(picked)
        schedule.append([(sid, queues[sid].pop(0)) for sid in picked])
        for sid in picked:
            if not queues[sid]:
                del queues[sid]
    return schedule
