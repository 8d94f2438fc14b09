"""A throwaway forward of a given shape: what memory profiling and arrival calibration measure.

It runs the model on dummy token ids with its own small KV cache (never the engine's, but laid out as
the engine's: engine/kv_cache.layer_cache), so it can be called before the engine's cache exists and
leaves no trace in it, and a timing walks the memory the engine's forward walks.
"""

from __future__ import annotations

import math
import time

import torch

from ladle.engine.kv_cache import layer_cache
from ladle.kernels import AttentionMetadata

BLOCK = 16


@torch.inference_mode()  # inputs made as the model runner makes them (a compiled forward guards on it)
def dummy_forward(model: torch.nn.Module, query_lens: list[int], seq_lens: list[int],
                  backend: str = "auto", block_size: int = BLOCK, share_blocks: bool = False,
                  every_row: bool = True) -> float:
    """Run one forward where sequence i computes its last query_lens[i] of seq_lens[i] tokens (earlier
    positions are read from the cache, here zeros) and the LM head runs on each sequence's last token.
    share_blocks: every sequence's table starts at block 0, so the throwaway cache holds the longest
    sequence only (the values are meaningless anyway; for warm-ups, where only the launches matter).
    every_row: the last layer computes every row, the most a forward of this shape costs (a step with
    prompt logprobs keeps them all: what the memory profile needs); False keeps each sequence's last row
    only, as the engine's forward of a step without prompt logprobs (what a timing of it needs).
    Returns the forward's wall seconds (synchronised on CUDA)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    arch = model.arch
    tables, start = [], 0
    for n in seq_lens:
        blocks = math.ceil(n / block_size)
        first = 0 if share_blocks else start
        tables.append(list(range(first, first + blocks)))
        start = max(start, blocks) if share_blocks else start + blocks
    # The engine's layout (head-major blocks on 2 MiB pages on the CPU): a timing walks the same memory.
    shape = (2, start, block_size, arch.num_kv_heads, arch.head_dim)
    caches = [layer_cache(shape, dtype, device) for _ in range(arch.num_layers)]
    ends = [sum(query_lens[: i + 1]) - 1 for i in range(len(query_lens))]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device, logits_indices=ends,
                                   backend=backend)
    if not every_row:
        meta.restrict_outputs([q - 1 for q in query_lens])  # the forward returns those rows only
    ids = torch.zeros(sum(query_lens), dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(s - q, s, device=device) for q, s in zip(query_lens, seq_lens)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    hidden = model(ids, pos, caches, meta)
    model.compute_logits(hidden[meta.logits_indices] if every_row else hidden)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def compile_forward(model: torch.nn.Module, backend: str = "auto") -> float:
    """Switch `model` to its compiled forward and compile it now, with a dummy forward (its one graph
    serves every width), so no timed step ever waits for the compiler. Returns seconds."""
    t0 = time.perf_counter()
    model.enable_compile()
    dummy_forward(model, [2, 1], [3, 2], backend)
    return time.perf_counter() - t0


def prefill_shape(num_tokens: int, max_model_len: int) -> list[int]:
    """`num_tokens` prompt tokens as sequences of at most max_model_len tokens."""
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


def warm_up_kernels(model: torch.nn.Module, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                    backend: str = "auto", block_size: int = BLOCK) -> float:
    """Compile every Triton kernel variant a run can launch, before its first timed step.

    Triton compiles a kernel the first time it meets a new specialisation (for the attention kernels:
    the 2D kernel's query tile, which follows the longest query of the batch; the split-KV and reduce
    kernels), which costs seconds on a GPU. Without this, those stalls land in the run's first decode,
    first mixed and first split-KV steps. The batches come from ladle.kernels.triton_launch.warmup_batches
    (decode-only, one per 2D tile size, split-KV decode-only and mixed) and run as throwaway forwards
    with their own caches. block_size: the run's cache block (the kernels are compiled for it; the
    contiguous backend's is max_model_len); the dummy sequences share their blocks, so the warm-up's
    cache is one longest sequence. Returns the wall seconds spent."""
    from ladle.kernels.triton_launch import warmup_batches

    arch = model.arch
    dtype = next(model.parameters()).dtype
    t0 = time.perf_counter()
    for query_lens, seq_lens in warmup_batches(arch.num_kv_heads, arch.num_heads // arch.num_kv_heads,
                                               arch.head_dim, dtype, max_model_len, max_num_seqs,
                                               max_num_batched_tokens):
        dummy_forward(model, query_lens, seq_lens, backend, block_size=block_size, share_blocks=True)
    return time.perf_counter() - t0
