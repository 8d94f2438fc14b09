"""The attention op as one opaque torch custom op, so a compiled forward is one graph, not one per layer.

torch.compile cannot trace the attention kernels (the reference plans its gathers from host lists; the
Triton kernel is launched from Python), and a graph break per layer would cost a compiled region per
layer. So the compiled forward calls `torch.ops.ladle.attention(q, k, v, layer, scale, window, softcap)`:
tensors and per-layer constants only. The step's metadata and the KV caches are not arguments: the
caller puts them in a forward context (`attention_context`) around the compiled call, and the op reads
them from there (vLLM's forward context does the same). Nothing that changes per step reaches the
graph as a Python value, so nothing is guarded per step, and the KV cache write is a side effect the
graph does not see (no functionalised copy of the cache). The context is per thread: engines stepping
in two threads of one process each read their own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ladle.kernels import AttentionMetadata, attention, write_kv_cache


@dataclass(slots=True)
class _ForwardContext:
    meta: AttentionMetadata
    kv_caches: list[torch.Tensor]


class _ThreadContext(threading.local):
    current: _ForwardContext | None = None


# Per thread: a process-wide global let one thread's forward read another's metadata and caches.
_local = _ThreadContext()


@contextmanager
def attention_context(meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> Iterator[None]:
    """Make `meta` and the per-layer caches what `ladle::attention` reads inside this block (this thread)."""
    previous, _local.current = _local.current, _ForwardContext(meta, kv_caches)
    try:
        yield
    finally:
        _local.current = previous


def forward_context() -> _ForwardContext:
    """The metadata and caches of the forward running in this thread (what the compiled forward's ops read)."""
    context = _local.current
    if context is None:
        raise RuntimeError("a ladle op that reads the forward context ran outside attention_context(meta, kv_caches)")
    return context


@torch.library.custom_op("ladle::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float, window: int, softcap: float,
    k_all: torch.Tensor | None = None, v_all: torch.Tensor | None = None,
) -> torch.Tensor:
    """ladle.kernels.attention on layer `layer`'s cache with the context's metadata. window <= 0 means none,
    softcap == 0 means none (custom op schemas take no Optional scalars the compiler keeps constant).
    k_all/v_all (the last layer, where q/k/v are the rows of meta.outputs only): every row's keys and
    values, written to the cache first; the kept rows then attend with meta.outputs.meta."""
    context = forward_context()
    meta = context.meta
    if k_all is not None and v_all is not None:
        if meta.outputs is None:
            raise RuntimeError("ladle::attention given every row's keys without meta.outputs")
        if not meta.outputs.every_row:
            write_kv_cache(k_all, v_all, context.kv_caches[layer], meta.slot_mapping)
            meta = meta.outputs.meta
        elif q.shape[0] != k_all.shape[0]:
            raise RuntimeError(f"ladle::attention: every row kept, but {q.shape[0]} query rows of {k_all.shape[0]}")
        # Every row kept (a decode step, a CUDA graph's): q/k/v are all the rows, in order, and
        # attention() writes them through its backend as in the other layers. The Triton write skips
        # a graph's padding slot -1, which the reference write would take as an index.
    out = attention(
        q,
        k,
        v,
        context.kv_caches[layer],
        meta,
        scale=scale,
        sliding_window=window if window > 0 else None,
        softcap=softcap if softcap != 0 else None,
    )
    # The compiled graph is built for the fake's layout (contiguous): never hand it other strides.
    return out.contiguous()


@attention_op.register_fake
def _attention_fake(q, k, v, layer, scale, window, softcap, k_all=None, v_all=None):
    return q.new_empty(q.shape)
