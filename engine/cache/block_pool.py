"""A pool of fixed-geometry blocks of one cache form, with an LRU queue of evictable blocks.

Modelled on vLLM v1's ``BlockPool``: a block is *leased* (ref count > 0) by the requests that
read or write it; at ref count 0 it sits in the free queue, still holding its cached content and
hash until it is handed out again (eviction). Block 0 is a permanent sentinel: it is never handed
out, so padding can point at it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from engine.cache.hashing import BlockHash

SENTINEL_BLOCK = 0

EVICTED_MEMORY_FACTOR = 8
"""A pool remembers the hashes of its last ``8 × num_blocks`` evictions, to tell a block that was
evicted from one that was never stored."""


class PoolExhausted(RuntimeError):
    """Every block of the pool is leased; nothing can be evicted to serve an allocation."""


class BlockPool:
    """Block ids ``1 … num_blocks − 1`` of one form (id 0 is the sentinel).

    Args:
        name: the form's name, used in messages.
        num_blocks: total ids including the sentinel (≥ 2).
        on_publish, on_evict: called with a block hash when a block starts or stops being
            cached under it (the prefix index keeps count).
    """

    def __init__(
        self,
        name: str,
        num_blocks: int,
        on_publish: Callable[[BlockHash], None],
        on_evict: Callable[[BlockHash], None],
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"{name}: a pool needs at least 2 blocks (one is the sentinel), got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.epoch = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._on_publish = on_publish
        self._on_evict = on_evict
        self.evictions = 0
        self._evicted: OrderedDict[BlockHash, None] = OrderedDict()
        self._evicted_memory = EVICTED_MEMORY_FACTOR * num_blocks

    # -- queries -------------------------------------------------------------------------------
    def lookup(self, h: BlockHash) -> int | None:
        """The block cached under ``h``, if any (leased or evictable)."""
        return self._cached.get(h)

    def was_evicted(self, h: BlockHash) -> bool:
        """Whether a block cached under ``h`` was evicted recently (and not stored again since)."""
        return h in self._evicted

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take (evictable cached ones included)."""
        return len(self._free)

    @property
    def num_leased(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_holding(self) -> int:
        """Blocks that hold state: leased, or cached and not yet evicted."""
        return sum(1 for b in range(1, self.num_blocks) if self.ref_count[b] or self.block_hash[b] is not None)

    # -- transitions ---------------------------------------------------------------------------
    def allocate(self) -> int:
        """Hand out the least recently freed block, evicting what it cached.

        Raises:
            PoolExhausted: every block is leased.
        """
        if not self._free:
            raise PoolExhausted(f"{self.name}: all {self.num_blocks - 1} blocks are leased")
        block, _ = self._free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            del self._cached[h]
            self.block_hash[block] = None
            self.evictions += 1
            self._evicted[h] = None
            if len(self._evicted) > self._evicted_memory:
                self._evicted.popitem(last=False)
            self._on_evict(h)
        self.ref_count[block] = 1
        self.epoch[block] += 1
        return block

    def lease(self, block: int) -> None:
        """Take a reference on a cached block (removes it from the free queue at 0 → 1)."""
        self._check_id(block)
        if self.block_hash[block] is None and self.ref_count[block] == 0:
            raise RuntimeError(f"{self.name}: leasing block {block}, which is free and holds nothing")
        if self.ref_count[block] == 0:
            del self._free[block]
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        """Drop a reference. At 0 a cached block becomes evictable (most recently used end of the
        queue); a block that caches nothing goes to the front, to be reused first.

        Raises:
            RuntimeError: the block is not leased (a double free).
        """
        self._check_id(block)
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"{self.name}: double free of block {block}")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self._free[block] = None
            if self.block_hash[block] is None:
                self._free.move_to_end(block, last=False)

    def publish(self, block: int, h: BlockHash) -> bool:
        """Make a leased, fully written block findable under ``h``.

        Returns False (and leaves the block unpublished) when another block already caches
        ``h``; the existing one is kept.
        """
        self._check_id(block)
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"{self.name}: publishing block {block}, which is not leased")
        if self.block_hash[block] is not None:
            raise RuntimeError(f"{self.name}: block {block} is already published")
        if h in self._cached:
            return False
        self.block_hash[block] = h
        self._cached[h] = block
        self._evicted.pop(h, None)
        self._on_publish(h)
        return True

    def _check_id(self, block: int) -> None:
        if not 0 < block < self.num_blocks:
            raise RuntimeError(f"{self.name}: block id {block} is the sentinel or out of range")

    # -- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if ref counts, the free queue or the hash map disagree."""
        assert self.ref_count[SENTINEL_BLOCK] == 0 and SENTINEL_BLOCK not in self._free, "sentinel in use"
        assert self.block_hash[SENTINEL_BLOCK] is None, "sentinel published"
        for block in range(1, self.num_blocks):
            rc = self.ref_count[block]
            assert rc >= 0, f"{self.name}: block {block} ref count {rc}"
            assert (rc == 0) == (block in self._free), f"{self.name}: block {block} ref {rc} vs free queue"
            h = self.block_hash[block]
            if h is not None:
                assert self._cached.get(h) == block, f"{self.name}: block {block} hash not mapped to it"
        assert len(self._cached) == sum(h is not None for h in self.block_hash), f"{self.name}: stale hash map"
