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
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import NoReturn, Protocol

from engine.cache.hashing import BlockHash
from engine.cache.lifecycle import BlockState, Event, rule, transition

SENTINEL_BLOCK = 0

EVICTED_MEMORY_FACTOR = 8
"""A pool remembers the hashes of its last ``8 × num_blocks`` evictions, to tell a block that was
evicted from one that was never stored."""


class LowerTiers(Protocol):
    """What a pool needs of the host/disk tiers (:class:`engine.cache.tiers.TierStore`)."""

    version: int

    def readable(self, pool: str, h: BlockHash) -> object | None:
        """The verified-on-write entry of ``pool`` cached under ``h`` (``OFFLOADED``), if any."""
        ...

    def offload(self, pool: BlockPool, block: int, h: BlockHash) -> None:
        """Copy a cached block's object down before the block is reused (write-back)."""
        ...

    def drop(self, pool: str, h: BlockHash) -> None:
        """Forget the lower-tier copy of an object declared wrong."""
        ...


class PoolExhausted(RuntimeError):
    """Every block of the pool is leased; nothing can be evicted to serve an allocation."""


class BlockPool:
    """Block ids ``1 … num_blocks − 1`` of one form (id 0 is the sentinel, permanently
    ``INVALID``).

    Free queue. Blocks with ref count 0 wait in two kinds of queue: the *empty* queue
    (``FREE``: unpublished, holds nothing), always handed out first, most recently freed
    first; and one LRU queue per *priority* (``CACHED``: published, evictable). An allocation
    that finds no empty block evicts the least recently released block of the lowest priority
    present, so a block released with a higher priority outlives every lower-priority evictable
    block (e.g. the window tail and checkpoints of each cached boundary are evicted last). With
    the default priority 0 the order is plain LRU by release, as in vLLM v1's free-block queue.
    ``allocate``, ``lease`` and ``release`` are O(1) plus O(log P) heap work for P distinct
    priorities in use.

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
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._empty: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._evictable: dict[int, OrderedDict[int, None]] = {}  # priority → LRU queue, never empty
        self._order: dict[int, int] = {}  # evictable block → its order key in its queue (front: lowest)
        self._order_keys: dict[int, list[int]] = {}  # priority → its queue's order keys, ascending
        self._order_ends = [0, 0]  # the lowest and highest order key handed out
        self._levels: list[int] = []  # min-heap of priorities, possibly with emptied ones
        self._in_levels: set[int] = set()
        self._num_evictable = 0
        self._priority = [0] * num_blocks  # the queue a CACHED block sits in
        self._held_priority: dict[int, int] = {}  # highest priority given by earlier releases
        self._group_of: dict[int, object] = {}  # CACHED block → its eviction group
        self._members: dict[object, set[int]] = {}  # eviction group → its CACHED blocks
        self._on_publish = on_publish
        self._on_evict = on_evict
        self.version = 0
        """Bumped whenever the hash → block map changes (publish, evict, invalidate): readers
        may memoise what they found under one version."""
        self.observer: Callable[[str, BlockHash, int], None] | None = None
        """Optional audit hook, called as ``observer(action, hash, block)`` after a block is
        published (``"stored"``) or stops being cached (``"removed"``: evicted or invalidated)."""
        self.evictions = 0
        self.tiers: LowerTiers | None = None
        """The host/disk tiers every evicted block is copied down to (None: no tiers)."""
        self.tier_view = False
        """When True, :meth:`present` also counts objects held by the lower tiers (the cache
        sets it while it plans a resume that would swap them in)."""
        self._evicted: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()  # hash → (eviction number, priority), oldest first
        self._ghosts: dict[int, list[int]] = {}  # priority → eviction numbers of the remembered hashes, ascending
        self._evicted_memory = EVICTED_MEMORY_FACTOR * num_blocks
        self.max_cached: int | None = None
        """Most evictable (``CACHED``) blocks kept; beyond it a released block evicts the least
        valuable one at once, as a smaller pool would (None: no cap). See :meth:`limit_cached`."""

    # -- queries -------------------------------------------------------------------------------
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
        ``h`` was not evicted recently, or was stored again since). That is its place among the
        remembered evictions, newest first, counting only those of its priority or higher (a
        larger pool still evicts lower-priority blocks before it) — the LRU stack distance beyond
        the pool's size read off a ghost list (ARC's ghost entries, Megiddo and Modha, FAST 2003;
        stack distances, Mattson et al., IBM Systems Journal 1970): exact for one LRU queue, an
        estimate under eviction groups. O(priorities × log(remembered evictions))."""
        entry = self._evicted.get(h)
        if entry is None:
            return None
        number, priority = entry
        return 1 + sum(len(seqs) - bisect.bisect_right(seqs, number) for p, seqs in self._ghosts.items() if p >= priority)

    def spare_blocks(self, hashes: Iterable[BlockHash]) -> int | None:
        """How many blocks smaller this pool could be now and still hold every one of ``hashes``
        it caches: the room left before an eviction (empty blocks, or what a cap leaves) plus the
        evictable blocks evicted before the first of them to go (lower priorities, then those
        ahead in its queue); a leased block outlives every evictable one. None: it caches none of
        them. An estimate read off the pool as it is now (the mirror of :meth:`ghost_depth`, by
        LRU's inclusion property, Mattson et al. 1970): a pool that much smaller all along would
        have had its own history — leases taken and dropped, blocks freed — so this can be more
        than it could really have spared. O(len(hashes) + priorities + log n)."""
        first: tuple[int, int, int] | None = None  # (leased, priority, order key) of the first to go
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                continue
            key = (1, 0, 0) if self.ref_count[block] > 0 else (0, self._priority[block], self._order[block])
            if first is None or key < first:
                first = key
        if first is None:
            return None
        room = len(self._empty) if self.max_cached is None else max(0, min(len(self._empty), self.max_cached - self._num_evictable))
        if first[0]:
            return room + self._num_evictable
        _, priority, order = first
        ahead = sum(len(q) for p, q in self._evictable.items() if p < priority)
        return room + ahead + bisect.bisect_left(self._order_keys[priority], order)

    def _forget(self, number: int, priority: int) -> None:
        seqs = self._ghosts[priority]
        del seqs[bisect.bisect_left(seqs, number)]
        if not seqs:
            del self._ghosts[priority]

    def was_evicted(self, h: BlockHash) -> bool:
        """Whether a block cached under ``h`` was evicted recently (and not stored again since).
        An invalidated block does not count."""
        return h in self._evicted

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take (evictable cached ones included)."""
        return len(self._empty) + self._num_evictable

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
        if not self._empty:
            if not self._num_evictable:
                raise PoolExhausted(f"{self.name}: all {self.num_blocks - 1} blocks are leased")
            self._evict(self._next_victim())
        block = next(iter(self._empty))
        self._apply(block, Event.ALLOCATE)
        del self._empty[block]
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
            self._dequeue(block)
        self.ref_count[block] += 1

    def release(self, block: int, *, priority: int = 0, group: object | None = None) -> None:
        """Drop a reference. At 0 a published block becomes evictable (``CACHED``) at the most
        recently used end of the queue of its priority; a block that caches nothing (or was
        invalidated) becomes ``FREE``, at the front of the empty queue, to be reused first.

        ``priority`` is the block's reuse value: evictable blocks of a higher priority are evicted
        only after every lower-priority one. A shared block takes the highest priority given by
        the releases since it last left the free queue; it has no effect on an unpublished block.

        ``group`` (any hashable, on the last release) ties blocks that are only worth keeping
        together, e.g. the window pages behind one resume boundary: when one of them is evicted,
        the others still cached are demoted to the front of the lowest-priority queue, so the
        pool gives up whole groups one at a time instead of a page of every group (case C5).

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
            self._enqueue(block, priority)
            if group is not None:
                self._group_of[block] = group
                self._members.setdefault(group, set()).add(block)
            if self.max_cached is not None:  # only while a cap is set: release stays O(1)
                self._trim()
        else:
            self._free_front(block)

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
        while self.max_cached is not None and self._num_evictable > self.max_cached:
            self._evict(self._next_victim())
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
        self.block_hash[block] = h
        self._cached[h] = block
        self.version += 1
        forgotten = self._evicted.pop(h, None)
        if forgotten is not None:
            self._forget(*forgotten)
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
            self._dequeue(block)
            self._free_front(block)
        h = self._unpublish(block)
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

    def _next_victim(self) -> int:
        """The least recently released evictable block of the lowest priority present."""
        while self._levels[0] not in self._evictable:
            self._in_levels.discard(heapq.heappop(self._levels))
        return next(iter(self._evictable[self._levels[0]]))

    def _levels_present(self) -> list[int]:
        return list(self._evictable) or [0]

    def _enqueue(self, block: int, priority: int) -> None:
        queue = self._evictable.get(priority)
        if queue is None:
            queue = self._evictable[priority] = OrderedDict()
            if priority not in self._in_levels:
                self._in_levels.add(priority)
                heapq.heappush(self._levels, priority)
        queue[block] = None
        self._priority[block] = priority
        self._num_evictable += 1
        self._order_ends[1] += 1
        self._order[block] = self._order_ends[1]
        self._order_keys.setdefault(priority, []).append(self._order_ends[1])  # the highest: stays sorted

    def _to_front(self, block: int) -> None:
        """Move an evictable block to the front of its queue: it is evicted next."""
        priority = self._priority[block]
        self._evictable[priority].move_to_end(block, last=False)
        keys = self._order_keys[priority]
        del keys[bisect.bisect_left(keys, self._order[block])]
        self._order_ends[0] -= 1
        self._order[block] = self._order_ends[0]
        keys.insert(0, self._order_ends[0])

    def _dequeue(self, block: int) -> None:
        group = self._group_of.pop(block, None)
        if group is not None:
            members = self._members[group]
            members.discard(block)
            if not members:
                del self._members[group]
        priority = self._priority[block]
        queue = self._evictable[priority]
        del queue[block]
        keys = self._order_keys[priority]
        del keys[bisect.bisect_left(keys, self._order.pop(block))]
        if not queue:
            del self._evictable[priority]  # its heap entry is dropped lazily
            del self._order_keys[priority]
        self._num_evictable -= 1

    def _free_front(self, block: int) -> None:
        self._empty[block] = None
        self._empty.move_to_end(block, last=False)

    def _unpublish(self, block: int) -> BlockHash:
        h = self.block_hash[block]
        if h is None:
            raise AssertionError(f"{self.name}: block {block} {self.state[block]} has no hash")
        del self._cached[h]
        self.block_hash[block] = None
        self.version += 1
        return h

    def _evict(self, block: int) -> None:
        """``CACHED → FREE``: the block moves to the front of the empty queue; ``on_evict`` is
        called last, so the pool is consistent if it raises. With lower tiers the block's object
        is first copied down (its bytes are intact until this returns)."""
        if self.tiers is not None:
            h = self.block_hash[block]
            assert h is not None
            self.tiers.offload(self, block, h)
        group = self._group_of.get(block)
        self._apply(block, Event.EVICT)
        self._dequeue(block)
        self._free_front(block)
        if group is not None:  # the rest of the group is worth little now: it goes next
            for other in sorted(self._members.get(group, ()), reverse=True):
                self._dequeue(other)
                self._enqueue(other, min(self._levels_present()))
                self._to_front(other)
        h = self._unpublish(block)
        self.evictions += 1
        priority = self._priority[block]
        self._evicted[h] = (self.evictions, priority)
        self._ghosts.setdefault(priority, []).append(self.evictions)  # numbers only grow: stays sorted
        if len(self._evicted) > self._evicted_memory:
            self._forget(*self._evicted.popitem(last=False)[1])
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

        queued: dict[int, int | None] = dict.fromkeys(self._empty)  # block → priority (None: empty)
        for priority, queue in self._evictable.items():
            if not queue:
                fail(f"evictable queue of priority {priority} is kept while empty")
            for b in queue:
                if b in queued:
                    fail(f"block {b} {self.state[b]} is in two free queues")
                queued[b] = priority
        if self._num_evictable != sum(len(q) for q in self._evictable.values()):
            fail(f"evictable count {self._num_evictable} disagrees with the queues")
        levels = set(self._levels)
        if not set(self._evictable) <= levels or levels != self._in_levels or len(levels) != len(self._levels):
            fail(f"priority heap {sorted(self._levels)} disagrees with the queues {sorted(self._evictable)}")

        for b, group in self._group_of.items():
            if self.state[b] is not S.CACHED or b not in self._members.get(group, ()):
                fail(f"block {b} {self.state[b]} is in an eviction group while not cached")
        if sum(len(m) for m in self._members.values()) != len(self._group_of):
            fail("eviction groups disagree with their members")

        b0 = SENTINEL_BLOCK
        if (self.state[b0], self.ref_count[b0], self.block_hash[b0], self.epoch[b0]) != (S.INVALID, 0, None, 0) or (
            b0 in queued
        ):
            fail(f"sentinel block {b0} {self.state[b0]} is owned (ref {self.ref_count[b0]}, epoch {self.epoch[b0]})")

        published = 0
        for b in range(1, self.num_blocks):
            st, rc, h = self.state[b], self.ref_count[b], self.block_hash[b]
            if st is S.FREE:
                ok = rc == 0 and h is None and b in self._empty
            elif st is S.WRITING:
                ok = rc > 0 and h is None and b not in queued
            elif st is S.RESIDENT:
                ok = rc > 0 and h is not None and b not in queued
            elif st is S.CACHED:
                ok = rc == 0 and h is not None and queued.get(b) == self._priority[b] and b not in self._empty
            elif st is S.INVALID:
                ok = rc > 0 and h is None and b not in queued
            else:
                fail(f"block {b} {st}: this pool has no lower tier")
            if not ok:
                fail(
                    f"block {b} {st} disagrees: ref {rc}, "
                    f"{'hash ' + h.hex() if h is not None else 'unpublished'}, "
                    f"queue {'empty' if b in self._empty else queued.get(b, 'none')}"
                )
            if b in self._held_priority and rc == 0:
                fail(f"block {b} {st}: held priority kept at ref 0")
            if h is not None:
                published += 1
                if self._cached.get(h) != b:
                    fail(f"block {b} {st}: hash {h.hex()} maps to block {self._cached.get(h)}")
        if published != len(self._cached):
            fail(f"hash map has {len(self._cached)} entries for {published} published blocks")
        for priority, queue in self._evictable.items():
            if [self._order[b] for b in queue] != self._order_keys.get(priority):
                fail(f"the order keys of priority {priority} do not follow its queue")
        if set(self._order) != {b for q in self._evictable.values() for b in q} or set(self._order_keys) != set(self._evictable):
            fail("order keys held for blocks or priorities that are not evictable")
        ghosts = sorted((n, p) for p, seqs in self._ghosts.items() for n in seqs)
        if ghosts != sorted(self._evicted.values()) or any(seqs != sorted(seqs) for seqs in self._ghosts.values()):
            fail("the ghost index does not match the eviction memory")
        if len(self._evicted) > self._evicted_memory or any(h in self._cached for h in self._evicted):
            fail("eviction memory holds a cached hash or is over its size")
