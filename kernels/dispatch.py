"""Choose the attention implementation: Triton on CUDA, the torch reference on CPU.

In order of precedence: the metadata's `backend` (the engine's model.attention_backend), then
`set_backend()`, then `LADLE_ATTENTION_BACKEND` (auto | triton | torch); "auto" defers to the next.
The Triton path is imported lazily so CPU-only installs never need it.
"""

from __future__ import annotations

import os

import torch

from kernels.metadata import AttentionMetadata
from kernels.reference import reference_attention

_BACKENDS = ("auto", "triton", "torch")
_forced: str | None = None


def set_backend(name: str) -> None:
    """Process-wide default for tests and benchmarks; "auto" clears it."""
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {_BACKENDS}")
    global _forced
    _forced = None if name == "auto" else name


def get_backend(device: torch.device, requested: str = "auto") -> str:
    if requested not in _BACKENDS:
        raise ValueError(f"attention backend {requested!r} is not one of {_BACKENDS}")
    name = requested if requested != "auto" else _forced or os.environ.get("LADLE_ATTENTION_BACKEND", "auto")
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
    if get_backend(q.device, meta.backend) == "triton":
        from kernels.triton_attention import triton_attention

        return triton_attention(q, k, v, kv_cache, meta, scale=scale, sliding_window=sliding_window, softcap=softcap)
    return reference_attention(q, k, v, kv_cache, meta, scale=scale, sliding_window=sliding_window, softcap=softcap)
