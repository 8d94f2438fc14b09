"""Choose the attention implementation: Triton on CUDA, the C++ paged kernel on CPU, or the torch reference.

In order of precedence: the metadata's `backend` (the engine's model.attention_backend), then
`set_backend()`, then `LADLE_ATTENTION_BACKEND` (auto | triton | cpu_paged | torch); "auto" defers to
the next. "auto" resolves to "triton" on CUDA and to "cpu_paged" on CPU when its kernel builds (it is
compiled at first use, kernels/cpu_build.py; without a compiler one warning is logged and "torch" is
used). "torch" is the reference (kernels/reference.py), the oracle the kernels are tested against.
The Triton path is imported lazily so CPU-only installs never need it.
"""

from __future__ import annotations

import os

import torch

from ladle.kernels.cpu_build import load_library
from ladle.kernels.metadata import AttentionMetadata
from ladle.kernels.reference import reference_attention

_BACKENDS = ("auto", "triton", "cpu_paged", "torch")
_forced: str | None = None


def set_backend(name: str) -> None:
    """Process-wide default for tests and benchmarks; "auto" clears it."""
    if name not in _BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {_BACKENDS}")
    global _forced
    _forced = None if name == "auto" else name


def get_backend(device: torch.device, requested: str = "auto", dtype: torch.dtype = torch.float32) -> str:
    if requested not in _BACKENDS:
        raise ValueError(f"attention backend {requested!r} is not one of {_BACKENDS}")
    name = requested if requested != "auto" else _forced or os.environ.get("LADLE_ATTENTION_BACKEND", "auto")
    if name not in _BACKENDS:
        raise ValueError(f"LADLE_ATTENTION_BACKEND={name!r} is not one of {_BACKENDS}")
    if name == "auto":
        if device.type == "cuda":
            return "triton"
        # bf16/fp16 on CPU keep the torch reference: with torch 2.15 the compiled bf16 forward through
        # cpu_paged was not bit-identical to eager (tests/models/test_compile.py); fp32 is the CPU path.
        if dtype not in (torch.float32, torch.float64):
            return "torch"
        return "cpu_paged" if load_library() is not None else "torch"
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
    backend = get_backend(q.device, meta.backend, q.dtype)
    if backend == "triton":
        from ladle.kernels.triton_attention import triton_attention

        return triton_attention(q, k, v, kv_cache, meta, scale=scale, sliding_window=sliding_window, softcap=softcap)
    if backend == "cpu_paged":
        from ladle.kernels.cpu_paged import cpu_paged_attention, supports

        if supports(q, kv_cache):
            return cpu_paged_attention(
                q, k, v, kv_cache, meta, scale=scale, sliding_window=sliding_window, softcap=softcap
            )
    return reference_attention(q, k, v, kv_cache, meta, scale=scale, sliding_window=sliding_window, softcap=softcap)
