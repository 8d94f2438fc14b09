"""Attention kernels: the op every model layer calls, dispatched to Triton on CUDA or torch on CPU."""

from kernels.dispatch import attention, get_backend, set_backend
from kernels.metadata import AttentionMetadata
from kernels.reference import reference_attention, write_kv_cache

__all__ = [
    "AttentionMetadata",
    "attention",
    "get_backend",
    "reference_attention",
    "set_backend",
    "write_kv_cache",
]
