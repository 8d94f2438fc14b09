"""CPU paged attention: the C++ kernel (kernels/csrc/paged_attention.cpp) that reads the KV cache in place.

What it computes is the reference's attention (kernels/reference.py): causal by absolute position,
optional sliding window and logit soft-cap, GQA, decodes and prefill chunks in one flattened batch,
any block size (the contiguous cache is one block of max_model_len per sequence), any block layout (the
cache's block, token and head strides: token-major blocks, or head-major as engine/kv_cache.py allocates
on the CPU).

How (the tile rule)
-------------------
A sequence's keys are cut into tiles of `TILE` (32) consecutive absolute positions: tile t holds
positions [32 t, 32 t + 32), wherever its blocks are (a tile may span blocks, or lie inside one).
A work item is (sequence, KV heads, block of query positions); OpenMP threads take items from a shared
counter, and each item is computed by one thread alone. For each tile it reads, in place through the
block table, the keys its queries can see (prefetching the lines it reads next while it computes), then
for every query row (a position times a query head of the KV head's group):
- scores: one fused multiply-add per dimension in increasing d, from +0:
  s = fma(q[D-1], k[D-1], ... fma(q[0], k[0], +0)), a single chain per (row, key), no partial sums.
  Few rows per KV head (up to 8: decodes) go row-wise, lanes over 16 keys: each 16-key x 16-dimension
  block of the tile is transposed in registers and its dimensions go straight into the rows' chains (a
  query element broadcast per dimension). Many rows (prefill chunks) take the blocked path, lanes over
  16 query rows: the item's queries are transposed once, in blocks of 48 rows, and the score
  micro-kernel keeps 3 row vectors x 8 keys of chains in registers, every key element broadcast (so both
  query heads of a GQA pair, and all positions of the block, share each key load); for heads of more
  than 16 rows in a token-major cache the tile's keys and values are first copied into contiguous
  buffers (a head's rows are a whole row apart and blocks a multiple of 4 KiB apart: they would evict
  each other from L1 while every block reads them; a head-major cache, the engine's on the CPU, is read
  in place). Which path a row takes depends on its batch, never its bits:
  each lane runs the same chain either way;
- online softmax in fp32, base 2: the tile's visible scores (masked lanes are -inf, their
  probabilities exactly 0), a new running max, the rescale factor, the tile's sum of probabilities by a
  fixed lane tree, `l = l * alpha + tile_sum` (the blocked path: the same operations for 16 rows at once,
  one lane per row, the lane tree as a tree of vectors; tiles every row of a block sees whole skip the
  masks);
- values: `acc = acc * alpha`, then one fused multiply-add per visible key, in position order (rows
  that see different keys of a tile share the value loads: a masked fused multiply-add leaves a row's
  accumulator untouched for the keys it does not see);
and at the end `out = acc / l`.

Determinism
-----------
Which tiles a query reads, which keys of each tile it sees, and every operation above depend only on
its absolute position, the window and the tile size, never on the other rows of its block, the other
sequences, the chunk it came in or the thread that ran it. So a query at position p gets bitwise the
same output whether its prompt came whole, in chunks of any size, or as a decode; whatever the batch,
its size, the cache backend or block size; and whatever the number of threads. Not covered: another
instruction set (the library is built with -march=native: an AVX-512 machine and an AVX2 one round
differently), another TILE, or the torch reference backend (a different formula altogether).
"""

from __future__ import annotations

import ctypes
import math
import sys

import torch

from ladle.kernels.cpu_build import load_library
from ladle.kernels.cpu_structs import Args
from ladle.kernels.metadata import AttentionMetadata
from ladle.kernels.reference import write_kv_cache

# Query rows (positions x query heads of a KV head) per work item of a prefill chunk: each key tile is
# copied once per item, so more rows amortise it (192, four blocks of 48, measured ~4% faster than 96
# on vs_vllm.py's workload's chunks at 1 and 2 threads); the kernel halves it when a batch's chunks
# would give fewer than 4 items per thread.
ROWS_PER_ITEM = 192
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class _ForwardArgs:
    """The arguments that do not change between the layers of a forward, filled once per forward (in
    meta.cache): the metadata's pointers (it holds the int tensors they point into), plus per layer
    shape (heads, dtypes, window, scale, soft-cap) a template the call copies and completes."""

    __slots__ = ("base", "layers", "tensors")

    def __init__(self, meta: AttentionMetadata) -> None:
        qsl = meta.query_start_loc.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        self.tensors = (qsl, seq_lens, tables, slots)
        a = self.base = Args()
        a.query_start_loc, a.seq_lens = qsl.data_ptr(), seq_lens.data_ptr()
        a.block_tables, a.bt_stride = tables.data_ptr(), tables.shape[1]
        a.slot_mapping = slots.data_ptr()
        a.num_seqs, a.num_tokens, a.block_size = meta.num_seqs, meta.num_tokens, meta.block_size
        a.num_threads = torch.get_num_threads()
        self.layers: dict[tuple, Args] = {}

    def layer(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float, window: int | None,
              softcap: float | None) -> Args:
        key = (q.shape[1], q.shape[2], q.dtype, kv_cache.shape[-2], kv_cache.dtype, window, scale, softcap)
        t = self.layers.get(key)
        if t is None:
            t = self.layers[key] = Args.from_buffer_copy(self.base)
            num_heads, num_kv = q.shape[1], kv_cache.shape[-2]
            t.num_heads, t.num_kv_heads, t.head_dim = num_heads, num_kv, q.shape[2]
            t.q_dtype, t.kv_dtype = _DTYPES[q.dtype], _DTYPES[kv_cache.dtype]
            t.window, t.scale, t.softcap = window or 0, scale, softcap or 0.0
            t.positions_per_item = max(1, ROWS_PER_ITEM // (num_heads // num_kv))
        return Args.from_buffer_copy(t)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, its memory asked (madvise, before the first touch) to be
    backed by 2 MiB pages where the OS allows it (Linux transparent huge pages, mode madvise or always).

    Why: the kernel's decodes read blocks scattered over the cache, and with 4 KiB pages each 16-token
    block costs page walks (software prefetches included). Measured at 1 thread: a 128-sequence decode
    at context 512 (16 / 8 heads x 64) 1.14x faster with its cache from here than from torch.zeros; the
    vs_vllm.py's workload's decode forwards 1.08x with every allocation on huge pages (THP_MEM_ALLOC_ENABLE=1).
    Same bytes, same layout, same bits.

    The memory is an anonymous mapping of its own, starting on a 2 MiB boundary, that the tensor's
    storage holds (torch.frombuffer) and that is unmapped when the storage dies. Not malloc's memory: glibc
    serves blocks under its (dynamic, up to 32 MiB) mmap threshold from its heap, where the advice stayed on
    the heap's pages after the tensor died and the freed cache stayed resident (4 caches of 3-24 MiB: all
    of it, after del). Under 2 MiB, or where madvise is missing, plain torch.zeros.
    """
    import mmap

    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < _HUGE_PAGE or advice is None or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    # Private (the default, MAP_SHARED, is shmem: no THP there, and shared with forked children).
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # anonymous, zero-filled, untouched
    base = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % _HUGE_PAGE
    try:  # a hint: refused (no THP), the tensor is as good, on small pages
        region.madvise(advice, offset, (nbytes - 1) // mmap.PAGESIZE * mmap.PAGESIZE + mmap.PAGESIZE)
    except OSError:
        pass
    t = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
    # Zero-filled already; writing faults every page in now (onto huge pages), as torch.zeros would.
    return t.view(dtype).view(shape).zero_()


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel takes (the dispatcher uses the torch reference otherwise)."""
    return (
        q.device.type == "cpu" and kv_cache.device.type == "cpu"
        and q.dtype in _DTYPES and kv_cache.dtype in _DTYPES
        and kv_cache.stride(-1) == 1 and q.shape[-1] <= 1024
        and q.shape[1] % kv_cache.shape[-2] == 0
    )


def call_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> Args:
    """The kernel's arguments for one layer's call: q [T, H, D] (unit last stride) into out [T, H, D]
    float32, over kv_cache; k_new / v_new set where k and v go into the cache as they are (else None:
    the caller writes them, converted). kernels/cpu_layers passes the same struct for a stack of layers."""
    forward = meta.cache.get("cpu_paged")
    if forward is None:
        forward = meta.cache["cpu_paged"] = _ForwardArgs(meta)
    a = forward.layer(q, kv_cache, scale, sliding_window, softcap)
    a.q, a.q_stride_t, a.q_stride_h = q.data_ptr(), q.stride(0), q.stride(1)
    a.out = out.data_ptr()
    a.k_cache = base = kv_cache.data_ptr()
    a.v_cache = base + kv_cache.stride(0) * kv_cache.element_size()
    # Any block layout (engine/kv_cache.py: head-major on the CPU); the kernel takes the strides.
    _, a.kv_stride_block, a.kv_stride_token, a.kv_stride_head, _ = kv_cache.stride()
    if k.dtype == kv_cache.dtype and v.dtype == kv_cache.dtype and k.stride(-1) == 1 and v.stride(-1) == 1:
        a.k_new, a.k_stride_t, a.k_stride_h = k.data_ptr(), k.stride(0), k.stride(1)
        a.v_new, a.v_stride_t, a.v_stride_h = v.data_ptr(), v.stride(0), v.stride(1)
    return a


def cpu_paged_attention(
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
    lib = load_library()
    if lib is None:
        raise RuntimeError("the CPU paged attention kernel is not available (see ladle.kernels.cpu_build.build_error())")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    a = call_args(q, k, v, kv_cache, meta, out, scale=scale, sliding_window=sliding_window, softcap=softcap)
    if a.k_new is None:  # a dtype conversion on the way into the cache: torch's rounding, as the reference does
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    code = lib.ladle_paged_attention(ctypes.addressof(a))
    if code != 0:
        raise RuntimeError(f"ladle_paged_attention rejected its arguments (code {code})")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
