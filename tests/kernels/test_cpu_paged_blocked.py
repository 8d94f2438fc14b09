"""The CPU kernel's blocked path (prefill chunks: query rows in blocks of 48, 16 to a vector, keys 8 at a
time) at its edges: chunks that start inside a tile, row counts that are not a multiple of the block or
of a vector, every GQA group size, head dims with a tail, windows that leave some rows of a block (or of
a value group) without a key in a tile, soft-cap. Each against the reference, and bitwise against the
same positions computed whole, in other chunks, as row-wise decodes and inside mixed batches. And the
score formula both paths share, pinned by values whose sum depends on the order and the rounding."""

from __future__ import annotations

import pytest
import torch

from ladle.kernels import cpu_build, reference_attention
from ladle.kernels.cpu_paged import cpu_paged_attention
from tests.kernels.cpu_schedules import (
    CacheLayout,
    SeqInputs,
    alone,
    chunks,
    interleave,
    random_inputs,
    run_schedule,
)

if cpu_build._compiler() is None:
    pytest.skip("no C++ compiler: the CPU kernel cannot be built here", allow_module_level=True)

LENGTH = 150  # crosses four 32-key tiles and ends inside the fifth
# (window, softcap): none; a window of 2 (rows of one block, or of one value group, see no key of a
# tile their neighbours see); a window across tiles; soft-cap; both.
VARIANTS = [(None, None), (2, None), (37, None), (None, 20.0), (5, 8.0)]


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _reference(seq, kw) -> torch.Tensor:
    """The torch reference on the whole sequence (one forward, contiguous cache)."""
    layout = CacheLayout(block_size=16, garbage=0.0)
    return run_schedule([seq], alone(0, [len(seq.q)]), reference_attention, layout, **kw)[0]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (8, 2), (16, 2), (8, 1)])  # GQA 1, 2, 4, 8, 8
@pytest.mark.parametrize("head_dim", [64, 128, 72, 40])
def test_blocked_edges_bitwise(heads, kv_heads, head_dim, threads):
    seqs = random_inputs([LENGTH, 61], heads, kv_heads, head_dim, seed=head_dim + heads)
    for window, softcap in VARIANTS:
        kw = {"window": window, "softcap": softcap, "scale": head_dim**-0.5}
        torch.set_num_threads(1)
        layout = CacheLayout(block_size=16, max_len=160)
        whole = run_schedule(seqs[:1], alone(0, [LENGTH]), cpu_paged_attention, layout, **kw)[0]
        torch.testing.assert_close(whole, _reference(seqs[0], kw), atol=2e-5, rtol=2e-5)
        schedules = {
            # Chunks starting inside tiles, of row counts that are no multiple of 16 or 48 at any group size.
            "chunks 13/45/50/7": alone(0, chunks(LENGTH, [13, 45, 50, 7])),
            "chunks of 3": alone(0, chunks(LENGTH, [3])),
            # The last positions as decodes: the row-wise path where a KV head has at most 8 rows.
            "prompt 97 then decodes": alone(0, [97] + [1] * (LENGTH - 97)),
        }
        for name, schedule in schedules.items():
            got = run_schedule(seqs[:1], schedule, cpu_paged_attention, layout, **kw)[0]
            assert torch.equal(got, whole), f"{name}, window {window}, softcap {softcap}"
        # Head-major blocks (the CPU engine's cache): key and value rows read in place, not copied.
        head_major = CacheLayout(block_size=16, max_len=160, head_major=True)
        got = run_schedule(seqs[:1], schedules["chunks 13/45/50/7"], cpu_paged_attention, head_major, **kw)[0]
        assert torch.equal(got, whole), f"head-major chunks, window {window}, softcap {softcap}"
        torch.set_num_threads(2)
        mixed = interleave({0: chunks(LENGTH, [40, 1, 29]), 1: chunks(61, [17, 1])}, seed=head_dim, max_batch=2)
        got = run_schedule(seqs, mixed, cpu_paged_attention, CacheLayout(block_size=4, max_len=160, seed=3), **kw)
        assert torch.equal(got[0], whole), f"mixed batch, window {window}, softcap {softcap}"


@pytest.mark.parametrize("heads,kv_heads,query_len", [(8, 4, 3), (16, 2, 1), (12, 2, 4)])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_blocked_multi_head_items(heads, kv_heads, query_len, head_dim, threads):
    """Many short queries per sequence (6 and 8 rows per KV head: row-wise; 24: blocked) in a batch large
    enough that one work item holds all KV heads of a sequence (its whole cache rows prefetched, or head
    by head in a head-major cache): equal to each sequence alone."""
    lengths = [int(n) for n in torch.randint(query_len + 1, 90, (20,), generator=torch.Generator().manual_seed(7))]
    seqs = random_inputs(lengths, heads, kv_heads, head_dim, seed=9)
    kw = {"scale": 0.2, "window": None, "softcap": None}
    prompts = {sid: [n - query_len] for sid, n in enumerate(lengths)}
    forwards = [[(sid, p[0]) for sid, p in prompts.items()], [(sid, query_len) for sid in range(len(lengths))]]
    torch.set_num_threads(1)
    want = [run_schedule([s], alone(0, [len(s.q)]), cpu_paged_attention, CacheLayout(), **kw)[0] for s in seqs]
    for t, head_major in ((1, False), (2, False), (1, True), (2, True)):
        torch.set_num_threads(t)
        got = run_schedule(seqs, forwards, cpu_paged_attention, CacheLayout(seed=t, head_major=head_major), **kw)
        for sid in range(len(seqs)):
            assert torch.equal(got[sid], want[sid]), f"sequence {sid}, {t} threads, head-major {head_major}"


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (8, 1)])
@pytest.mark.parametrize("window", [None, 2, 37])
@pytest.mark.parametrize("poisoned", [64, 70])
def test_unseen_keys_never_count(heads, kv_heads, window, poisoned):
    """A NaN key and value at one position changes no output of a query that cannot see it (earlier
    positions, and positions past the window): rows of one block or value group that see different keys
    of a tile never share an operation on the keys only some of them see. The chunk from 51 puts
    positions 63 and 64 (either side of a tile start) in one group of value rows."""
    seqs = random_inputs([LENGTH], heads, kv_heads, 64, seed=1)
    kw = {"window": window, "softcap": None, "scale": 0.125}
    schedule = alone(0, [51, 64, 35])
    clean = run_schedule(seqs, schedule, cpu_paged_attention, CacheLayout(), **kw)[0]
    seqs[0].k[poisoned] = float("nan")
    seqs[0].v[poisoned] = float("nan")
    got = run_schedule(seqs, schedule, cpu_paged_attention, CacheLayout(), **kw)[0]
    unseen = torch.ones(LENGTH, dtype=torch.bool)
    unseen[poisoned : poisoned + (window or LENGTH)] = False
    assert torch.equal(got[unseen], clean[unseen])
    assert got[~unseen].isnan().all()


# -- the score formula -------------------------------------------------------------------------------
def _two_keys(k0: list[float], q_row: list[float], head_dim: int, heads: int, prompt_then_decode: bool):
    """Output at position 1 (keys 0 and 1) of a sequence whose key 0 is k0 (then zeros), key 1 zeros,
    values 1 and 3, and whose queries at position 1 are all q_row; scale = softcap, so the queries go
    into the kernel unscaled (scale / softcap = 1) and a score of exactly 0 gives weights 1 and 1."""
    pad = lambda x: torch.tensor(x + [0.0] * (head_dim - len(x)))
    q = torch.zeros(2, heads, head_dim)
    q[1] = pad(q_row)
    k = torch.zeros(2, 1, head_dim)
    k[0, 0] = pad(k0)
    v = torch.stack([torch.full((1, head_dim), 1.0), torch.full((1, head_dim), 3.0)])
    seqs = [SeqInputs(q, k, v)]
    schedule = alone(0, [1, 1] if prompt_then_decode else [2])
    return run_schedule(seqs, schedule, cpu_paged_attention, CacheLayout(), scale=50.0, softcap=50.0)[0][1]


@pytest.mark.parametrize("head_dim", [32, 72])
@pytest.mark.parametrize("heads,decode", [(1, True), (2, True), (8, True), (16, False), (8, False)])
def test_score_is_one_fma_chain_in_increasing_d(head_dim, heads, decode):
    """The score of a (row, key) is one fused multiply-add per dimension, in increasing d, from +0, on
    both paths (row-wise decodes: 1, 2 or 8 rows a KV head; blocked: 16 or 8 x 2 rows). Pinned with
    values whose sum depends on the order and on the rounding:
    - order: q = 1s, k0 = [2^24, 1, 1, -2^24]: in increasing d, 2^24 + 1 rounds back to 2^24 (twice),
      then 0: both keys score 0, the output is (1 + 3) / 2 = 2 exactly (decreasing d gives 2, a sum
      of lane partials 2 as well: the score would not be 0);
    - fusion: q = [1, 1 + 2^-12], k0 = [-(1 + 2^-11), 1 + 2^-12]: the exact product 1 + 2^-11 + 2^-24
      added to -(1 + 2^-11) gives 2^-24 (a rounded product gives 0): key 0 weighs a little more."""
    order = _two_keys([2.0**24, 1.0, 1.0, -(2.0**24)], [1.0] * head_dim, head_dim, heads, decode)
    assert torch.equal(order, torch.full_like(order, 2.0))
    e = 2.0**-12
    fused = _two_keys([-(1 + 2 * e), 1 + e], [1.0, 1 + e], head_dim, heads, decode)
    assert (fused < 2.0).all() and (fused > 2.0 - 1e-5).all()


def test_three_threads_bitwise(threads):
    """Chunks and decodes of several sequences at 3 threads (items shared unevenly): each sequence's
    outputs bitwise equal to it alone on one thread."""
    lengths = [150, 61, 97, 33, 120]
    seqs = random_inputs(lengths, 8, 2, 64, seed=21)
    kw = {"window": None, "softcap": None, "scale": 0.125}
    torch.set_num_threads(1)
    want = [run_schedule([s], alone(0, [len(s.q)]), cpu_paged_attention, CacheLayout(), **kw)[0] for s in seqs]
    plans = {sid: chunks(n - 5, [37, 64]) + [1] * 5 for sid, n in enumerate(lengths)}
    torch.set_num_threads(3)
    got = run_schedule(seqs, interleave(plans, seed=3, max_batch=5), cpu_paged_attention, CacheLayout(seed=4), **kw)
    for sid in range(len(seqs)):
        assert torch.equal(got[sid], want[sid]), f"sequence {sid}"
