"""KV-cache manager: sizes and allocates the cache tensors and maps requests to blocks.

Backends share one layout, per layer `[2, num_blocks, block_size, num_kv_heads, head_dim]`:
- paged: small blocks (default 16 tokens) handed out as a sequence grows; full blocks are
  hashed for prefix caching.
- contiguous: one block of max_model_len tokens per sequence (the slotted cache); no sharing.
The kernels see the same metadata for both.
"""

from __future__ import annotations

import math
import warnings

import torch

from engine.block_pool import BlockPool
from engine.config import CacheConfig
from engine.request import Request

_DEFAULT_CPU_CACHE_GB = 4.0


def hash_block(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Chained hash of a full block: equal only for equal tokens after an equal prefix."""
    return hash((parent, tokens))


class KVCacheManager:
    def __init__(
        self,
        config: CacheConfig,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int,
    ) -> None:
        self.config = config
        self.contiguous = config.backend == "contiguous"
        self.block_size = config.max_model_len if self.contiguous else config.block_size
        bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
        self.num_blocks = self._num_blocks(bytes_per_token, max_num_seqs, device)
        self.pool = BlockPool(self.num_blocks, enable_caching=config.prefix_caching_enabled)
        shape = (2, self.num_blocks, self.block_size, num_kv_heads, head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.bytes = bytes_per_token * self.num_blocks * self.block_size

    def _num_blocks(self, bytes_per_token: int, max_num_seqs: int, device: torch.device) -> int:
        cfg = self.config
        block_bytes = bytes_per_token * self.block_size
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if cfg.memory_gb is not None:
            n = int(cfg.memory_gb * 2**30 // block_bytes)
            if n < 1:
                raise ValueError(
                    f"cache.memory_gb={cfg.memory_gb} holds no block of {self.block_size} tokens "
                    f"({block_bytes / 2**20:.1f} MiB each); raise cache.memory_gb"
                )
            return n
        # Enough for every sequence at full length, within a memory cap.
        wanted = max_num_seqs * math.ceil(cfg.max_model_len / self.block_size)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            cap = int(0.85 * free // block_bytes)
        else:
            cap = int(_DEFAULT_CPU_CACHE_GB * 2**30 // block_bytes)
        if cap < wanted:
            warnings.warn(
                f"KV cache capped at {cap} blocks of {self.block_size} tokens (wanted {wanted} for "
                f"max_num_seqs={max_num_seqs} x max_model_len={cfg.max_model_len}); set cache.num_blocks "
                "or cache.memory_gb to choose",
                stacklevel=3,
            )
        return max(1, min(wanted, cap))

    # -- per request -----------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return 1 if self.contiguous else math.ceil(num_tokens / self.block_size)

    def _prefix_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """Hashes of the request's first num_blocks full blocks (computed once, then extended)."""
        bs = self.block_size
        tokens = req.all_token_ids
        while len(req.block_hashes) < num_blocks:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(hash_block(parent, tuple(tokens[i * bs : (i + 1) * bs])))
        return req.block_hashes[:num_blocks]

    def allocate_for_admission(self, req: Request) -> bool:
        """Give a waiting request blocks for all its known tokens, reusing cached prefix blocks.

        Sets num_computed_tokens to the cached length: full blocks only, and never the last known
        token, whose logits must be computed. Returns False (taking nothing) if the blocks don't fit.
        """
        num_tokens = req.num_tokens
        total = self.blocks_needed(num_tokens)
        hits: list[int] = []
        if self.pool.enable_caching:
            for h in self._prefix_hashes(req, (num_tokens - 1) // self.block_size):
                block = self.pool.lookup(h)
                if block is None:
                    break
                hits.append(block)
        reclaimed = sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        if total - len(hits) > self.pool.num_free - reclaimed:
            return False
        for b in hits:
            self.pool.touch(b)
        req.block_ids = hits + self.pool.allocate(total - len(hits))
        req.num_cached_blocks = len(hits)
        req.num_computed_tokens = len(hits) * self.block_size
        return True

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

    def free(self, req: Request) -> None:
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        req.num_cached_blocks = 0
