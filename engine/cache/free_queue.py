"""The free queue of one block pool: the blocks with ref count 0, in the order they are handed out.

Modelled on vLLM v1's ``FreeKVCacheBlockQueue``, with reuse priorities and eviction groups on
top. Blocks with ref count 0 wait in two kinds of queue: the *empty* queue (``FREE``:
unpublished, holds nothing), always handed out first, most recently freed first; and one LRU
queue per *priority* (``CACHED``: published, evictable). An allocation that finds no empty block
evicts the least recently released block of the lowest priority present, so a block released
with a higher priority outlives every lower-priority evictable block (e.g. the window tail and
checkpoints of each cached boundary are evicted last). With the default priority 0 the order is
plain LRU by release, as in vLLM v1's free-block queue.

Eviction groups tie evictable blocks that are only worth keeping together (e.g. the window pages
behind one resume boundary): when one is evicted, the rest are demoted to the front of the
lowest-priority queue (case C5).

Every evictable block carries an order key, ascending from the front of its queue, so the number
of blocks evicted before a given one is a sum over the lower priorities plus one bisection.

This queue only orders blocks; their lifecycle states, ref counts and hashes belong to
:class:`engine.cache.block_pool.BlockPool`, which moves a block between the queues.
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NoReturn

from engine.cache.lifecycle import BlockState


class FreeBlockQueue:
    """The empty queue and the per-priority LRU queues of the blocks ``1 … num_blocks − 1`` of
    one pool (block 0, the sentinel, is never queued). Every block starts empty.

    ``peek_empty``, ``take_empty``, ``push_empty``, ``push_evictable`` and ``remove`` are O(1)
    plus O(log P) heap work for P distinct priorities in use.

    Args:
        name: the pool's name, used in messages.
        num_blocks: total ids of the pool, the sentinel included.
    """

    def __init__(self, name: str, num_blocks: int) -> None:
        self.name = name
        self._empty: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._evictable: dict[int, OrderedDict[int, None]] = {}  # priority → LRU queue, never empty
        self._order: dict[int, int] = {}  # evictable block → its order key in its queue (front: lowest)
        self._order_keys: dict[int, list[int]] = {}  # priority → its queue's order keys, ascending
        self._order_ends = [0, 0]  # the lowest and highest order key handed out
        self._levels: list[int] = []  # min-heap of priorities, possibly with emptied ones
        self._in_levels: set[int] = set()
        self._num_evictable = 0
        self._priority = [0] * num_blocks  # the queue an evictable block sits (or last sat) in
        self._group_of: dict[int, object] = {}  # evictable block → its eviction group
        self._members: dict[object, set[int]] = {}  # eviction group → its evictable blocks

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_empty(self) -> int:
        """Blocks in the empty queue."""
        return len(self._empty)

    @property
    def num_evictable(self) -> int:
        """Blocks in the priority queues."""
        return self._num_evictable

    def is_empty(self, block: int) -> bool:
        """Whether ``block`` is in the empty queue."""
        return block in self._empty

    def priority(self, block: int) -> int:
        """The priority of the queue ``block`` sits in (or last sat in, once it left)."""
        return self._priority[block]

    def next_victim(self) -> int:
        """The least recently released evictable block of the lowest priority present.

        Raises:
            IndexError: no block is evictable.
        """
        while self._levels[0] not in self._evictable:
            self._in_levels.discard(heapq.heappop(self._levels))
        return next(iter(self._evictable[self._levels[0]]))

    def evicted_before(self, blocks: Iterable[int], room: int) -> int:
        """How many allocations are served before the first of the evictable ``blocks`` is
        evicted: ``room`` (empty blocks an allocation may take first) plus the evictable blocks
        ahead of it (lower priorities, then those ahead in its queue); with no ``blocks``, every
        evictable block. O(len(blocks) + priorities + log n).

        Read as the spare capacity of the pool it is part of (:meth:`BlockPool.spare_blocks`), this
        is an estimate read off the pool as it is now (the mirror of the ghost depth, by LRU's
        inclusion property, Mattson et al. 1970): a pool that much smaller all along would have had
        its own history — leases taken and dropped, blocks freed — so it can be more than the pool
        could really have spared."""
        first = min(((self._priority[b], self._order[b]) for b in blocks), default=None)
        if first is None:
            return room + self._num_evictable
        priority, order = first
        ahead = sum(len(q) for p, q in self._evictable.items() if p < priority)
        return room + ahead + bisect.bisect_left(self._order_keys[priority], order)

    # -- moves ---------------------------------------------------------------------------------
    def peek_empty(self) -> int:
        """The empty block handed out next (the most recently freed).

        Raises:
            StopIteration: the empty queue is empty.
        """
        return next(iter(self._empty))

    def take_empty(self, block: int) -> None:
        """Take ``block`` out of the empty queue."""
        del self._empty[block]

    def push_empty(self, block: int) -> None:
        """Put ``block`` at the front of the empty queue: it is handed out first."""
        self._empty[block] = None
        self._empty.move_to_end(block, last=False)

    def push_evictable(self, block: int, priority: int, group: object | None = None) -> None:
        """Put ``block`` at the most recently used end of the queue of ``priority``, in the
        eviction group ``group`` (any hashable; None: none)."""
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
        if group is not None:
            self._group_of[block] = group
            self._members.setdefault(group, set()).add(block)

    def remove(self, block: int) -> None:
        """Take an evictable ``block`` out of its queue and its eviction group (it was leased or
        invalidated)."""
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

    def evict(self, block: int) -> None:
        """Take an evictable ``block`` out as it is evicted: the rest of its eviction group is
        worth little now, so its other members leave the group for the front of the
        lowest-priority queue (they go next)."""
        group = self._group_of.get(block)
        self.remove(block)
        if group is not None:
            for other in sorted(self._members.get(group, ()), reverse=True):
                self.remove(other)
                self.push_evictable(other, min(self._evictable or [0]))
                self._to_front(other)

    def _to_front(self, block: int) -> None:
        """Move an evictable block to the front of its queue: it is evicted next."""
        priority = self._priority[block]
        self._evictable[priority].move_to_end(block, last=False)
        keys = self._order_keys[priority]
        del keys[bisect.bisect_left(keys, self._order[block])]
        self._order_ends[0] -= 1
        self._order[block] = self._order_ends[0]
        keys.insert(0, self._order_ends[0])

    # -- invariants ----------------------------------------------------------------------------
    def check_invariants(self, state: Sequence[BlockState]) -> None:
        """Check that the queues agree with the pool's ``state`` per block: a ``FREE`` block is
        in the empty queue, a ``CACHED`` one in the queue of its priority, any other (the
        sentinel's ``INVALID`` included) in none; that no priority queue is kept while empty; and
        that the evictable count, the priority heap, the eviction groups and the order keys agree
        with the queues.

        Raises:
            AssertionError: naming the pool, the block and its state.
        """

        def fail(msg: str) -> NoReturn:
            raise AssertionError(f"{self.name}: {msg}")

        queued: dict[int, int | None] = dict.fromkeys(self._empty)  # block → priority (None: empty)
        for priority, queue in self._evictable.items():
            if not queue:
                fail(f"evictable queue of priority {priority} is kept while empty")
            for b in queue:
                if b in queued:
                    fail(f"block {b} {state[b]} is in two free queues")
                queued[b] = priority
        for b, st in enumerate(state):
            expected = None if st is BlockState.FREE else self._priority[b] if st is BlockState.CACHED else "none"
            found = queued.get(b, "none")
            if found != expected:
                fail(f"block {b} {st} is in free queue {'empty' if found is None else found}, expected {'empty' if expected is None else expected}")
        if self._num_evictable != sum(len(q) for q in self._evictable.values()):
            fail(f"evictable count {self._num_evictable} disagrees with the queues")
        levels = set(self._levels)
        if not set(self._evictable) <= levels or levels != self._in_levels or len(levels) != len(self._levels):
            fail(f"priority heap {sorted(self._levels)} disagrees with the queues {sorted(self._evictable)}")

        for b, group in self._group_of.items():
            if state[b] is not BlockState.CACHED or b not in self._members.get(group, ()):
                fail(f"block {b} {state[b]} is in an eviction group while not cached")
        if sum(len(m) for m in self._members.values()) != len(self._group_of):
            fail("eviction groups disagree with their members")

        for priority, queue in self._evictable.items():
            if [self._order[b] for b in queue] != self._order_keys.get(priority):
                fail(f"the order keys of priority {priority} do not follow its queue")
        if set(self._order) != {b for q in self._evictable.values() for b in q} or set(self._order_keys) != set(self._evictable):
            fail("order keys held for blocks or priorities that are not evictable")
