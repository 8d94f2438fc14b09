"""Launch preparation for the Triton attention kernels: everything decided from the batch, once per forward.

A forward runs the same attention shapes in every layer, so tile sizes, grids, which decode rows take
the split-KV path, its segment count, the device list of those rows and the partial-result buffers are
computed once, by `prepare_launch`, and kept in `AttentionMetadata.cache` under a key of the layer's
head shapes and dtype (`launch_plan`). Every layer reuses that plan: one preparation per forward
however many layers (per distinct head shape, and a model has one). The sliding window is not part of
the plan: the split kernel divides each sequence's visible range, windowed or not, into the plan's
segments, so full and sliding layers share it.

Split-KV selection (the heuristic)
----------------------------------
The 2D kernel runs one program per (query tile, KV head). A decode row is one tile, so a batch of N
decodes has N x Hkv programs, each walking its whole context serially. When N x Hkv is below
`SplitPolicy.target_programs` (128: about the SM count of an H100 (132) or A100 (108)), the GPU has
idle SMs while a few programs walk long contexts. Then each decode row's KV range is cut into S
segments, one program each (grid N x Hkv x S), each writing a partial (max, sum of exp, unnormalised
output); a reduce kernel merges the S partials per (row, head) by log-sum-exp. S is:

    S = min(ceil(target_programs / (N x Hkv)), max_segments (16), longest decode context // min_keys_per_segment (256))

and the split is used only when S >= 2 (so short contexts, whose programs finish fast anyway, never
pay for the extra launch and the partials' round trip). Decode rows are the sequences with one query
row; in a mixed batch they take the split path with the same rule while the 2D kernel runs the
prefill chunks (its programs of one-row sequences exit at once), so a long-context decode no longer
makes the whole step wait for one serial program. With S = 1 the whole batch runs in the 2D kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import triton

from ladle.kernels.metadata import AttentionMetadata

MAX_SEGMENTS = 16  # the reduce kernel's segment axis (a power of two); never more segments than this


@dataclass(frozen=True)
class SplitPolicy:
    target_programs: int = 128  # programs wanted to fill the GPU: about its number of SMs
    max_segments: int = MAX_SEGMENTS
    min_keys_per_segment: int = 256  # a segment shorter than this is not worth its partial's round trip

    def __post_init__(self) -> None:
        if not 1 <= self.max_segments <= MAX_SEGMENTS:
            raise ValueError(f"max_segments must be in [1, {MAX_SEGMENTS}], got {self.max_segments}")
        if self.target_programs < 1 or self.min_keys_per_segment < 1:
            raise ValueError(f"target_programs and min_keys_per_segment must be >= 1: {self}")


DEFAULT_POLICY = SplitPolicy()


def num_segments(num_decodes: int, num_kv_heads: int, longest_decode: int, policy: SplitPolicy) -> int:
    """Segments per decode row (1 = no split): see the module docstring."""
    if num_decodes == 0:
        return 1
    programs = num_decodes * num_kv_heads
    if programs >= policy.target_programs:
        return 1
    wanted = math.ceil(policy.target_programs / programs)
    segments = min(wanted, policy.max_segments, longest_decode // policy.min_keys_per_segment)
    return segments if segments >= 2 else 1


def tile_config(
    head_dim: int, group: int, max_query_len: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N, num_warps) of the 2D kernel for a batch.

    BLOCK_M grows with the longest query (times the head group) up to a cap; a decode-only batch
    gets the head group padded to 16 rows (tl.dot's minimum). Caps, key tiles and warps are chosen so
    that ptxas (sm_90, triton 3.8) compiles every configuration without register spills: the gathered
    K/V tiles need one 64-bit address per element, which is what limits the tile sizes.
    The split-KV kernel uses the decode configuration (max_query_len = 1).
    """
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:  # 3xTF32 dots take about three times the registers
        cap = 32 if head_dim_pad <= 64 else 16
        block_n, num_warps = (32 if head_dim_pad <= 128 else 16), 8
    elif head_dim_pad <= 64:
        cap, block_n, num_warps = 64, 64, 4
    elif head_dim_pad <= 128:
        cap, block_n, num_warps = 64, 64, 8
    else:
        cap, block_n, num_warps = 32, 32, 8
    wanted = triton.next_power_of_2(max(1, max_query_len) * group)
    block_m = max(16, triton.next_power_of_2(group), min(cap, wanted))
    return block_m, block_m // group, block_n, num_warps


@dataclass
class LaunchPlan:
    """The launches of one attention call, shared by every layer of a forward."""

    block_tables: torch.Tensor = field(repr=False)  # contiguous in its last dim, as the kernels index it
    head_dim_pad: int
    # 2D kernel: (BLOCK_M, BLOCK_Q, BLOCK_N, num_warps) and grid; grid None when it has no rows to do.
    tiles: tuple[int, int, int, int]
    grid: tuple[int, int] | None
    # Split-KV path (num_segments >= 2): the decode rows' sequence indices on the device, its tiles,
    # and the partials [num_decodes, H, S, (D_pad)] the segments write and the reduce reads (fp32).
    num_segments: int = 1
    num_decodes: int = 0
    decode_seqs: torch.Tensor | None = field(default=None, repr=False)
    split_tiles: tuple[int, int, int, int] | None = None
    partial_out: torch.Tensor | None = field(default=None, repr=False)
    partial_max: torch.Tensor | None = field(default=None, repr=False)
    partial_sum: torch.Tensor | None = field(default=None, repr=False)

    @property
    def split(self) -> bool:
        return self.num_segments >= 2


def prepare_launch(
    meta: AttentionMetadata,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    policy: SplitPolicy | None = None,
) -> LaunchPlan:
    """Decide every launch of one attention call from the batch (host lists only: no device sync)."""
    policy = policy or DEFAULT_POLICY
    device = meta.seq_lens.device
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_tables = meta.block_tables if meta.block_tables.stride(-1) == 1 else meta.block_tables.contiguous()
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    decodes = [b for b in range(len(seq_lens)) if qsl[b + 1] - qsl[b] == 1]
    longest = max((seq_lens[b] for b in decodes), default=0)
    segments = num_segments(len(decodes), num_kv_heads, longest, policy)
    tiles = tile_config(head_dim, group, meta.max_query_len, dtype)
    # Sequence b's query tiles start at query_start_loc[b] // BLOCK_Q + b: this bounds the tile count.
    grid = (meta.num_tokens // tiles[1] + meta.num_seqs, num_kv_heads)
    if segments < 2:
        return LaunchPlan(block_tables, head_dim_pad, tiles, grid if meta.num_tokens else None)
    n = len(decodes)
    only_decodes = n == meta.num_seqs
    return LaunchPlan(
        block_tables,
        head_dim_pad,
        tiles,
        None if only_decodes else grid,
        num_segments=segments,
        num_decodes=n,
        decode_seqs=torch.tensor(decodes, dtype=torch.int32).to(device),
        split_tiles=tile_config(head_dim, group, 1, dtype),
        partial_out=torch.empty((n, num_heads, segments, head_dim_pad), dtype=torch.float32, device=device),
        partial_max=torch.empty((n, num_heads, segments), dtype=torch.float32, device=device),
        partial_sum=torch.empty((n, num_heads, segments), dtype=torch.float32, device=device),
    )


def launch_plan(
    meta: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> LaunchPlan:
    """The forward's plan for these head shapes: prepared by the first layer, reused by the others."""
    key = ("triton_launch_plan", num_heads, num_kv_heads, head_dim, dtype)
    plan = meta.cache.get(key)
    if plan is None:
        plan = meta.cache[key] = prepare_launch(meta, num_heads, num_kv_heads, head_dim, dtype)
    return plan


def warmup_batches(
    num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, max_model_len: int, max_num_seqs: int,
    max_num_batched_tokens: int, policy: SplitPolicy | None = None,
) -> list[tuple[list[int], list[int]]]:
    """(query_lens, seq_lens) of dummy forwards that together launch every kernel variant a run can use.

    A variant is a compiled specialisation: the 2D kernel's BLOCK_M follows the longest query (one
    variant per power of two from the decode tile up to the cap), the split-KV and reduce kernels have
    one each. Per-batch integers the kernels read (sequence counts, segment count, the block-table row
    stride) are declared do_not_specialize, so they cause no recompiles.
    """
    policy = policy or DEFAULT_POLICY
    budget = max(1, min(max_num_batched_tokens, max_model_len))
    batches: list[tuple[list[int], list[int]]] = []
    # 2D kernel, one batch per BLOCK_M: a chunk of the longest query that still maps to that tile.
    seen = set()
    for max_q in [1] + [1 << i for i in range(1, 16)]:
        max_q = min(max_q, budget)
        block_m = tile_config(head_dim, group, max_q, dtype)[0]
        if block_m not in seen:
            seen.add(block_m)
            batches.append(([max_q], [max_q]))
        if max_q == budget:
            break
    # A decode-only batch too large to split (the 2D decode launch with many rows).
    many = max(1, min(max_num_seqs, -(-policy.target_programs // num_kv_heads)))
    batches.append(([1] * many, [1] * many))
    # The split-KV and reduce kernels: one decode whose context gets at least two segments, and a
    # mixed batch (a chunk beside it, so the 2D kernel skips its decode row).
    long_decode = 2 * policy.min_keys_per_segment
    if long_decode <= max_model_len and num_segments(1, num_kv_heads, long_decode, policy) >= 2:
        batches.append(([1], [long_decode]))
        if max_num_seqs >= 2 and budget >= 2:
            chunk = min(budget - 1, 16)
            batches.append(([1, chunk], [long_decode, chunk]))
    return batches
