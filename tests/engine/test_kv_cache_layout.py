"""The CPU KV cache's memory is head-major inside a block behind the logical shape everything indexes
(engine/kv_cache.layer_cache), and the manager's own copies (a fork's partial block) follow it."""

from __future__ import annotations

import pytest
import torch

from ladle.engine import SamplingParams
from ladle.engine.kv_cache import KVCacheManager, layer_cache
from ladle.engine.kv_spec import KVCacheSpec, cpu_plane_stride
from ladle.engine.request import Request, RequestMetrics
from ladle.kernels import AttentionMetadata, cpu_paged, reference_attention
from tests.engine.helpers import make_engine, random_prompt


def _spec() -> KVCacheSpec:
    return KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=8, dtype=torch.float32, bytes_per_token=2 * 2 * 4 * 8 * 4,
                       block_tokens=16, contiguous=False, max_model_len=64)


def test_cpu_cache_is_head_major_behind_the_logical_shape():
    cache = layer_cache((2, 5, 16, 4, 8), torch.float32, torch.device("cpu"))
    assert cache.shape == (2, 5, 16, 4, 8)
    # One head's rows of a block are contiguous: token stride head_dim, head stride a block's rows.
    assert cache.stride() == (5 * 4 * 16 * 8, 4 * 16 * 8, 8, 16 * 8, 1)
    assert not cache.is_contiguous() and bool((cache == 0).all())
    assert cpu_paged.supports(torch.zeros(1, 8, 8), cache)  # the kernel takes it as it is


MiB = 1 << 20


@pytest.mark.parametrize("itemsize", [4, 2])
@pytest.mark.parametrize("plane_bytes", [2 * MiB, 2 * MiB + 4096, 3 * MiB, 512 * MiB, 512 * MiB - 32768,
                                         (1 << 30) + MiB + 4096, (1 << 30) + MiB + 8192, 5 * MiB - 1024])
def test_plane_stride_keeps_k_and_v_off_large_powers_of_two(plane_bytes, itemsize):
    """From 2 MiB on, the V plane starts past the K plane's end, at 1 MiB + 4 KiB modulo 2 MiB, less than
    2 MiB later: never a large power of two away (256 and 512 MiB planes, default pools, were)."""
    elems = plane_bytes // itemsize
    offset = cpu_plane_stride(elems, itemsize) * itemsize
    assert elems * itemsize <= offset < elems * itemsize + 2 * MiB
    assert offset % (2 * MiB) == MiB + 4096


@pytest.mark.parametrize("elems", [1, 1000, MiB // 4 - 1])
def test_plane_stride_leaves_small_planes_packed(elems):
    assert cpu_plane_stride(elems, 4) == elems  # under 2 MiB: no huge pages, nothing large apart


@pytest.mark.parametrize(("head_dim", "dtype"), [(64, torch.float32), (96, torch.bfloat16), (80, torch.float32)])
def test_large_cpu_cache_gap_between_planes_is_invisible(head_dim, dtype):
    """A cache whose planes take the gap (3-10 MiB planes) is written and read through the logical shape
    like a plain tensor: the kernel and the torch reference (bf16 caches' path) give bitwise what a
    token-major copy gives, also where the plane stride is not a multiple of head_dim (80, 96)."""
    shape = (2, 256, 16, 8, head_dim)
    cache = layer_cache(shape, dtype, torch.device("cpu"))
    assert cache.stride(0) == cpu_plane_stride(256 * 8 * 16 * head_dim, dtype.itemsize) > 256 * 8 * 16 * head_dim
    assert bool((cache == 0).all())
    gen = torch.Generator().manual_seed(1)
    cache.copy_(torch.randn(shape, generator=gen))
    tables = [list(range(40)), list(range(100, 103)), list(range(200, 256))]  # 255: the last block of the pool
    seq_lens, query_lens = [630, 40, 890], [1, 7, 1]
    t = sum(query_lens)
    q = torch.randn(t, 16, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(t, 8, head_dim, generator=gen).to(dtype) for _ in range(2))
    for attention in (cpu_paged.cpu_paged_attention, reference_attention):
        gapped = layer_cache(shape, dtype, torch.device("cpu")).copy_(cache)
        plain = cache.contiguous()
        want = attention(q, k, v, plain, AttentionMetadata.build(query_lens, seq_lens, tables, 16), scale=0.125)
        got = attention(q, k, v, gapped, AttentionMetadata.build(query_lens, seq_lens, tables, 16), scale=0.125)
        assert torch.equal(got, want), attention.__name__
        assert torch.equal(gapped, plain), attention.__name__  # the new rows landed in the same logical slots


def test_manager_counts_the_gap_it_allocates():
    """kv.bytes is the memory the layers' caches hold, their gaps included."""
    spec = KVCacheSpec(num_layers=3, num_kv_heads=4, head_dim=96, dtype=torch.float32,
                       bytes_per_token=2 * 3 * 4 * 96 * 4, block_tokens=16, contiguous=False, max_model_len=4096)
    kv = KVCacheManager(spec, 700, device=torch.device("cpu"), prefix_caching=False)  # 4.1 MiB planes
    held = sum(c.untyped_storage().nbytes() for c in kv.kv_caches)
    assert kv.bytes == held > spec.page_bytes * 700
    assert spec.gap_bytes(700, "cuda") == 0 and spec.gap_bytes(10, "cpu") == 0  # no gap on CUDA, nor under 2 MiB


def _request(rid: str, tokens: int) -> Request:
    return Request(rid, list(range(tokens)), SamplingParams(), RequestMetrics(arrival_time=0.0))


def test_fork_copies_the_partial_block_in_head_major_memory():
    kv = KVCacheManager(_spec(), 8, device=torch.device("cpu"), prefix_caching=False)
    src = _request("a", 21)
    assert kv.ensure_capacity(src, 21)
    src.num_computed_tokens = 21  # one full block, 5 rows of the second
    gen = torch.Generator().manual_seed(0)
    for cache in kv.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    before = [c.clone() for c in kv.kv_caches]
    dst = _request("b", 21)
    assert kv.fork_blocks(src, dst)
    assert dst.block_ids[0] == src.block_ids[0] and dst.block_ids[1] != src.block_ids[1]
    s, d = src.block_ids[1], dst.block_ids[1]
    for cache, old in zip(kv.kv_caches, before):
        assert torch.equal(cache[:, d, :5], old[:, s, :5])  # the computed rows, every head
        assert torch.equal(cache[:, d, 5:], old[:, d, 5:])  # the rest of the block untouched
        others = [b for b in range(8) if b != d]
        assert torch.equal(cache[:, others], old[:, others])


def _token_major(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_engine_outputs_bitwise_in_either_layout(tiny_hf_model_dir, monkeypatch, backend):
    """The engine's tokens and logprobs are bitwise the same on head-major and token-major caches: chunked
    prefills (the last layer's write of every row), a prefix-cache hit (paged), n = 3 samples forking a
    partial block, decodes; a sliding-window model."""
    path = tiny_hf_model_dir("gemma3")  # sliding window 16: chunks and decodes cross it
    base = random_prompt(40, seed=5)
    later = [base[:36] + random_prompt(9, seed=6), random_prompt(23, seed=7)]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, n=3, logprobs=2)
    every_row = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)  # its last layer keeps all rows

    def run() -> tuple[bool, int, list[tuple]]:
        eng = make_engine(path, backend=backend, block_size=8, size=13, prefix_caching=backend == "paged",
                              device="cpu")  # head-major blocks are the CPU layout
        outs = eng.generate([base], params) + eng.generate([base], every_row)
        outs += eng.generate(later, params)  # the first of these hits base's blocks (paged)
        rows = [(o.request_id, o.sample_index, o.output_token_ids, o.logprobs, o.prompt_logprobs) for o in outs]
        hits = sum(o.metrics.num_cached_tokens for o in outs)
        return eng.kv.kv_caches[0].is_contiguous(), hits, rows

    contiguous, hits, head_major = run()
    monkeypatch.setattr("ladle.engine.kv_cache.layer_cache", _token_major)
    contiguous_tm, hits_tm, token_major = run()
    assert not contiguous and contiguous_tm  # the two layouts ran
    assert hits == hits_tm and (hits > 0) == (backend == "paged")
    assert len(head_major) == 10
    assert head_major == token_major
