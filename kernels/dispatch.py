"""Choose the attention implementation: Triton on CUDA, the torch reference on CPU.

`LADLE_ATTENTION_BACKEND` (auto | triton | torch) or `set_backend()` forces one, for tests and
benchmarks. The Triton path is imported lazily so CPU-only installs never need it.
"""

from __future__ import annotations

import os

import torch

from kernels.metadata import AttentionMetadata
from kernels.reference import reference_attention

_BACKENDS = ("auto", "triton", "torch")
_forced: str | None = None


def set_backend(name: str) -> None:
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {_BACKENDS}")
    global _forced
    _forced = name


def get_backend(device: torch.device) -> str:
    name = _forced or os.environ.get("LADLE_ATTENTION_BACKEND", "auto")
    if name not in _BACKENDS:
        raise ValueError(f"LADLE_ATTENTION_BACKEND={name!r} is not one of {_BACKENDS}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def attention(
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
    """Write k/v at meta.slot_mapping, then attend causally (and within the window) over the cache."""
    if get_backend(q.device) == "triton":
        from kernels.triton_attention import triton_attention

        return triton_attention(q, k, v, kv_cache, meta, scale=scale, sliding_window=sliding_window, softcap=softcap)
    return reference_attention(q, k, v, kv_cache, meta, scale=scale, sliding_window=sliding_window, softcap=softcap)
