"""KV-cache manager: allocates the cache tensors and maps requests to blocks.

Backends share one logical shape (engine/kv_spec.py), per layer `[2, num_blocks, block_size, num_kv_heads,
head_dim]`; on the CPU its memory is head-major inside a block (`layer_cache`):
- paged: small blocks (default 16 tokens) handed out as a sequence grows; full blocks are
  hashed for prefix caching.
- contiguous: one block of max_model_len tokens per sequence (the slotted cache); no sharing.
The kernels see the same metadata for both. The pool's size comes from the memory plan (engine/memory.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ladle.engine.block_pool import BlockPool
from ladle.engine.kv_spec import KVCacheSpec, cpu_plane_stride
from ladle.engine.request import Request
from ladle.kernels import cpu_paged

_ROOT = hashlib.sha256(b"ladle/prefix-cache/v1").digest()  # the parent of a sequence's first block


def hash_block(parent: bytes | None, tokens: Sequence[int], extra_keys: tuple[str, ...] = ()) -> bytes:
    """Key of a full block: sha256 over the parent block's key, the token ids and any extra keys.

    A key names the block's KV, so two blocks may share it only if everything that shapes the KV is
    equal: the whole prefix (through the parent chain), the tokens, and whatever else would change the
    KV (`extra_keys`: e.g. a LoRA adapter's name or an image's digest; none exist yet). A
    cryptographic digest, not Python's 64-bit `hash`, so keys cannot be made to collide (the class of
    vLLM's CVE-2025-25183); tokens are encoded as fixed-width int64 and each extra key is
    length-prefixed, so no two different inputs share an encoding.
    """
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    for key in extra_keys:
        raw = key.encode()
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return h.digest()


@dataclass(slots=True)
class AdmissionPlan:
    """What admitting a request would take, computed without changing the pool."""

    hits: list[int]  # cached blocks holding its leading full blocks
    num_new_blocks: int  # blocks to allocate for the rest of its known tokens
    num_cached_tokens: int  # tokens whose KV the hits already hold


def layer_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A layer's cache of logical shape [2, num_blocks, block_size, num_kv_heads, head_dim], zeroed.

    On the CPU its memory is [2, num_blocks, num_kv_heads, block_size, head_dim] (head-major inside a
    block, as vLLM's CPU cache), handed out transposed to the logical shape: one head's rows of a block
    are contiguous, so a decode that walks a block head by head reads it in address order (measured at 1
    thread, 32 decodes at context 400, 16 / 8 heads x 64: 1.24x faster than token-major blocks, whose
    head rows are 2 KiB apart; docs/design-notes.md). The kernels take any layout (cpu_paged
    its strides, the torch reference kernels/reference.cache_rows); the logical shape is what everything
    indexes. Also on 2 MiB pages where the OS allows (fewer page walks: kernels/cpu_paged.zeros_on_huge_pages).
    Elsewhere (CUDA) token-major and contiguous, as the Triton kernels expect.

    The V plane does not start right after the K plane but `cpu_plane_stride` elements after the K
    plane's start (engine/kv_spec.py; a gap under 2 MiB, which the memory plan counts: KVCacheSpec.gap_bytes).
    A key's K and V rows, which a decode reads together, must not lie a large power of two apart, where the
    memory system maps them onto the same resources; default pools often are one (max_num_seqs x
    max_model_len tokens under the 4 GiB CPU cap gave benchmarks/vs_vllm.py's 166M model 8,192 blocks, 256 MiB
    planes). Measured on a Zen 4 EPYC (32 decodes at context 400, 16 / 8 heads x 64, 1 thread): planes 256
    or 512 MiB apart took 5.6-5.9 ms a call, 2.7-2.9 ms with any gap of 4 KiB to 8 MiB (64 bytes were not
    enough); docs/design-notes.md.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    two, num_blocks, block_size, num_kv_heads, head_dim = shape
    block = num_kv_heads * block_size * head_dim
    v_start = cpu_plane_stride(num_blocks * block, dtype.itemsize)
    memory = cpu_paged.zeros_on_huge_pages(((two - 1) * v_start + num_blocks * block,), dtype)
    strides = (v_start, block, block_size * head_dim, head_dim, 1)
    return memory.as_strided((two, num_blocks, num_kv_heads, block_size, head_dim), strides).transpose(2, 3)


class KVCacheManager:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, *, device: torch.device, prefix_caching: bool) -> None:
        """num_blocks: the pool size the memory plan chose (engine/memory.py)."""
        self.spec = spec
        self.block_size = spec.block_tokens
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks, enable_caching=prefix_caching)
        self.kv_caches = [layer_cache(spec.block_shape(num_blocks), spec.dtype, device) for _ in range(spec.num_layers)]
        self.bytes = spec.page_bytes * num_blocks + spec.gap_bytes(num_blocks, torch.device(device).type)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    # -- per request -----------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return self.spec.blocks_for(num_tokens)

    def _prefix_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """Hashes of the request's first num_blocks full blocks (computed once, then extended)."""
        bs = self.block_size
        while len(req.block_hashes) < num_blocks:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            tokens = [req.token_at(j) for j in range(i * bs, (i + 1) * bs)]
            req.block_hashes.append(hash_block(parent, tokens))
        return req.block_hashes[:num_blocks]

    def plan_admission(self, req: Request) -> AdmissionPlan | None:
        """Blocks for all of a waiting request's known tokens, reusing cached prefix blocks; None if
        they don't fit. Changes nothing: the scheduler checks every other rule before committing.

        The cached length is whole blocks only, and never the last known token, whose logits must be
        computed.
        """
        num_tokens = req.num_tokens
        total = self.blocks_needed(num_tokens)
        hits: list[int] = []
        # A request still computing prompt logprobs takes no hits: a hit would skip their positions.
        if self.pool.enable_caching and not req.needs_prompt_logprobs:
            for h in self._prefix_hashes(req, (num_tokens - 1) // self.block_size):
                block = self.pool.lookup(h)
                if block is None:
                    break
                hits.append(block)
        reclaimed = sum(1 for b in hits if self.pool.ref_counts[b] == 0)  # hits that sit in the free queue
        if total - len(hits) > self.pool.num_free - reclaimed:
            return None
        return AdmissionPlan(hits, total - len(hits), len(hits) * self.block_size)

    def commit_admission(self, req: Request, plan: AdmissionPlan) -> None:
        """Take the planned blocks (hits first, so allocation cannot evict them). A request's
        block_ids is a new list whenever its blocks are replaced and is only extended in place
        otherwise: the model runner's persistent block table relies on it."""
        for b in plan.hits:
            self.pool.touch(b)
        req.block_ids = plan.hits + self.pool.allocate(plan.num_new_blocks)
        req.num_cached_blocks = len(plan.hits)
        req.num_computed_tokens = plan.num_cached_tokens

    def ensure_capacity(self, req: Request, num_tokens: int) -> bool:
        """Make sure the request has blocks for num_tokens tokens; False if the pool is out."""
        missing = self.blocks_needed(num_tokens) - len(req.block_ids)
        if missing <= 0:
            return True
        if missing > self.pool.num_free:
            return False
        req.block_ids.extend(self.pool.allocate(missing))
        return True

    def register_computed(self, req: Request) -> None:
        """Publish the request's newly completed full blocks to the prefix cache."""
        if not self.pool.enable_caching:
            return
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_cached_blocks:
            return
        hashes = self._prefix_hashes(req, full)
        for i in range(req.num_cached_blocks, full):
            self.pool.register(req.block_ids[i], hashes[i])
        req.num_cached_blocks = full

    # -- copy-on-write primitives (the fork policy is engine/n_samples.py's) --
    def fork_blocks(self, src: Request, dst: Request) -> bool:
        """Give `dst` the KV of src's computed tokens: its full blocks are shared (one more reference
        each) and the partly filled last block is copied (copy-on-write, done at fork time since every
        sample writes into it next). The contiguous backend has one block per sequence and cannot share,
        so the whole computed region is copied. False, changing nothing, if no block is free for the copy."""
        n = src.num_computed_tokens
        shared = 0 if self.spec.contiguous else n // self.block_size
        partial = self.blocks_needed(n) - shared if n else 0
        if partial > self.pool.num_free:
            return False
        for b in src.block_ids[:shared]:
            self.pool.touch(b)
        dst.block_ids = src.block_ids[:shared] + self.pool.allocate(partial)
        if partial:
            rows = n - shared * self.block_size
            s, d = src.block_ids[shared], dst.block_ids[shared]
            for cache in self.kv_caches:  # [2, num_blocks, block_size, heads, dim] (any memory layout)
                cache[:, d, :rows] = cache[:, s, :rows]
        dst.num_computed_tokens = n
        dst.block_hashes = list(src.block_hashes)
        dst.num_cached_blocks = min(src.num_cached_blocks, shared)
        return True

    def move_blocks(self, src: Request, dst: Request) -> None:
        """Move src's blocks to dst (the first sample takes over the prompt's blocks as they are)."""
        dst.block_ids, src.block_ids = src.block_ids, []
        dst.num_computed_tokens = src.num_computed_tokens
        dst.block_hashes = list(src.block_hashes)
        dst.num_cached_blocks, src.num_cached_blocks = src.num_cached_blocks, 0

    def free(self, req: Request) -> None:
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        req.num_cached_blocks = 0
