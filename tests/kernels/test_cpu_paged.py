"""The C++ CPU paged attention (kernels/cpu_paged.py) against the torch reference, and its contract:
a query's output is bitwise the same whatever chunk it came in, whatever shares its batch, whatever the
cache layout, block size or number of threads."""

from __future__ import annotations

import math
import platform
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ladle import kernels
from ladle.kernels import AttentionMetadata, cpu_build, reference_attention
from ladle.kernels.cpu_paged import cpu_paged_attention, zeros_on_huge_pages
from tests.kernels.cpu_schedules import CacheLayout, alone, chunks, interleave, random_inputs, run_schedule

if cpu_build._compiler() is None:
    pytest.skip("no C++ compiler: the CPU kernel cannot be built here", allow_module_level=True)
# With a compiler the kernel must build: a failure here is a bug, not a reason to skip.
assert cpu_build.load_library() is not None, cpu_build.build_error()

# The thread-count fixture only restores the count at the end: fine across examples.
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
HEADS = [(4, 4), (8, 2), (6, 1), (4, 1)]


@pytest.fixture
def threads():
    """Restore torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# -- against the reference ---------------------------------------------------------------------------
@st.composite
def batches(draw):
    seqs = draw(st.lists(st.tuples(st.integers(0, 150), st.integers(1, 70)), min_size=1, max_size=6))
    # Plenty of decodes, as in a real batch.
    seqs += draw(st.lists(st.tuples(st.integers(0, 300), st.just(1)), max_size=6))
    heads, kv = draw(st.sampled_from(HEADS))
    return {
        "seqs": seqs, "heads": heads, "kv": kv,
        "head_dim": draw(st.sampled_from([8, 16, 24, 64, 80, 128])),
        "block": draw(st.sampled_from([1, 4, 16, 64, 0])),  # 0: contiguous (one block per sequence)
        "window": draw(st.one_of(st.none(), st.integers(1, 100))),
        "softcap": draw(st.one_of(st.none(), st.floats(1.0, 50.0))),
        "seed": draw(st.integers(0, 2**16)),
    }


def make_batch(seqs, heads, kv, head_dim, block, seed, dtype=torch.float32):
    """Cache with each sequence's context written, the new tokens' q/k/v, the metadata."""
    gen = torch.Generator().manual_seed(seed)
    if block == 0:
        block = max(c + q for c, q in seqs) + 3
    need = [math.ceil((c + q) / block) for c, q in seqs]
    perm = torch.randperm(sum(need) + 2, generator=gen).tolist()
    cache = torch.randn(2, len(perm), block, kv, head_dim, generator=gen)  # garbage where unwritten
    tables, qs, ks, vs = [], [], [], []
    for (c, q), n in zip(seqs, need):
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        qs.append(torch.randn(q, heads, head_dim, generator=gen))
        ks.append(torch.randn(q, kv, head_dim, generator=gen))
        vs.append(torch.randn(q, kv, head_dim, generator=gen))
    meta = AttentionMetadata.build([q for _, q in seqs], [c + q for c, q in seqs], tables, block)
    cast = lambda t: t.to(dtype)
    return cast(torch.cat(qs)), cast(torch.cat(ks)), cast(torch.cat(vs)), cast(cache), meta


@SETTINGS
@given(batches())
def test_matches_reference(case):
    q, k, v, cache, meta = make_batch(case["seqs"], case["heads"], case["kv"], case["head_dim"], case["block"],
                                      case["seed"])
    ref_cache, our_cache = cache.clone(), cache.clone()
    scale = case["head_dim"] ** -0.5
    kw = {"scale": scale, "sliding_window": case["window"], "softcap": case["softcap"]}
    want = reference_attention(q, k, v, ref_cache, meta, **kw)
    got = cpu_paged_attention(q, k, v, our_cache, meta, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(our_cache, ref_cache)  # the new keys/values landed in the same slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_half_precision_cache(dtype, softcap):
    """bf16/fp16 q and cache, fp32 accumulation: the reference on the same (rounded) values in fp32."""
    seqs = [(0, 40), (100, 1), (37, 9), (300, 1)]
    q, k, v, cache, meta = make_batch(seqs, 8, 2, 64, 16, seed=3, dtype=dtype)
    ours = cache.clone()
    got = cpu_paged_attention(q, k, v, ours, meta, scale=0.125, softcap=softcap)
    want = reference_attention(q.float(), k.float(), v.float(), cache.float(), meta, scale=0.125, softcap=softcap)
    assert got.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # the output's own rounding
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    kernels.write_kv_cache(k, v, cache, meta.slot_mapping)
    assert torch.equal(ours, cache)


def test_mixed_dtypes_write_through_torch():
    """fp32 k/v into a bf16 cache (a conversion on the way in) and strided q/k/v views, as the models
    pass them (split from one QKV projection)."""
    seqs = [(5, 7), (20, 1)]
    heads, kv, d = 4, 2, 32
    q, k, v, cache, meta = make_batch(seqs, heads, kv, d, 16, seed=5)
    qkv = torch.cat([q.reshape(len(q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1)], dim=1)
    qv, kv_, vv = qkv.split([heads * d, kv * d, kv * d], dim=1)
    qv, kv_, vv = qv.view(-1, heads, d), kv_.view(-1, kv, d), vv.view(-1, kv, d)
    assert not qv.is_contiguous()
    got = cpu_paged_attention(qv, kv_, vv, cache.clone(), meta, scale=0.2)
    torch.testing.assert_close(got, reference_attention(q, k, v, cache.clone(), meta, scale=0.2), atol=2e-5, rtol=2e-5)
    half = cache.to(torch.bfloat16)
    ref_half = half.clone()
    cpu_paged_attention(q, k, v, half, meta, scale=0.2)
    kernels.write_kv_cache(k, v, ref_half, meta.slot_mapping)
    assert torch.equal(half, ref_half)


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values, each block's memory [heads, block, dim] (the CPU engine's, engine/kv_cache.py)."""
    two, num_blocks, block, heads, dim = cache.shape
    out = torch.empty((two, num_blocks, heads, block, dim), dtype=cache.dtype).transpose(2, 3)
    out.copy_(cache)
    assert out.stride(3) == block * dim and out.stride(2) == dim
    return out


@SETTINGS
@given(batches(), st.sampled_from([torch.float32, torch.bfloat16]), st.booleans())
def test_head_major_cache_bitwise(case, dtype, split_kv):
    """A head-major cache gives bitwise the outputs and cache contents of a token-major one, through
    the kernel and through the torch reference; with k/v split from one projection (one copy per head
    into the cache) or whole."""
    q, k, v, cache, meta = make_batch(case["seqs"], case["heads"], case["kv"], case["head_dim"], case["block"],
                                      case["seed"], dtype)
    if split_kv:
        kv = torch.cat([k, v], dim=-1)
        k, v = kv[..., : k.shape[-1]], kv[..., k.shape[-1] :]
    kw = {"scale": case["head_dim"] ** -0.5, "sliding_window": case["window"], "softcap": case["softcap"]}
    for attention in (cpu_paged_attention, reference_attention):
        token_major, head_major = cache.clone(), _head_major(cache)
        want = attention(q, k, v, token_major, meta, **kw)
        got = attention(q, k, v, head_major, meta, **kw)
        assert torch.equal(got, want), attention.__name__
        assert torch.equal(head_major, token_major), attention.__name__


def test_head_major_cache_mixed_dtypes():
    """fp32 k/v into a bf16 head-major cache: torch's rounding on the way in, into the right slots."""
    q, k, v, cache, meta = make_batch([(5, 7), (20, 1), (0, 33)], 4, 2, 32, 16, seed=6)
    half = cache.to(torch.bfloat16)
    want = cpu_paged_attention(q, k, v, half.clone(), meta, scale=0.2)
    head_major = _head_major(half)
    got = cpu_paged_attention(q, k, v, head_major, meta, scale=0.2)
    assert torch.equal(got, want)
    kernels.write_kv_cache(k, v, half, meta.slot_mapping)
    assert torch.equal(head_major, half)


# -- bitwise invariance ----------------------------------------------------------------------------
@st.composite
def workloads(draw):
    n = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 140), min_size=n, max_size=n))
    heads, kv = draw(st.sampled_from(HEADS))
    return {
        "lengths": lengths, "heads": heads, "kv": kv,
        "head_dim": draw(st.sampled_from([16, 40, 64])),
        "window": draw(st.one_of(st.none(), st.integers(1, 70))),
        "softcap": draw(st.one_of(st.none(), st.floats(2.0, 50.0))),
        # How each sequence is cut: a prompt part in chunks of these sizes, then decodes.
        "prompt_frac": draw(st.floats(0.0, 1.0)),
        "chunk_sizes": draw(st.lists(st.integers(1, 64), min_size=1, max_size=4)),
        "mix_seed": draw(st.integers(0, 2**16)),
        "max_batch": draw(st.integers(1, 4)),
        "block": draw(st.sampled_from([1, 4, 16, 32, 0])),  # 0: contiguous
        "threads": draw(st.sampled_from([1, 2])),
        "head_major": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _plans(case) -> dict[int, list[int]]:
    plans = {}
    for sid, n in enumerate(case["lengths"]):
        prompt = max(1, int(n * case["prompt_frac"]))
        plans[sid] = chunks(prompt, case["chunk_sizes"]) + [1] * (n - prompt)
    return plans


@SETTINGS
@given(case=workloads())
def test_bitwise_invariant_to_schedule(threads, case):
    """Every sequence's outputs, computed in chunks and decodes mixed with other sequences (random
    batches, blocks, block size or contiguous cache, token- or head-major blocks, 1 or 2 threads), are
    bitwise equal to computing each sequence alone in one forward, paged with block 16, on one thread."""
    seqs = random_inputs(case["lengths"], case["heads"], case["kv"], case["head_dim"], case["seed"])
    kw = {"window": case["window"], "softcap": case["softcap"], "scale": case["head_dim"] ** -0.5}
    torch.set_num_threads(1)
    baseline = [
        run_schedule([s], alone(0, [len(s.q)]), cpu_paged_attention, CacheLayout(block_size=16), **kw)[0]
        for s in seqs
    ]
    torch.set_num_threads(case["threads"])
    layout = CacheLayout(block_size=case["block"] or 16, contiguous=case["block"] == 0, max_len=160,
                         seed=case["seed"], head_major=case["head_major"])
    schedule = interleave(_plans(case), case["mix_seed"], case["max_batch"])
    outs = run_schedule(seqs, schedule, cpu_paged_attention, layout, **kw)
    for sid, (got, want) in enumerate(zip(outs, baseline)):
        assert not got.isnan().any() and not want.isnan().any()
        assert torch.equal(got, want), f"sequence {sid}: max diff {(got - want).abs().max().item()}"


@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (None, 30.0), (9, 5.0)])
@pytest.mark.parametrize("contiguous", [False, True])
def test_bitwise_chunk_decode_batch(window, softcap, contiguous, threads):
    """One 200-token sequence with GQA (8 query heads on 2 KV heads), head dim 64: whole prompt, chunks
    of 7 and 128, a prompt then decode by decode, and the same inside batches of other sequences at 1
    and 2 threads: all bitwise equal (and a recompute after decoding is the whole-prompt result)."""
    lengths = [200, 77, 150, 5, 180]
    seqs = random_inputs(lengths, 8, 2, 64, seed=11)
    kw = {"window": window, "softcap": softcap, "scale": 0.125}
    layout = CacheLayout(block_size=16, contiguous=contiguous, max_len=224)
    torch.set_num_threads(1)
    whole = run_schedule(seqs[:1], alone(0, [200]), cpu_paged_attention, layout, **kw)[0]
    variants = {f"chunks of {size}": alone(0, chunks(200, [size])) for size in (7, 128)}
    variants["prompt 130 then decodes"] = alone(0, [130] + [1] * 70)
    others = {sid: chunks(n, [13, 1, 64]) for sid, n in enumerate(lengths) if sid}
    mixed = {0: chunks(200, [100, 1, 33]), **others}
    for threads_now in (1, 2):
        torch.set_num_threads(threads_now)
        for name, schedule in variants.items():
            got = run_schedule(seqs[:1], schedule, cpu_paged_attention, layout, **kw)[0]
            assert torch.equal(got, whole), f"{name}, {threads_now} threads"
        got = run_schedule(seqs, interleave(mixed, seed=threads_now, max_batch=5), cpu_paged_attention, layout, **kw)
        assert torch.equal(got[0], whole), f"mixed batch, {threads_now} threads"
    # Recompute after a preemption: the same positions again from scratch in one forward.
    again = run_schedule(seqs[:1], alone(0, [200]), cpu_paged_attention, CacheLayout(block_size=16, seed=5), **kw)
    assert torch.equal(again[0], whole)


@pytest.mark.parametrize("head_major", [False, True])
def test_large_decode_batch_threads(threads, head_major):
    """A decode batch large enough that work items take all KV heads of a sequence (each block read
    row by row, or head by head when head-major): outputs equal to each sequence decoded alone
    (token-major), at 1 and 2 threads."""
    lengths = [int(n) for n in torch.randint(1, 200, (40,), generator=torch.Generator().manual_seed(2))]
    seqs = random_inputs(lengths, 8, 2, 32, seed=4)
    pieces = {sid: chunks(n - 1, [64]) if n > 1 else [] for sid, n in enumerate(lengths)}
    forwards = [[(sid, p[i]) for sid, p in pieces.items() if i < len(p)] for i in range(4)]
    forwards = [f for f in forwards if f] + [[(sid, 1) for sid in range(len(lengths))]]
    results = []
    for t in (1, 2):
        torch.set_num_threads(t)
        results.append(run_schedule(seqs, forwards, cpu_paged_attention, CacheLayout(seed=t, head_major=head_major)))
    torch.set_num_threads(1)
    for sid, s in enumerate(seqs):
        want = run_schedule([s], alone(0, [len(s.q)]), cpu_paged_attention, CacheLayout())[0]
        assert torch.equal(results[0][sid], want) and torch.equal(results[1][sid], want)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or "fma" not in " ".join(cpu_build._cpu_flags().split()),
                    reason="x86 instruction-set variants, with FMA")
def test_instruction_sets_agree_bitwise(tmp_path, monkeypatch):
    """The AVX2 build and the portable (scalar-loop) build run the same operations as the AVX-512 one,
    lane for lane and tree for tree: with FMA, the same bits; on token-major and on head-major caches
    (the engine's: the blocked path reads the 70-token chunk's fp32 rows in place)."""
    cases = [
        ([(0, 70), (30, 1), (200, 1), (45, 33)], 8, 2, 64, None, None, torch.float32),
        ([(0, 100), (300, 1), (17, 9)], 4, 1, 40, 24, 20.0, torch.float32),  # head dim with a tail
        ([(10, 50), (90, 1)], 8, 8, 128, None, None, torch.bfloat16),
    ]

    def outputs(head_major: bool = False):
        outs = []
        for seqs, heads, kv, d, window, softcap, dtype in cases:
            q, k, v, cache, meta = make_batch(seqs, heads, kv, d, 16, seed=d, dtype=dtype)
            if head_major:
                cache = _head_major(cache)
            outs.append(cpu_paged_attention(q, k, v, cache, meta, scale=d**-0.5, sliding_window=window, softcap=softcap))
        return outs

    native = outputs()
    for name, flags in {"avx2": ["-march=native", "-fopenmp", "-mno-avx512f"],
                        "generic": ["-march=native", "-fopenmp", "-mno-avx512f", "-mno-avx2"]}.items():
        lib, _ = cpu_build.build_library(flags, tmp_path)
        assert lib.ladle_attention_isa().decode() == name
        monkeypatch.setattr("ladle.kernels.cpu_paged.load_library", lambda lib=lib: lib)
        for head_major in (False, True):
            for want, got in zip(native, outputs(head_major)):
                assert torch.equal(got, want), f"{name}, head-major {head_major}"


# -- dispatch ------------------------------------------------------------------------------------------
def test_dispatch_default_and_fallback(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("LADLE_ATTENTION_BACKEND", raising=False)
    assert kernels.get_backend(cpu) == "cpu_paged"
    assert kernels.get_backend(cpu, "torch") == "torch"
    monkeypatch.setenv("LADLE_ATTENTION_BACKEND", "torch")
    assert kernels.get_backend(cpu) == "torch"
    monkeypatch.setenv("LADLE_ATTENTION_BACKEND", "cpu_paged")
    assert kernels.get_backend(cpu) == "cpu_paged"
    with pytest.raises(ValueError):
        kernels.set_backend("cpu-paged")
    # Without a library (no compiler): "auto" is the torch reference, and the op still works.
    monkeypatch.delenv("LADLE_ATTENTION_BACKEND")
    monkeypatch.setattr("ladle.kernels.dispatch.load_library", lambda: None)
    assert kernels.get_backend(cpu) == "torch"
    q, k, v, cache, meta = make_batch([(3, 4)], 4, 2, 16, 16, seed=0)
    out = kernels.attention(q, k, v, cache.clone(), meta, scale=0.25)
    torch.testing.assert_close(out, reference_attention(q, k, v, cache.clone(), meta, scale=0.25))


def test_dispatch_runs_the_kernel(monkeypatch):
    """backend=cpu_paged in the metadata goes to the kernel: bitwise its output."""
    q, k, v, cache, meta = make_batch([(30, 1), (0, 20)], 4, 2, 16, 16, seed=1)
    meta.backend = "cpu_paged"
    got = kernels.attention(q, k, v, cache.clone(), meta, scale=0.25, softcap=10.0)
    meta2 = AttentionMetadata.build([1, 20], [31, 20], meta.block_tables, 16)
    assert torch.equal(got, cpu_paged_attention(q, k, v, cache.clone(), meta2, scale=0.25, softcap=10.0))


def test_no_compiler_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "_state", {})
    monkeypatch.setattr(cpu_build, "_no_compiler_warned", threading.Event())
    monkeypatch.setattr(cpu_build, "_compiler", lambda: None)
    with caplog.at_level("WARNING", logger="ladle.kernels"):
        assert cpu_build.load_library() is None
        assert cpu_build.load_library() is None
    assert "no C++ compiler" in cpu_build.build_error()
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "using the torch reference attention" in caplog.records[0].message
    assert kernels.get_backend(torch.device("cpu")) == "torch"


def test_unwritable_cache_builds_elsewhere(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("LADLE_KERNEL_CACHE", str(blocker / "cache"))  # cannot be created
    lib, path = cpu_build.build_library(["-DLADLE_TEST_VARIANT"])
    assert path.exists() and not str(path).startswith(str(blocker))
    assert lib.ladle_attention_tile() == cpu_build.TILE


def test_build_is_cached_and_described():
    info = cpu_build.build_info()
    assert info["tile"] == cpu_build.TILE and info["isa"] in ("avx512", "generic")
    assert str(cpu_build.cache_dir()) in info["path"]


def _thp_eligible(ptr: int) -> bool | None:
    """THPeligible of the mapping holding address ptr (/proc/self/smaps), None where unknown."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return None


def test_zeros_on_huge_pages():
    t = zeros_on_huge_pages((2, 300, 16, 2, 64), torch.float32)
    assert t.shape == (2, 300, 16, 2, 64) and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    small = zeros_on_huge_pages((3, 5), torch.bfloat16)  # under one huge page: no hint, still zeros
    assert small.shape == (3, 5) and small.dtype == torch.bfloat16 and not small.any()
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if platform.system() != "Linux" or not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("no transparent huge pages here")
    # The hint took: the mapping may be backed by huge pages (with THP in madvise mode, only so).
    huge = 2 << 20
    eligible = _thp_eligible((t.data_ptr() + huge - 1) // huge * huge)  # the first whole huge page
    if eligible is None:
        pytest.skip("this kernel's smaps does not say THPeligible")
    assert eligible
