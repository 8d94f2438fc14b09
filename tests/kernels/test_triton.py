"""The Triton attention and KV-cache write kernels against the torch reference (the oracle).

Without CUDA the kernels run in the Triton interpreter on CPU tensors. Triton picks interpreter or
compiler when a function is *decorated*: its own library (tl.zeros, tl.max, ...) when `triton` is
first imported, our kernels when kernels.triton_* is imported. So on CPU this module sets
TRITON_INTERPRET=1 before the first import of triton and leaves it set (triton also decorates
functions of modules it imports lazily later, which must agree; nothing but triton reads it, and
without a GPU there is nothing to compile for). If something in this pytest process imported triton
earlier, in compiled mode, the kernel tests are skipped here and
test_kernels_in_a_fresh_interpreter_process runs this file again in a subprocess with the variable set.
With CUDA the compiled kernels run on the GPU against the same oracle.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ladle.kernels import AttentionMetadata, reference_attention, write_kv_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if DEVICE == "cpu" and "triton" not in sys.modules:
    # Stays set for the rest of this process: triton also decorates functions in modules it imports
    # lazily later (e.g. gluon), which must agree. Only triton reads it; no GPU here to compile for.
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
import ladle.kernels.triton_attention as triton_attention_mod
import ladle.kernels.triton_cache as triton_cache_mod
from ladle.kernels import triton_launch

KERNELS_RUN_HERE = DEVICE == "cuda" or triton_attention_mod.is_interpreted()
needs_kernels = pytest.mark.skipif(
    not KERNELS_RUN_HERE,
    reason="triton was imported in compiled mode before this module; the subprocess test runs these",
)

triton_attention = triton_attention_mod.triton_attention
triton_write_kv_cache = triton_cache_mod.triton_write_kv_cache

# (context_len, query_len) per sequence. Lengths cross 16-token block boundaries; contexts go from
# empty to a few hundred tokens; queries from 1 (decode) to 130 (longer than one query tile).
BATCHES = {
    "decode": [(0, 1), (15, 1), (16, 1), (47, 1), (300, 1), (5, 1), (129, 1)],
    "chunk": [(0, 130), (17, 33), (250, 64), (0, 2), (31, 5)],
    "mixed": [(0, 1), (33, 1), (0, 70), (200, 1), (40, 130), (16, 16), (350, 7), (3, 1)],
    "single": [(0, 130)],
}
CONTIGUOUS = 400  # one block of this many tokens per sequence (the contiguous cache; not a power of two)

# batch, (num_heads, num_kv), head_dim, block_size, window, softcap, dtype. Every value of every axis
# appears in several combinations (GQA 1/4/8, head dims 64/128/256, paged and contiguous blocks,
# window 8 < chunk, softcap, fp32/bf16); the last rows add the tiny models' head dims, a group of 3,
# a head_dim that is not a power of two and fp16.
CASES = [
    ("decode", (4, 4), 64, 16, None, None, torch.float32),
    ("decode", (8, 2), 128, CONTIGUOUS, 8, 30.0, torch.bfloat16),
    ("decode", (8, 1), 256, 16, 8, None, torch.float32),
    ("chunk", (4, 4), 128, 16, 8, None, torch.bfloat16),
    ("chunk", (8, 2), 256, CONTIGUOUS, None, 30.0, torch.bfloat16),
    ("chunk", (8, 1), 64, 16, None, 30.0, torch.bfloat16),
    ("mixed", (4, 4), 256, 16, None, 30.0, torch.bfloat16),
    ("mixed", (8, 2), 64, 16, 8, None, torch.float32),
    ("mixed", (8, 1), 128, CONTIGUOUS, 8, 30.0, torch.float32),
    ("mixed", (8, 2), 128, 16, None, None, torch.bfloat16),
    ("single", (4, 4), 64, 16, None, None, torch.float32),
    ("mixed", (4, 2), 8, 16, 8, 30.0, torch.float32),
    ("mixed", (6, 2), 32, 16, None, None, torch.float16),
    ("chunk", (4, 1), 16, CONTIGUOUS, 8, None, torch.float32),
    ("mixed", (4, 1), 80, 16, None, None, torch.float32),
]
TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
}


def _case_id(case):
    batch, (h, hkv), d, bs, window, softcap, dtype = case
    block = "contig" if bs == CONTIGUOUS else f"bs{bs}"
    return f"{batch}-h{h}kv{hkv}-d{d}-{block}-w{window}-cap{softcap}-{str(dtype).split('.')[-1]}"


def build_batch(seqs, block_size, num_heads, num_kv, head_dim, dtype, seed=0):
    """A flattened batch over scattered cache blocks with the contexts already cached.

    Cache rows that hold no key of any sequence are NaN: a kernel that reads them unmasked fails.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil((c + q) / block_size) for c, q in seqs]
    num_blocks = sum(blocks_needed) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in blocks_needed:
        tables.append(perm[:n])
        perm = perm[n:]
    meta = AttentionMetadata.build(
        [q for _, q in seqs], [c + q for c, q in seqs], tables, block_size, device=DEVICE
    )
    cache = torch.full((2, num_blocks, block_size, num_kv, head_dim), float("nan"))
    flat = cache.view(2, -1, num_kv, head_dim)
    for (c, _), table in zip(seqs, tables):
        pos = torch.arange(c)
        slots = torch.tensor(table, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
        flat[:, slots] = torch.randn(2, c, num_kv, head_dim, generator=gen)
    total = sum(q for _, q in seqs)
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    k = torch.randn(total, num_kv, head_dim, generator=gen)
    v = torch.randn(total, num_kv, head_dim, generator=gen)
    return (*(t.to(dtype=dtype, device=DEVICE) for t in (q, k, v, cache)), meta)


def poison_skipped_tiles(cache, meta, window, block_n):
    """NaN the keys/values of every sequence that lie in KV tiles wholly before all of its windows.

    The kernel must skip those tiles: loading one would put NaN into the output (0 * NaN in P @ V).
    Returns the number of positions poisoned.
    """
    flat = cache.view(2, -1, cache.shape[-2], cache.shape[-1])
    tables = meta.block_tables.cpu().to(torch.int64)
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    poisoned = 0
    for b, seq_len in enumerate(seq_lens):
        context = seq_len - (qsl[b + 1] - qsl[b])
        skip_end = max(0, context - window + 1) // block_n * block_n
        if skip_end:
            pos = torch.arange(skip_end)
            slots = tables[b, pos // meta.block_size] * meta.block_size + pos % meta.block_size
            flat[:, slots.to(cache.device)] = float("nan")
            poisoned += skip_end
    return poisoned


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_attention_matches_reference(case):
    batch, (num_heads, num_kv), head_dim, block_size, window, softcap, dtype = case
    seqs = BATCHES[batch]
    q, k, v, cache, meta = build_batch(seqs, block_size, num_heads, num_kv, head_dim, dtype)
    scale = head_dim**-0.5
    ref_cache = cache.clone()
    want = reference_attention(q, k, v, ref_cache, meta, scale=scale, sliding_window=window, softcap=softcap)
    if window is not None:
        group = num_heads // num_kv
        _, _, block_n, _ = triton_launch.tile_config(head_dim, group, meta.max_query_len, dtype)
        assert poison_skipped_tiles(cache, meta, window, block_n) > 0
    got = triton_attention(q, k, v, cache, meta, scale=scale, sliding_window=window, softcap=softcap)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    # The new keys/values are in the cache, at their slots.
    flat = cache.view(2, -1, num_kv, head_dim)
    torch.testing.assert_close(flat[0, meta.slot_mapping], k, atol=0, rtol=0)
    torch.testing.assert_close(flat[1, meta.slot_mapping], v, atol=0, rtol=0)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_cache_write_puts_every_token_at_its_slot(cache_dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv, head_dim, tokens = 6, 16, 2, 24, 40
    cache = torch.randn(2, num_blocks, block_size, num_kv, head_dim, generator=gen).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    # k and v as strided views of a fused projection, in fp32: the kernel casts to the cache dtype.
    kv = torch.randn(tokens, 2 * num_kv, head_dim + 8, generator=gen)
    k, v = kv[:, :num_kv, :head_dim], kv[:, num_kv:, :head_dim]
    want = cache.clone()
    write_kv_cache(k, v, want, slots)
    got = cache.to(DEVICE)
    triton_write_kv_cache(k.to(DEVICE), v.to(DEVICE), got, slots.to(DEVICE))
    # New slots written, every other slot untouched. Exact, except that the interpreter converts
    # fp32 -> bf16 by truncation where the GPU rounds to nearest: then within one bf16 ulp.
    exact = DEVICE == "cuda" or cache_dtype == torch.float32
    tol = {"atol": 0.0, "rtol": 0.0} if exact else {"atol": 0.0, "rtol": 2.0**-7}
    torch.testing.assert_close(got.cpu(), want, **tol)
    # A negative slot (a padding row) is skipped.
    skip = slots.clone()
    skip[::2] = -1
    again = cache.to(DEVICE)
    triton_write_kv_cache(k.to(DEVICE), v.to(DEVICE), again, skip.to(DEVICE))
    kept = skip >= 0
    expect = cache.clone()
    write_kv_cache(k[kept], v[kept], expect, skip[kept])
    torch.testing.assert_close(again.cpu(), expect, **tol)


def test_query_tiles_of_each_sequence_fit_the_grid():
    """Sequence b's tiles start at query_start_loc[b] // BLOCK_Q + b: disjoint, inside the grid."""
    gen = torch.Generator().manual_seed(2)
    for block_q in (1, 2, 8, 16, 64):
        for _ in range(50):
            lens = torch.randint(1, 150, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen)
            qsl = [0, *torch.cumsum(lens, 0).tolist()]
            grid = qsl[-1] // block_q + len(lens)
            owner = {}
            for b, n in enumerate(lens.tolist()):
                first = qsl[b] // block_q + b
                for t in range(first, first + math.ceil(n / block_q)):
                    assert t < grid and t not in owner
                    owner[t] = b


def test_tile_config_stays_small_and_legal():
    for dtype in (torch.float32, torch.bfloat16):
        for head_dim in (8, 32, 64, 80, 128, 256):
            for group in (1, 2, 3, 4, 8, 16):
                for max_q in (1, 2, 7, 130, 4096):
                    bm, bq, bn, _ = triton_launch.tile_config(head_dim, group, max_q, dtype)
                    assert bm >= 16 and bn >= 16 and bq >= 1 and bq * group <= bm
                    assert bm & (bm - 1) == 0
                    if max_q == 1:  # decode-only: the head group alone, padded to tl.dot's 16 rows
                        assert bm == max(16, 1 << (group - 1).bit_length())


# Compiles the kernels for real GPUs (sm_90 and sm_80) through triton's bundled ptxas, without a GPU:
# catches what the interpreter cannot (types, layouts, dot shapes). Runs in a subprocess because
# this process's triton is in interpreter mode.
_COMPILE_SCRIPT = r"""
import inspect, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
if "nvidia" not in triton.backends.backends:
    print("SKIP: triton has no nvidia backend"); sys.exit(0)
import ladle.kernels.triton_attention as A
import ladle.kernels.triton_cache as C
import ladle.kernels.triton_launch as L
import ladle.kernels.triton_split_kv as S

def signature(kernel, dtype, constexprs, wide=()):
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("block_tables_ptr", "seq_lens_ptr", "qsl_ptr", "decode_seqs_ptr"):
            sig[name] = "*i32"
        elif name.startswith("part_"):
            sig[name] = "*fp32"
        elif name == "slot_ptr":
            sig[name] = "*i64"
        elif name.endswith("_ptr"):
            sig[name] = "*" + dtype
        elif name in ("scale", "softcap"):
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if name in wide else "i32"
    return sig

TORCH = {"bf16": A.torch.bfloat16, "fp16": A.torch.float16, "fp32": A.torch.float32}
for arch, dtype, head_dim, group, block_size, max_q, window, softcap in [
    (90, "bf16", 128, 4, 16, 512, True, True),
    (90, "bf16", 256, 2, 400, 1, False, False),
    (90, "fp32", 64, 1, 16, 512, True, False),
    (80, "fp16", 128, 8, 16, 512, False, True),
]:
    bm, bq, bn, warps = L.tile_config(head_dim, group, max_q, TORCH[dtype])
    const = dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
                 BLOCK_SIZE=block_size, BLOCK_M=bm, BLOCK_Q=bq, BLOCK_N=bn, HAS_WINDOW=window,
                 HAS_SOFTCAP=softcap, FP32_DOT=dtype == "fp32", UPCAST_DOT=False)
    sig = signature(A._paged_attention_kernel, dtype, const, wide=("stride_cb",))
    src = ASTSource(A._paged_attention_kernel, sig, const)
    triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    # The split-KV decode kernel (decode tiles) and its reduce.
    bm, _, bn, warps = L.tile_config(head_dim, group, 1, TORCH[dtype])
    const = dict(NUM_HEADS=group * 2, GROUP=group, HEAD_DIM=head_dim,
                 HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_M=bm,
                 BLOCK_N=bn, HAS_WINDOW=window, HAS_SOFTCAP=softcap, FP32_DOT=dtype == "fp32", UPCAST_DOT=False)
    src = ASTSource(S._split_kv_decode_kernel, signature(S._split_kv_decode_kernel, dtype, const, wide=("stride_cb",)),
                    const)
    triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    const = dict(NUM_HEADS=group * 2, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
                 SEGMENTS_PAD=L.MAX_SEGMENTS)
    src = ASTSource(S._reduce_segments_kernel, signature(S._reduce_segments_kernel, dtype, const), const)
    triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
const = dict(NUM_KV=8, HEAD_DIM=128, NUM_KV_PAD=8, HEAD_DIM_PAD=128)
src = ASTSource(C._write_kv_kernel, signature(C._write_kv_kernel, "bf16", const), const)
triton.compile(src, target=GPUTarget("cuda", 90, 32))
print("COMPILED")
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the compiled kernels run on the GPU in this process")
def test_kernels_compile_for_gpus():
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-c", _COMPILE_SCRIPT]
    proc = subprocess.run(cmd, check=False, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert "COMPILED" in proc.stdout


@needs_kernels
def test_dispatch_uses_triton_when_forced(monkeypatch):
    from ladle import kernels
    from ladle.kernels import dispatch

    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return triton_attention(*args, **kwargs)

    monkeypatch.setattr(triton_attention_mod, "triton_attention", spy)
    seqs = BATCHES["mixed"][:4]
    q, k, v, cache, meta = build_batch(seqs, 16, 4, 2, 16, torch.float32, seed=3)
    # q, k, v as strided views of one fused projection, as a model's qkv split produces them.
    q, k, v = torch.cat([q, k, v], dim=1).split([4, 2, 2], dim=1)
    assert not q.is_contiguous()
    want = reference_attention(q, k, v, cache.clone(), meta, scale=0.25)

    monkeypatch.setattr(dispatch, "_forced", None)
    monkeypatch.setenv("LADLE_ATTENTION_BACKEND", "triton")
    assert dispatch.get_backend(q.device) == "triton"
    got = kernels.attention(q, k, v, cache.clone(), meta, scale=0.25)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    assert len(calls) == 1

    monkeypatch.delenv("LADLE_ATTENTION_BACKEND")
    kernels.set_backend("triton")
    got = kernels.attention(q, k, v, cache.clone(), meta, scale=0.25)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    assert len(calls) == 2

    kernels.set_backend("torch")
    kernels.attention(q, k, v, cache.clone(), meta, scale=0.25)
    assert len(calls) == 2


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernels run in this process")
def test_kernels_in_a_fresh_interpreter_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", str(Path(__file__))]
    proc = subprocess.run(cmd, check=False, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    # Everything ran there but this test itself.
    assert " passed, 1 skipped" in proc.stdout, proc.stdout[-2000:]


# --- Split-KV (segmented) decode path -----------------------------------------------------------

# A policy that splits small test batches: any decode context of >= 2 x 16 keys, up to 16 segments.
EAGER_SPLIT = triton_launch.SplitPolicy(target_programs=4096, max_segments=16, min_keys_per_segment=16)


def _plan_of(meta, q, num_kv):
    plans = [p for key, p in meta.cache.items() if key[0] == "triton_launch_plan"]
    assert len(plans) == 1
    return plans[0]


def _run_split_case(seqs, heads, head_dim, block_size, window, softcap, dtype, policy, monkeypatch, seed=0):
    num_heads, num_kv = heads
    q, k, v, cache, meta = build_batch(seqs, block_size, num_heads, num_kv, head_dim, dtype, seed=seed)
    scale = head_dim**-0.5
    want = reference_attention(q, k, v, cache.clone(), meta, scale=scale, sliding_window=window, softcap=softcap)
    if window is not None:  # the split kernel too must skip the key tiles before every window
        block_n = triton_launch.tile_config(head_dim, num_heads // num_kv, 1, dtype)[2]
        assert poison_skipped_tiles(cache, meta, window, block_n) > 0
    monkeypatch.setattr(triton_launch, "DEFAULT_POLICY", policy)
    got = triton_attention(q, k, v, cache, meta, scale=scale, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    return _plan_of(meta, q, num_kv)


# batch, (num_heads, num_kv), head_dim, block_size, window, softcap, dtype: decode-only and mixed
# batches (1-token sequences, contexts across 16/32-token blocks), block sizes 16 and 32, GQA 1/4/8.
SPLIT_CASES = [
    ("decode", (4, 4), 64, 16, None, None, torch.float32),
    ("decode", (8, 2), 128, 32, None, 30.0, torch.bfloat16),
    ("decode", (8, 1), 64, 16, 40, None, torch.float16),
    ("decode", (6, 2), 80, 32, None, None, torch.float32),
    ("mixed", (8, 2), 64, 16, None, None, torch.float32),
    ("mixed", (8, 1), 128, 32, 40, 30.0, torch.bfloat16),
    ("mixed", (4, 4), 32, 16, None, None, torch.float16),
]


@needs_kernels
@pytest.mark.parametrize("case", SPLIT_CASES, ids=_case_id)
def test_split_kv_matches_reference(case, monkeypatch):
    batch, heads, head_dim, block_size, window, softcap, dtype = case
    seqs = BATCHES[batch]
    plan = _run_split_case(seqs, heads, head_dim, block_size, window, softcap, dtype, EAGER_SPLIT, monkeypatch)
    decodes = sum(1 for _, n in seqs if n == 1)
    longest = max(c + n for c, n in seqs if n == 1)
    assert plan.split and plan.num_decodes == decodes and plan.num_segments == min(16, longest // 16)
    # A mixed batch still runs its chunks in the 2D kernel; a decode-only one does not launch it.
    assert (plan.grid is None) == (decodes == len(seqs))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_segment_edges(dtype, monkeypatch):
    """Contexts exactly at, one before and one after a segment edge; rows with fewer key tiles than
    segments (their trailing segments are empty, the reduce must ignore them), a 1-token sequence.
    A batch of only 1-token sequences has nothing to split (one key each): it runs in the 2D kernel."""
    block_n = triton_launch.tile_config(64, 2, 1, dtype)[2]
    policy = triton_launch.SplitPolicy(target_programs=4096, max_segments=4, min_keys_per_segment=1)
    edge = 4 * 2 * block_n  # 4 segments of 2 key tiles each
    seqs = [(edge - 1, 1), (edge - 2, 1), (edge, 1), (2 * block_n - 1, 1), (block_n, 1), (0, 1)]
    plan = _run_split_case(seqs, (4, 2), 64, 16, None, None, dtype, policy, monkeypatch)
    assert plan.num_segments == 4
    ones = [(0, 1)] * 5
    policy = triton_launch.SplitPolicy(target_programs=4096, max_segments=16, min_keys_per_segment=1)
    plan = _run_split_case(ones, (8, 2), 64, 32, None, None, dtype, policy, monkeypatch, seed=1)
    assert not plan.split and plan.grid is not None


def test_split_kv_heuristic_boundaries():
    policy = triton_launch.DEFAULT_POLICY
    segments = triton_launch.num_segments
    target, min_keys = policy.target_programs, policy.min_keys_per_segment
    assert segments(0, 8, 10_000, policy) == 1  # no decode rows
    assert segments(target // 8, 8, 10_000, policy) == 1  # decode programs already fill the GPU
    assert segments(target // 8 - 1, 8, 10_000, policy) == 2  # one program short: split in two
    assert segments(1, 1, 100_000, policy) == policy.max_segments  # capped
    assert segments(1, 1, 2 * min_keys - 1, policy) == 1  # too short for two segments of min_keys
    assert segments(1, 1, 2 * min_keys, policy) == 2
    assert segments(1, 8, 100_000, policy) == 16 and segments(3, 8, 100_000, policy) == 6
    with pytest.raises(ValueError, match="max_segments"):
        triton_launch.SplitPolicy(max_segments=32)


@needs_kernels
def test_split_kv_long_single_sequence_fp16(monkeypatch):
    """One 65k-token decode with one KV head: the default policy splits it 16 ways. In fp16 the
    partials and their merge stay in fp32, so the split result is as close to an fp32 computation
    as the unsplit kernel's is."""
    seqs = [(65_535, 1)]
    q, k, v, cache, meta = build_batch(seqs, 16, 8, 1, 64, torch.float16, seed=4)
    scale = 64**-0.5
    exact = reference_attention(*(t.float() for t in (q, k, v, cache.clone())), meta, scale=scale)
    want = reference_attention(q, k, v, cache.clone(), meta, scale=scale)
    got = triton_attention(q, k, v, cache.clone(), meta, scale=scale)
    plan = _plan_of(meta, q, 1)
    assert plan.split and plan.num_segments == 16 and plan.grid is None
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float16])
    # Equal scores: the softmax's sum of exponentials is 65,536, past fp16's largest value (65,504).
    flat = q.new_zeros(q.shape)
    torch.testing.assert_close(triton_attention(flat, k, v, cache.clone(), meta, scale=scale),
                               reference_attention(flat, k, v, cache.clone(), meta, scale=scale),
                               **TOLERANCE[torch.float16])
    meta.cache.clear()
    monkeypatch.setattr(triton_launch, "DEFAULT_POLICY", triton_launch.SplitPolicy(target_programs=1))
    unsplit = triton_attention(q, k, v, cache.clone(), meta, scale=scale)
    assert not _plan_of(meta, q, 1).split
    err_split = (got.float() - exact).abs().max().item()
    err_unsplit = (unsplit.float() - exact).abs().max().item()
    assert err_split <= 1.5 * err_unsplit + 1e-4, (err_split, err_unsplit)


def _tiny_model(family: str, num_layers: int):
    from ladle import models
    arch = {
        "qwen3": {"architectures": ["Qwen3ForCausalLM"]},
        "gemma3": {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 24, "sliding_window_pattern": 2},
    }[family]
    arch.update(hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=64, max_position_embeddings=4096)
    return models.load_model(None, arch, torch.float32, DEVICE, random_weights=True)


@needs_kernels
@pytest.mark.filterwarnings("ignore:model weights are RANDOM")
@pytest.mark.parametrize("family,num_layers", [("qwen3", 1), ("qwen3", 3), ("gemma3", 4)])
def test_launch_prepared_once_per_forward(family, num_layers, monkeypatch):
    """Every layer reuses the forward's launch plan (Gemma 3's sliding and full layers included)."""
    from ladle.engine.profiling import dummy_forward

    model = _tiny_model(family, num_layers)
    assert model.arch.num_layers == num_layers
    assert family != "gemma3" or len(set(model.arch.layer_types)) == 2  # sliding and full layers
    calls = []
    prepare = triton_launch.prepare_launch

    def counting(*args, **kwargs):
        calls.append(1)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(triton_launch, "prepare_launch", counting)
    monkeypatch.setattr(triton_launch, "DEFAULT_POLICY", EAGER_SPLIT)
    for query_lens, seq_lens in [([1, 1], [40, 7]), ([5, 1], [5, 60])]:  # decode-only, mixed: both split
        calls.clear()
        dummy_forward(model, query_lens, seq_lens, backend="triton")
        assert len(calls) == 1


def _record_launches(monkeypatch):
    """Wrap the attention kernels so that each launch records (kernel, its compile-time arguments)."""
    import ladle.kernels.triton_split_kv as split_mod

    launches = []

    class Recorder:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.name, tuple(sorted(kwargs.items()))))
                return self.kernel[grid](*args, **kwargs)

            return launch

    for mod, name in [(triton_attention_mod, "_paged_attention_kernel"), (split_mod, "_split_kv_decode_kernel"),
                      (split_mod, "_reduce_segments_kernel")]:
        monkeypatch.setattr(mod, name, Recorder(getattr(mod, name), name))
    return launches


@needs_kernels
@pytest.mark.filterwarnings("ignore:model weights are RANDOM")
def test_warm_up_launches_every_variant_a_run_uses(monkeypatch):
    """The warm-up (run on CUDA before the first step) launches every compile-time variant that the
    batches of a run with the same limits launch: decode-only, mixed, split-KV."""
    from ladle.engine.profiling import dummy_forward, warm_up_kernels

    model = _tiny_model("gemma3", 2)
    launches = _record_launches(monkeypatch)
    assert warm_up_kernels(model, max_model_len=600, max_num_seqs=8, max_num_batched_tokens=64, backend="triton") > 0
    warmed = set(launches)
    assert {name for name, _ in warmed} == {"_paged_attention_kernel", "_split_kv_decode_kernel",
                                            "_reduce_segments_kernel"}
    launches.clear()
    run_batches = [  # (query_lens, seq_lens) within max_model_len 600, 8 sequences, 64 tokens a step
        ([64], [64]), ([1] * 8, [600, 5, 40, 1, 300, 17, 2, 99]), ([30, 1, 1], [100, 550, 3]), ([1], [599]),
        ([7, 1], [7, 520]), ([1, 1], [16, 33]), ([20, 44], [20, 600]),
    ]
    for query_lens, seq_lens in run_batches:
        dummy_forward(model, query_lens, seq_lens, backend="triton")
        # As a step runs it: the last layer attends with the sampling rows only (decode-shaped rows).
        dummy_forward(model, query_lens, seq_lens, backend="triton", every_row=False)
    used = set(launches)
    assert any(name == "_split_kv_decode_kernel" for name, _ in used)
    assert used <= warmed, used - warmed


@needs_kernels
@pytest.mark.filterwarnings("ignore:model weights are RANDOM")
@pytest.mark.parametrize("block_size", [32, 600])  # cache.block_size=32; the contiguous backend (max_model_len)
def test_warm_up_uses_the_run_cache_block_size(block_size, monkeypatch):
    """The cache block size is a compile-time argument of every attention kernel: a warm-up with blocks
    of 16 tokens compiled nothing a run with other blocks launches (its first steps stalled on compiles).
    Its sequences share their blocks, so even the contiguous cache's one block of max_model_len per
    sequence costs one sequence's KV, not one per dummy sequence."""
    from ladle.engine.profiling import dummy_forward, warm_up_kernels

    model = _tiny_model("qwen3", 1)
    launches = _record_launches(monkeypatch)
    warm_up_kernels(model, max_model_len=600, max_num_seqs=8, max_num_batched_tokens=64, backend="triton",
                    block_size=block_size)
    warmed = set(launches)
    launches.clear()
    for query_lens, seq_lens in [([64], [64]), ([1] * 8, [600, 5, 40, 1, 300, 17, 2, 99]), ([7, 1], [7, 520])]:
        dummy_forward(model, query_lens, seq_lens, backend="triton", block_size=block_size)
    used = set(launches)
    assert any(dict(args).get("BLOCK_SIZE") == block_size for _, args in used)
    assert used <= warmed, used - warmed


@needs_kernels
@pytest.mark.parametrize("cache_backend,block_size", [("paged", 16), ("paged", 32), ("contiguous", 16)])
def test_engine_greedy_with_split_kv_equals_reference(tiny_hf_model_dir, cache_backend, block_size, monkeypatch):
    """Whole engine runs (chunked prefills beside decodes, then decode-only steps) with every decode
    row split, against the torch reference backend: identical greedy tokens."""
    from ladle.engine import SamplingParams
    from tests.engine.helpers import make_engine, random_prompt

    monkeypatch.setattr(triton_launch, "DEFAULT_POLICY", EAGER_SPLIT)
    splits = []
    prepare = triton_launch.prepare_launch

    def recording(*args, **kwargs):
        plan = prepare(*args, **kwargs)
        splits.append(plan.split)
        return plan

    monkeypatch.setattr(triton_launch, "prepare_launch", recording)
    prompts = [random_prompt(n, seed=n) for n in (1, 40, 70)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    path = tiny_hf_model_dir("qwen3")
    outputs = {}
    for attention in ("torch", "triton"):
        engine = make_engine(path, backend=cache_backend, block_size=block_size, attention_backend=attention,
                             size=32, device=DEVICE)
        outputs[attention] = [r.output_token_ids for r in engine.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]
    assert all(len(o) == 8 for o in outputs["triton"]) and any(splits)
