"""The hash map of one block pool: which published block caches each prefix hash, and back.

Modelled on vLLM v1's ``BlockHashToBlockMap``. A block is *published* under a hash once it is
fully written and stops being so when it is evicted or invalidated; the map keeps both
directions (hash → block for lookups, block → hash for evictions), counts its changes in a
version (readers memoise what they found under one version) and remembers the hashes it lost
to eviction (:class:`~engine.cache.eviction_memory.EvictionMemory`), forgetting one when it is
published again.

The map only records; whether a block may be published or unpublished is the pool's lifecycle
rule (:class:`engine.cache.block_pool.BlockPool`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from engine.cache.eviction_memory import EvictionMemory
from engine.cache.hashing import BlockHash
from engine.cache.lifecycle import BlockState


class BlockHashMap:
    """The published blocks ``1 … num_blocks − 1`` of one pool by hash.

    Args:
        name: the pool's name, used in messages.
        num_blocks: total ids of the pool, the sentinel included.
        memory: how many evicted hashes are remembered.
    """

    def __init__(self, name: str, num_blocks: int, memory: int) -> None:
        self.name = name
        self.blocks: dict[BlockHash, int] = {}
        """Hash → the block published under it."""
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        """Block → the hash it is published under (None: unpublished)."""
        self.version = 0
        """Bumped whenever the map changes."""
        self.evicted = EvictionMemory(name, memory)
        """The hashes recently lost to eviction (and not published again since)."""

    def add(self, block: int, h: BlockHash) -> None:
        """Publish ``block`` under ``h`` (neither is published yet); forget ``h``'s eviction."""
        self.block_hash[block] = h
        self.blocks[h] = block
        self.version += 1
        self.evicted.forget(h)

    def remove(self, block: int, state: BlockState) -> BlockHash:
        """Unpublish ``block`` (now in ``state``, for the message) and return its hash.

        Raises:
            AssertionError: ``block`` is not published (an internal invariant).
        """
        h = self.block_hash[block]
        if h is None:
            raise AssertionError(f"{self.name}: block {block} {state} has no hash")
        del self.blocks[h]
        self.block_hash[block] = None
        self.version += 1
        return h

    def check_invariants(self, state: Sequence[BlockState]) -> None:
        """Check that the map is a bijection between the published blocks and their hashes, and
        the eviction memory's own invariants (no hash both published and remembered).

        Raises:
            AssertionError: naming the pool, and the block and its ``state`` where one is wrong.
        """

        def fail(msg: str) -> NoReturn:
            raise AssertionError(f"{self.name}: {msg}")

        published = 0
        for b, h in enumerate(self.block_hash):
            if h is not None:
                published += 1
                if self.blocks.get(h) != b:
                    fail(f"block {b} {state[b]}: hash {h.hex()} maps to block {self.blocks.get(h)}")
        if published != len(self.blocks):
            fail(f"hash map has {len(self.blocks)} entries for {published} published blocks")
        self.evicted.check_invariants(self.blocks)
