"""A pool of fixed-geometry blocks of one cache form, with evictable blocks queued by reuse value.

Modelled on vLLM v1's ``BlockPool``: a block is *leased* (ref count > 0) by the requests that
read or write it; at ref count 0 it sits in a free queue, still holding its cached content and
hash until it is handed out again (eviction). Block 0 is a permanent sentinel: it is never handed
out, so padding can point at it.

Every block has a lifecycle state (:class:`engine.cache.lifecycle.BlockState`, DESIGN.md §4)
and every state change goes through :func:`engine.cache.lifecycle.transition`, which checks the
transition table and bumps the block's epoch. The pool uses ``FREE``, ``WRITING``, ``RESIDENT``,
``CACHED`` and ``INVALID``; the swap states belong to the entries of the host/disk tiers
(:mod:`engine.cache.tiers`), which a pool hands every block it evicts (write-back) and which a
lookup may consult through :meth:`BlockPool.present` while the pool is in *tier view*.

This module owns the pool's blocks: states, ref counts, epochs. Its parts live in their own
modules: the free queue (:mod:`engine.cache.free_queue`), the hash map and its eviction memory
(:mod:`engine.cache.block_hash_map`), the protocol of the tiers (:mod:`engine.cache.lower_tiers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import NoReturn

from engine.cache.block_hash_map import BlockHashMap
from engine.cache.free_queue import FreeBlockQueue
from engine.cache.hashing import BlockHash
from engine.cache.lifecycle import BlockState, Event, rule, transition
from engine.cache.lower_tiers import LowerTiers

__all__ = ["EVICTED_MEMORY_FACTOR", "SENTINEL_BLOCK", "BlockPool", "LowerTiers", "PoolExhausted"]

SENTINEL_BLOCK = 0

EVICTED_MEMORY_FACTOR = 8
"""A pool remembers the hashes of its last ``8 × num_blocks`` evictions, to tell a block that was
evicted from one that was never stored."""


class PoolExhausted(RuntimeError):
    """Every block of the pool is leased; nothing can be evicted to serve an allocation."""


class BlockPool:
    """Block ids ``1 … num_blocks − 1`` of one form (id 0 is the sentinel, permanently
    ``INVALID``).

    Free queue. Blocks with ref count 0 wait in the empty queue (``FREE``) or in one LRU queue
    per priority (``CACHED``), in the order of :class:`~engine.cache.free_queue.FreeBlockQueue`.
    ``allocate``, ``lease`` and ``release`` are O(1) plus O(log P) heap work for P priorities.

    Epochs. ``epoch[b]`` changes whenever what block ``b`` holds may have changed under a
    lease holder: on ``allocate``, ``evict`` (inside ``allocate``) and ``invalidate``
    (the rule is in :mod:`engine.cache.lifecycle`). Epochs are reported with every lookup;
    ``version`` counts changes of the hash map, which the cache re-checks between a lookup and
    its leases.

    Args:
        name: the form's name, used in messages.
        num_blocks: total ids including the sentinel (≥ 2).
        on_publish, on_evict: called with a block hash when a block starts or stops being
            cached under it (the prefix index keeps count); ``on_evict`` also on ``invalidate``.

    Raises:
        ValueError: ``num_blocks`` < 2.
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
        self.state = [BlockState.INVALID] + [BlockState.FREE] * (num_blocks - 1)
        self._hashes = BlockHashMap(name, num_blocks, EVICTED_MEMORY_FACTOR * num_blocks)
        self._cached = self._hashes.blocks  # hash → block
        self.block_hash = self._hashes.block_hash
        """Block → the hash it is published under (None: unpublished)."""
        self._free = FreeBlockQueue(name, num_blocks)
        self._held_priority: dict[int, int] = {}  # highest priority given by earlier releases
        self._on_publish = on_publish
        self._on_evict = on_evict
        self.observer: Callable[[str, BlockHash, int], None] | None = None
        """Optional audit hook, called as ``observer(action, hash, block)`` after a block is
        published (``"stored"``) or stops being cached (``"removed"``: evicted or invalidated)."""
        self.evictions = 0
        self.tiers: LowerTiers | None = None
        """The host/disk tiers every evicted block is copied down to (None: no tiers)."""
        self.tier_view = False
        """When True, :meth:`present` also counts objects held by the lower tiers (the cache
        sets it while it plans a resume that would swap them in)."""
        self.max_cached: int | None = None
        """Most evictable (``CACHED``) blocks kept; beyond it a released block evicts the least
        valuable one at once, as a smaller pool would (None: no cap). See :meth:`limit_cached`."""

    # -- queries -------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Bumped whenever the hash → block map changes (publish, evict, invalidate): readers
        may memoise what they found under one version."""
        return self._hashes.version

    def lookup(self, h: BlockHash) -> int | None:
        """The block cached under ``h``, if any (``RESIDENT`` or ``CACHED``)."""
        return self._cached.get(h)

    def present(self, h: BlockHash) -> bool:
        """Whether an object is cached under ``h`` on the device — or, in tier view, readable in
        a lower tier (a swap-in away)."""
        return h in self._cached or self.lower_entry(h) is not None

    def presence(self) -> Callable[[BlockHash], bool]:
        """:meth:`present` for scans over many hashes: the hash map's own membership test
        outside tier view (no call per hash into the tiers)."""
        return self.present if self.tier_view and self.tiers is not None else self._cached.__contains__

    def lower_entry(self, h: BlockHash) -> object | None:
        """In tier view, the lower-tier entry under ``h`` when no device block caches it."""
        if not self.tier_view or self.tiers is None or h in self._cached:
            return None
        return self.tiers.readable(self.name, h)

    @property
    def view_version(self) -> tuple[int, bool, int]:
        """Changes whenever :meth:`present` may answer differently (memo key for scans)."""
        return (self.version, self.tier_view, self.tiers.version if self.tiers is not None and self.tier_view else 0)

    @property
    def cached_blocks(self) -> Mapping[BlockHash, int]:
        """The hash → block map of published blocks (read-only view for fast scans)."""
        return self._cached

    def ghost_depth(self, h: BlockHash) -> int | None:
        """How many more cached blocks this pool would have needed to still hold ``h`` (None:
        ``h`` was not evicted recently, or was stored again since): the LRU stack distance beyond
        the pool's size read off its ghost list (:meth:`EvictionMemory.depth`, which gives the
        rule and its sources). O(priorities × log(remembered evictions))."""
        return self._hashes.evicted.depth(h)

    def spare_blocks(self, hashes: Iterable[BlockHash]) -> int | None:
        """How many blocks smaller this pool could be now and still hold every one of ``hashes``
        it caches (None: it caches none of them): the room left before an eviction (empty blocks,
        or what a cap leaves) plus the blocks evicted before the first of them to go
        (:meth:`FreeBlockQueue.evicted_before`; a leased block outlives every evictable one)."""
        blocks = [b for b in map(self._cached.get, hashes) if b is not None]
        if not blocks:
            return None
        free = self._free
        room = free.num_empty if self.max_cached is None else max(0, min(free.num_empty, self.max_cached - free.num_evictable))
        return free.evicted_before([b for b in blocks if self.ref_count[b] == 0], room)

    def was_evicted(self, h: BlockHash) -> bool:
        """Whether a block cached under ``h`` left the device: evicted recently (and not stored
        again since), or copied to a lower tier that still holds it (also after a restart)."""
        return h in self._hashes.evicted or (self.tiers is not None and self.tiers.readable(self.name, h) is not None)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take (evictable cached ones included)."""
        return self._free.num_empty + self._free.num_evictable

    @property
    def num_leased(self) -> int:
        """Blocks with ref count > 0 (invalidated ones still leased included)."""
        return self.num_blocks - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        """Published blocks, leased or evictable."""
        return len(self._cached)

    @property
    def num_holding(self) -> int:
        """Blocks that hold state: leased, or cached and not yet evicted."""
        return sum(1 for b in range(1, self.num_blocks) if self.ref_count[b] or self.block_hash[b] is not None)

    # -- transitions ---------------------------------------------------------------------------
    def allocate(self) -> int:
        """Hand out a block with ref count 1 (``WRITING``, epoch bumped): the most recently
        freed empty block, else the least recently released evictable block of the lowest
        priority, evicting what it cached (``on_evict`` is called, ``evictions`` counts it).

        Raises:
            PoolExhausted: every block is leased.
        """
        if not self._free.num_empty:
            if not self._free.num_evictable:
                raise PoolExhausted(f"{self.name}: all {self.num_blocks - 1} blocks are leased")
            self._evict(self._free.next_victim())
        block = self._free.peek_empty()
        self._apply(block, Event.ALLOCATE)
        self._free.take_empty(block)
        self.ref_count[block] = 1
        return block

    def lease(self, block: int) -> None:
        """Take a reference on a block in use or cached (a cached one leaves the free queue at
        0 → 1 and becomes ``RESIDENT``).

        Raises:
            RuntimeError: the id is the sentinel or out of range.
            engine.cache.lifecycle.IllegalTransition: the block is free and holds nothing, or
                was invalidated.
        """
        self._check_id(block)
        was = self.state[block]
        self._apply(block, Event.LEASE)
        if was is BlockState.CACHED:
            self._free.remove(block)
        self.ref_count[block] += 1

    def release(self, block: int, *, priority: int = 0, group: object | None = None) -> None:
        """Drop a reference. At 0 a published block becomes evictable (``CACHED``) at the most
        recently used end of the queue of its priority; a block that caches nothing (or was
        invalidated) becomes ``FREE``, at the front of the empty queue, to be reused first.

        ``priority`` is the block's reuse value: evictable blocks of a higher priority are evicted
        only after every lower-priority one. A shared block takes the highest priority given by
        the releases since it last left the free queue; it has no effect on an unpublished block.

        ``group`` (any hashable, on the last release) ties blocks only worth keeping together,
        e.g. the window pages behind one resume boundary: the pool gives up whole groups one at a
        time instead of a page of every group (case C5; :meth:`FreeBlockQueue.evict`).

        Raises:
            RuntimeError: the id is the sentinel or out of range.
            engine.cache.lifecycle.IllegalTransition: the block is not leased (a double free);
                nothing changes.
        """
        self._check_id(block)
        rc = self.ref_count[block]
        if rc > 1:
            event = Event.RELEASE
        elif self.state[block] is BlockState.INVALID:
            event = Event.RECLAIM
        else:
            event = Event.RELEASE_LAST
        new = self._apply(block, event)
        self.ref_count[block] = rc - 1
        if event is Event.RELEASE:
            self._held_priority[block] = max(self._held_priority.get(block, priority), priority)
            return
        priority = max(self._held_priority.pop(block, priority), priority)
        if new is BlockState.CACHED:
            self._free.push_evictable(block, priority, group)
            if self.max_cached is not None:  # only while a cap is set: release stays O(1)
                self._trim()
        else:
            self._free.push_empty(block)

    def limit_cached(self, max_cached: int | None) -> int:
        """Keep at most ``max_cached`` evictable blocks from now on (None lifts the cap), evicting
        the excess at once in the usual victim order; returns how many were evicted. The pool then
        behaves as one whose spare capacity shrank (operators shrink a pool this way; so does the
        ``up --squeeze-window-pool`` drill). Leased blocks are never touched.

        Raises:
            ValueError: a negative cap.
        """
        if max_cached is not None and max_cached < 0:
            raise ValueError(f"{self.name}: max_cached must be >= 0 or None, got {max_cached}")
        self.max_cached = max_cached
        return self._trim()

    def _trim(self) -> int:
        evicted = 0
        while self.max_cached is not None and self._free.num_evictable > self.max_cached:
            self._evict(self._free.next_victim())
            evicted += 1
        return evicted

    def publish(self, block: int, h: BlockHash) -> bool:
        """Make a leased, fully written block findable under ``h`` (``WRITING → RESIDENT``).

        Returns False (and leaves the block unpublished) when another block already caches
        ``h``; the existing one is kept.

        Raises:
            RuntimeError: the id is the sentinel or out of range.
            engine.cache.lifecycle.IllegalTransition: the block is not leased, already
                published or invalidated; nothing changes.
        """
        self._check_id(block)
        rule(self.name, block, self.state[block], Event.PUBLISH)
        if h in self._cached:
            return False
        self._apply(block, Event.PUBLISH)
        self._hashes.add(block, h)
        self._on_publish(h)
        if self.observer is not None:
            self.observer("stored", h, block)
        return True

    def evict(self, block: int) -> None:
        """Evict one evictable block now (``CACHED → FREE``), as an allocation would: its object
        is copied down first when the pool has lower tiers, and ``evictions`` counts it.

        Raises:
            RuntimeError: the id is the sentinel or out of range.
            engine.cache.lifecycle.IllegalTransition: the block is not ``CACHED``.
        """
        self._check_id(block)
        rule(self.name, block, self.state[block], Event.EVICT)
        self._evict(block)

    def invalidate(self, block: int) -> None:
        """Withdraw a published block: it stops being findable (``on_evict`` is called) and its
        epoch is bumped. A ``CACHED`` block becomes ``FREE`` at once (front of the empty queue);
        a ``RESIDENT`` one becomes ``INVALID`` until its last lease is released, then ``FREE``.
        The holders detect the change by its epoch. Not counted as an eviction.

        Raises:
            RuntimeError: the id is the sentinel or out of range.
            engine.cache.lifecycle.IllegalTransition: the block is not published (``FREE``,
                ``WRITING``) or already ``INVALID``; nothing changes.
        """
        self._check_id(block)
        was = self.state[block]
        self._apply(block, Event.INVALIDATE)
        if was is BlockState.CACHED:
            self._free.remove(block)
            self._free.push_empty(block)
        h = self._hashes.remove(block, self.state[block])
        if self.tiers is not None:
            self.tiers.drop(self.name, h)
        self._on_evict(h)
        if self.observer is not None:
            self.observer("removed", h, block)

    # -- internals -----------------------------------------------------------------------------
    def _apply(self, block: int, event: Event) -> BlockState:
        return transition(self.state, self.epoch, block, event, owner=self.name)

    def _check_id(self, block: int) -> None:
        if not 0 < block < self.num_blocks:
            raise RuntimeError(f"{self.name}: block id {block} is the sentinel or out of range")

    def _evict(self, block: int) -> None:
        """``CACHED → FREE``: the block moves to the front of the empty queue; ``on_evict`` is
        called last, so the pool is consistent if it raises. With lower tiers the block's object
        is first copied down (its bytes are intact until this returns)."""
        if self.tiers is not None:
            h = self.block_hash[block]
            assert h is not None
            self.tiers.offload(self, block, h)
        self._apply(block, Event.EVICT)
        self._free.evict(block)  # the rest of its eviction group goes next
        self._free.push_empty(block)
        h = self._hashes.remove(block, self.state[block])
        self.evictions += 1
        self._hashes.evicted.record(h, self.evictions, self._free.priority(block))
        self._on_evict(h)
        if self.observer is not None:
            self.observer("removed", h, block)

    # -- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Check that every block's state agrees with its ref count, free-queue membership and
        the hash map: ``FREE`` ⇒ ref 0, unpublished, in the empty queue; ``WRITING`` ⇒ ref > 0,
        unpublished; ``RESIDENT`` ⇒ ref > 0, published; ``CACHED`` ⇒ ref 0, published, in the
        queue of its priority; ``INVALID`` ⇒ ref > 0, unpublished (the sentinel: ref 0, never
        anything else). No block is in two queues or in a queue it should not be in; the hash
        map is a bijection onto the published blocks.

        Raises:
            AssertionError: naming the pool, the block and its state.
        """
        S = BlockState
        n = self.name

        def fail(msg: str) -> NoReturn:
            raise AssertionError(f"{n}: {msg}")

        self._free.check_invariants(self.state)

        b0 = SENTINEL_BLOCK
        if (self.state[b0], self.ref_count[b0], self.block_hash[b0], self.epoch[b0]) != (S.INVALID, 0, None, 0):
            fail(f"sentinel block {b0} {self.state[b0]} is owned (ref {self.ref_count[b0]}, epoch {self.epoch[b0]})")

        for b in range(1, self.num_blocks):
            st, rc, h = self.state[b], self.ref_count[b], self.block_hash[b]
            if st is S.FREE or st is S.CACHED:
                ok = rc == 0 and (h is None) == (st is S.FREE)
            elif st is S.WRITING or st is S.RESIDENT or st is S.INVALID:
                ok = rc > 0 and (h is None) != (st is S.RESIDENT)
            else:
                fail(f"block {b} {st}: this pool has no lower tier")
            if not ok:
                fail(f"block {b} {st} disagrees: ref {rc}, {'hash ' + h.hex() if h is not None else 'unpublished'}")
            if b in self._held_priority and rc == 0:
                fail(f"block {b} {st}: held priority kept at ref 0")
        self._hashes.check_invariants(self.state)
