"""The entries of the host and disk tiers: which copies exist, in which tier and state, and how
many bytes each tier holds (DESIGN.md §3 "Tiers", §4).

Every copy of a cached object below the device is a :class:`TierEntry`, indexed by its pool and
prefix hash, with a row in a state array and an epoch array that the lifecycle table of
:mod:`engine.cache.lifecycle` drives (``SWAPPING_OUT → OFFLOADED → SWAPPING_IN → OFFLOADED``;
dropped: ``FREE``). Each tier keeps its entries in LRU order and counts their bytes against its
capacity. A :class:`SwapIn` records one copy of an entry back into a device block.

:class:`TierEntries` is the bookkeeping only; what is copied down, moved on, dropped or swapped
in is decided by :class:`engine.cache.tiers.TierStore`.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from torch import Tensor

from engine.cache.block_pool import BlockPool
from engine.cache.forms import Stamp
from engine.cache.hashing import BlockHash
from engine.cache.lifecycle import BlockState, Event, transition
from engine.events import Reason, Tier


class TierView(Enum):
    """Which lower-tier entries a lookup counts as present (a swap-in away)."""

    READABLE = "readable"
    """Those that can be swapped in now (``OFFLOADED``): the tier view of a swap-in plan."""
    IN_FLIGHT = "in_flight"
    """Those being swapped in (``SWAPPING_IN``, not doomed): the device once they land."""
    READABLE_OR_IN_FLIGHT = "readable_or_in_flight"
    """Both: the tier view once the copies in flight land."""

@dataclass(slots=True, eq=False)
class TierEntry:
    """One object's copy in the host or disk tier."""

    row: int
    """Its row in the store's state and epoch arrays."""
    pool: str
    block_hash: BlockHash
    tier: Tier
    stamp: Stamp
    nbytes: int
    tensors: dict[str, Tensor] | None
    """The bytes in host memory: the host tier's copy, or a disk entry's staging copy until its
    file is written; None for a disk entry at rest."""
    path: Path | None = None
    fence: concurrent.futures.Future[None] | None = None
    """The copy in flight on this entry (a file write); the next copy waits for it."""
    doomed: bool = False
    """Dropped while a copy was in flight: freed when the copy ends."""


@dataclass(slots=True)
class SwapIn:
    """One swap-in in flight: the entry, the device block it fills, the copy's future (its
    result: None, or the reason the copy was refused)."""

    pool: BlockPool
    entry: TierEntry
    block: int
    future: concurrent.futures.Future[Reason | None]
    started: float = field(default_factory=time.perf_counter)
    published: bool = False
    """Set by :meth:`TierStore.finish_swap_in` when the block was published under the hash."""


class TierEntries:
    """The entries of both tiers, with their states, LRU order and byte counts.

    Args:
        host_bytes, disk_bytes: capacity of each tier in bytes (0: the tier is off).
    """

    def __init__(self, host_bytes: int, disk_bytes: int) -> None:
        self.capacity = {Tier.HOST: host_bytes, Tier.DISK: disk_bytes}
        """Bytes each tier may hold."""
        self.used = {Tier.HOST: 0, Tier.DISK: 0}
        """Bytes the entries of each tier hold (in flight included)."""
        self.entries: dict[tuple[str, BlockHash], TierEntry] = {}
        self.states: list[BlockState] = []
        """Lifecycle state per row."""
        self.epochs: list[int] = []
        """Epoch per row, bumped as the lifecycle table says."""
        self._free_rows: list[int] = []
        self._lru: dict[Tier, OrderedDict[TierEntry, None]] = {Tier.HOST: OrderedDict(), Tier.DISK: OrderedDict()}

    # -- queries ---------------------------------------------------------------------------------
    def get(self, pool: str, h: BlockHash) -> TierEntry | None:
        """The entry under ``(pool, h)`` in any state, if any."""
        return self.entries.get((pool, h))

    def state(self, entry: TierEntry) -> BlockState:
        return self.states[entry.row]

    def readable(self, pool: str, h: BlockHash) -> TierEntry | None:
        """The entry under ``(pool, h)`` when it can be swapped in now (``OFFLOADED``)."""
        entry = self.entries.get((pool, h))
        if entry is None or self.states[entry.row] is not BlockState.OFFLOADED or entry.doomed:
            return None
        return entry

    def in_flight(self, pool: str, h: BlockHash) -> bool:
        """Whether the entry under ``(pool, h)`` is being copied (down or up)."""
        entry = self.entries.get((pool, h))
        return entry is not None and self.states[entry.row] in (BlockState.SWAPPING_IN, BlockState.SWAPPING_OUT)

    def swapping_in(self, pool: str, h: BlockHash) -> TierEntry | None:
        """The entry under ``(pool, h)`` when it is being copied up (``SWAPPING_IN``) and not
        doomed (a doomed copy is refused when it ends)."""
        entry = self.entries.get((pool, h))
        if entry is None or self.states[entry.row] is not BlockState.SWAPPING_IN or entry.doomed:
            return None
        return entry

    def visible(self, pool: str, h: BlockHash, view: TierView) -> TierEntry | None:
        """The entry under ``(pool, h)`` a lookup in ``view`` counts as present."""
        if view is TierView.READABLE:
            return self.readable(pool, h)
        if view is TierView.IN_FLIGHT:
            return self.swapping_in(pool, h)
        return self.readable(pool, h) or self.swapping_in(pool, h)

    def victim(self, tier: Tier) -> TierEntry | None:
        """The least recently used entry of ``tier`` that can leave it now (``OFFLOADED``, no
        copy in flight)."""
        return next((e for e in self._lru[tier] if self.states[e.row] is BlockState.OFFLOADED and e.fence is None), None)

    def readable_hashes(self) -> Counter[BlockHash]:
        """Hashes the readable (or in swap-in) entries hold in the prefix index."""
        return Counter(
            e.block_hash for e in self.entries.values() if self.states[e.row] in (BlockState.OFFLOADED, BlockState.SWAPPING_IN)
        )

    # -- changes ---------------------------------------------------------------------------------
    def apply(self, entry: TierEntry, event: Event) -> BlockState:
        """Apply a lifecycle event to the entry's row (:func:`engine.cache.lifecycle.transition`).

        Raises:
            engine.cache.lifecycle.IllegalTransition: the table does not allow it.
        """
        return transition(self.states, self.epochs, entry.row, event, owner=f"{entry.tier} tier")

    def add(self, pool: str, h: BlockHash, tier: Tier, stamp: Stamp, nbytes: int, tensors: dict[str, Tensor] | None) -> TierEntry:
        """A new entry of ``tier`` under ``(pool, h)`` (none there yet), ``SWAPPING_OUT``, most
        recently used, its bytes counted (the caller made room)."""
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = len(self.states)
            self.states.append(BlockState.FREE)
            self.epochs.append(0)
        entry = TierEntry(row=row, pool=pool, block_hash=h, tier=tier, stamp=stamp, nbytes=nbytes, tensors=tensors)
        self.apply(entry, Event.SWAP_OUT_BEGIN)
        self.entries[(pool, h)] = entry
        self.used[tier] += nbytes
        self._lru[tier][entry] = None
        return entry

    def touch(self, entry: TierEntry) -> None:
        """Mark the entry most recently used in its tier."""
        self._lru[entry.tier].move_to_end(entry)

    def move(self, entry: TierEntry, tier: Tier) -> None:
        """Count the entry in ``tier`` from now on, most recently used there."""
        del self._lru[entry.tier][entry]
        self.used[entry.tier] -= entry.nbytes
        entry.tier = tier
        self.used[tier] += entry.nbytes
        self._lru[tier][entry] = None

    def forget(self, entry: TierEntry) -> None:
        """Remove the entry (its row is reused) and delete its file, unless a write of it is in
        flight (whoever completes the write deletes it); its host bytes are let go."""
        del self.entries[(entry.pool, entry.block_hash)]
        del self._lru[entry.tier][entry]
        self.used[entry.tier] -= entry.nbytes
        self._free_rows.append(entry.row)
        if entry.path is not None and entry.fence is None:  # a write in flight: poll deletes it
            entry.path.unlink(missing_ok=True)
        entry.tensors = None

    # -- invariants ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError unless bytes per tier match their entries and fit the capacity,
        every entry's state is a tier state, and the LRU queues hold exactly the entries."""
        seen = 0
        for tier, lru in self._lru.items():
            total = sum(e.nbytes for e in lru)
            assert total == self.used[tier], f"{tier} tier: {self.used[tier]} bytes counted, entries hold {total}"
            assert total <= self.capacity[tier], f"{tier} tier: {total} bytes over its {self.capacity[tier]}-byte capacity"
            for e in lru:
                assert e.tier is tier, f"{tier} tier: entry of {e.pool} filed under {e.tier}"
                state = self.states[e.row]
                assert state in (BlockState.SWAPPING_OUT, BlockState.OFFLOADED, BlockState.SWAPPING_IN), f"{tier} tier: entry in {state}"
                assert self.entries.get((e.pool, e.block_hash)) is e, f"{tier} tier: entry of {e.pool} not indexed"
                if tier is Tier.DISK and state is not BlockState.SWAPPING_OUT and e.fence is None:
                    assert e.tensors is None and e.path is not None and e.path.exists(), f"disk tier: {e.path} missing"
                seen += 1
        assert seen == len(self.entries), f"tiers: {len(self.entries)} entries, {seen} in the queues"
