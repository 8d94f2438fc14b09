"""The KV cache's shape, decided once: bytes per token, tokens per block, bytes per block.

One spec is built from the cache config, the architecture and the dtype before anything is loaded;
the memory plan sizes the cache with it, the KV-cache manager lays out its tensors and counts blocks
with it, and the start-up forwards warm the kernels up for its block size. The contiguous backend is
the paged layout with one block of max_model_len tokens per sequence: decided here, nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ladle.engine.config import CacheConfig


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    bytes_per_token: int  # K and V of one token over every layer (ModelArch.kv_cache_bytes_per_token)
    block_tokens: int  # tokens per block: cache.block_size, or max_model_len when contiguous
    contiguous: bool  # one block per sequence: blocks are never shared (no prefix caching, forks copy)
    max_model_len: int

    @classmethod
    def build(cls, cache: CacheConfig, arch, dtype: torch.dtype) -> KVCacheSpec:
        """arch: a ladle.models.ModelArch (its shapes and the bytes-per-token formula)."""
        contiguous = cache.backend == "contiguous"
        return cls(
            num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim, dtype=dtype,
            bytes_per_token=arch.kv_cache_bytes_per_token(dtype),
            block_tokens=cache.max_model_len if contiguous else cache.block_size,
            contiguous=contiguous, max_model_len=cache.max_model_len,
        )

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one block over every layer."""
        return self.bytes_per_token * self.block_tokens

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of num_tokens tokens holds (contiguous: always its one block)."""
        return 1 if self.contiguous else math.ceil(num_tokens / self.block_tokens)

    def gap_bytes(self, num_blocks: int, device_type: str) -> int:
        """Bytes a pool of num_blocks takes beyond its blocks (every layer): on the CPU, the gap that keeps
        each layer's V plane off a large power of two from its K plane (cpu_plane_stride; under 2 MiB a
        layer); elsewhere none."""
        if device_type != "cpu":
            return 0
        plane = num_blocks * self.block_tokens * self.num_kv_heads * self.head_dim
        return self.num_layers * (cpu_plane_stride(plane, self.element_size) - plane) * self.element_size

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One layer's cache tensor, its logical shape: [2 (K, V), num_blocks, block_tokens, num_kv_heads,
        head_dim] (the memory layout is engine/kv_cache.layer_cache's: head-major blocks on the CPU)."""
        return (2, num_blocks, self.block_tokens, self.num_kv_heads, self.head_dim)


_MiB = 1 << 20
# Where the CPU cache's V plane starts, modulo 2 MiB (a huge page, whose offsets are the physical address's
# low bits): 1 MiB + 4 KiB, so a key's K and V rows differ in address bits 12 and 20 as well as above.
CPU_PLANE_PHASE = _MiB + 4096


def cpu_plane_stride(plane_elems: int, itemsize: int) -> int:
    """Elements from the CPU cache's K plane start to its V plane's (engine/kv_cache.layer_cache): the plane
    itself when under 2 MiB (no huge pages, nothing a large power of two apart), else the first offset at or
    past its end that is CPU_PLANE_PHASE modulo 2 MiB (a gap under 2 MiB)."""
    nbytes = plane_elems * itemsize
    if nbytes < 2 * _MiB:
        return plane_elems
    offset = -(-(nbytes - CPU_PLANE_PHASE) // (2 * _MiB)) * 2 * _MiB + CPU_PLANE_PHASE
    return offset // itemsize
