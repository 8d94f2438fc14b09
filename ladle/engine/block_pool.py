"""The pool of KV-cache blocks: a free list, reference counts, and the prefix-cache hash map.

A block with ref_count 0 sits in the free queue. If it holds a full, hashed block of tokens it also
stays in the hash map, so a later request with the same prefix can take it back (a cache hit);
it is evicted, least recently freed first, only when a block is needed for new tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Insertion order is eviction order: blocks freed earlier are reused first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block key -> block id
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks for new tokens (evicting cached contents if needed)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; pass a sequence's blocks tail first so its
        prefix outlives its suffix in the cache."""
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than taken")
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self._free[block] = None
                    self._free.move_to_end(block, last=False)  # no cached content: reuse first
                else:
                    self._free[block] = None

    # -- prefix cache ---------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, block: int) -> None:
        """Take a reference to a cached block found by lookup()."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """Record that `block` now holds the full block of tokens identified by block_hash."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if block_hash in self._cached:
            return  # the same content is already cached in another block; keep that one
        self.block_hash[block] = block_hash
        self._cached[block_hash] = block

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self._cached.get(h) == block:
                del self._cached[h]
            self.num_evictions += 1

    def check_invariants(self) -> None:
        free = set(self._free)
        for b in range(self.num_blocks):
            assert (self.ref_counts[b] == 0) == (b in free), f"block {b}: ref {self.ref_counts[b]}, free {b in free}"
        for h, b in self._cached.items():
            assert self.block_hash[b] == h
