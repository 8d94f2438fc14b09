"""Attention kernels: the op every model layer calls, dispatched to Triton on CUDA, the C++ paged kernel on
CPU (kernels/cpu_paged.py), or the torch reference (the oracle, and the fallback without a compiler)."""

from ladle.kernels.dispatch import attention, get_backend, set_backend
from ladle.kernels.metadata import AttentionMetadata
from ladle.kernels.reference import reference_attention, write_kv_cache

__all__ = [
    "AttentionMetadata",
    "attention",
    "get_backend",
    "reference_attention",
    "set_backend",
    "write_kv_cache",
]
