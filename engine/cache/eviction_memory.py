"""A pool's memory of its recent evictions: a ghost list of block hashes.

A pool remembers the hash of every block it evicted, with the eviction's number and the
priority the block was evicted from, until the hash is stored again or the memory is full
(oldest forgotten first). It tells an evicted block from one never stored (the reason codes
``*_evicted`` vs ``below_granularity``) and how much larger the pool would have had to be to
still hold it (:meth:`EvictionMemory.depth`).

Sources: ARC's ghost entries (Megiddo and Modha, FAST 2003); LRU stack distances (Mattson et al.,
IBM Systems Journal 1970).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Container, Iterator
from typing import NoReturn

from engine.cache.hashing import BlockHash


class EvictionMemory:
    """The hashes of the last ``capacity`` evictions of one pool, oldest first.

    Args:
        name: the pool's name, used in messages.
        capacity: most hashes remembered.
    """

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self._evicted: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()  # hash → (eviction number, priority), oldest first
        self._ghosts: dict[int, list[int]] = {}  # priority → eviction numbers of the remembered hashes, ascending

    def __contains__(self, h: object) -> bool:
        """Whether ``h`` was evicted recently and not stored again since."""
        return h in self._evicted

    def __len__(self) -> int:
        return len(self._evicted)

    def __iter__(self) -> Iterator[BlockHash]:
        """The remembered hashes, oldest eviction first."""
        return iter(self._evicted)

    def record(self, h: BlockHash, number: int, priority: int) -> None:
        """Remember that eviction number ``number`` (numbers only grow) evicted ``h`` from the
        queue of ``priority``; forget the oldest eviction beyond the capacity."""
        self._evicted[h] = (number, priority)
        self._ghosts.setdefault(priority, []).append(number)  # numbers only grow: stays sorted
        if len(self._evicted) > self.capacity:
            self._drop(*self._evicted.popitem(last=False)[1])

    def forget(self, h: BlockHash) -> None:
        """Forget ``h`` (it is stored again); nothing happens when it is not remembered."""
        forgotten = self._evicted.pop(h, None)
        if forgotten is not None:
            self._drop(*forgotten)

    def depth(self, h: BlockHash) -> int | None:
        """How many more cached blocks the pool would have needed to still hold ``h`` (None:
        not remembered): its place among the remembered evictions, newest first, counting only
        those of its priority or higher (a larger pool still evicts lower-priority blocks before
        it). Exact for one LRU queue, an estimate under eviction groups.
        O(priorities × log(remembered evictions))."""
        entry = self._evicted.get(h)
        if entry is None:
            return None
        number, priority = entry
        return 1 + sum(len(seqs) - bisect.bisect_right(seqs, number) for p, seqs in self._ghosts.items() if p >= priority)

    def _drop(self, number: int, priority: int) -> None:
        seqs = self._ghosts[priority]
        del seqs[bisect.bisect_left(seqs, number)]
        if not seqs:
            del self._ghosts[priority]

    def check_invariants(self, cached: Container[BlockHash]) -> None:
        """Check that the per-priority index matches the remembered evictions, that the memory is
        within its capacity and that it holds no hash in ``cached`` (the pool's hash map).

        Raises:
            AssertionError: naming the pool.
        """

        def fail(msg: str) -> NoReturn:
            raise AssertionError(f"{self.name}: {msg}")

        ghosts = sorted((n, p) for p, seqs in self._ghosts.items() for n in seqs)
        if ghosts != sorted(self._evicted.values()) or any(seqs != sorted(seqs) for seqs in self._ghosts.values()):
            fail("the ghost index does not match the eviction memory")
        if len(self._evicted) > self.capacity or any(h in cached for h in self._evicted):
            fail("eviction memory holds a cached hash or is over its size")
