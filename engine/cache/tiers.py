"""Host and disk tiers: copies of cached objects below the device (DESIGN.md §3 "Tiers", §4).

Every object a device pool evicts (a KV page, a compressed entry page, a tail or indexer slot, a
recurrent checkpoint) is copied down before its block is reused (write-back), first to ``host``
memory (pinned on CUDA) and, when the host tier is full, moved on to ``disk`` (one file per
object). A swap-in copies an object back into a freshly allocated device block; the tiers keep
their copy (inclusive), so the next eviction of the same object copies nothing. A swap-in's
destination block is leased by the swap-in and not findable until the copy is verified and the
main thread publishes it; an entry being read is ``SWAPPING_IN`` and a lookup that needs it
waits for its future or lowers L* with reason ``in_flight_swap``.

A restore whose checksum or fingerprint does not match drops the entry and reports
``offload_corrupt`` / ``layout_mismatch``: the request resumes lower, never from wrong bytes.
:meth:`TierStore.rebuild` finds the disk tier's objects again after a restart from the file
headers, skipping (and counting) unreadable, truncated, corrupted or mismatched files.

This module owns :class:`TierStore`, which decides what is copied down, moved on, dropped and
swapped in. Its parts live in their own modules and are re-exported here: the entries and their
states in :mod:`engine.cache.tier_entries`, the copies on worker threads in
:mod:`engine.cache.tier_copies`, the file format and directory in :mod:`engine.cache.tier_files`,
the calibration timing in :mod:`engine.cache.tier_calibration`.

Peer designs: vLLM's CPU offloading connector and SGLang's HiCache (host tier, write-back on
eviction, prefetch before scheduling); file format: safetensors.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cache import tier_files
from engine.cache.block_pool import BlockPool
from engine.cache.forms import ObjectStore
from engine.cache.hashing import BlockHash, PrefixIndex
from engine.cache.lifecycle import BlockState, Event
from engine.cache.tier_calibration import round_trip
from engine.cache.tier_copies import READ_WORKERS, SWAP_GATE_SECONDS, TierCopies
from engine.cache.tier_entries import SwapIn, TierEntries, TierEntry, TierView
from engine.cache.tier_files import (
    FILE_FORMAT,
    FILE_SUFFIX,
    HEADER_FIELDS,
    LOCK_FILE,
    DirectoryLock,
    fingerprint_text,
)
from engine.events import Reason, Tier

__all__ = ["FILE_FORMAT", "FILE_SUFFIX", "HEADER_FIELDS", "LOCK_FILE", "READ_WORKERS", "SWAP_GATE_SECONDS", "SwapIn",
           "TierEntry", "TierStore", "TierView", "fingerprint_text", "round_trip"]  # (what moved out is re-exported)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pool:
    store: ObjectStore
    fingerprints: dict[str, str]


class TierStore:
    """The host and disk tiers of one prefix cache.

    Args:
        host_bytes, disk_bytes: capacity of each tier (0: the tier is off).
        disk_dir: where the disk tier's files live (required when ``disk_bytes`` > 0).
        index: the prefix index: an entry counts as a holder of its hash while it is readable.
        device: the device of the pools (CUDA: pinned host memory and a side stream).
        corrupt_writes: fault injection — flip one byte of every file written.
        hold_swap_ins: fault injection — a swap-in's copy waits until :meth:`release` is called
            (so a read arrives while it is in flight).

    Raises:
        ValueError: a disk tier without a directory, or a directory that cannot be created.
    """

    def __init__(
        self,
        *,
        host_bytes: int,
        disk_bytes: int,
        disk_dir: Path | None,
        index: PrefixIndex,
        device: torch.device,
    ) -> None:
        if disk_bytes and disk_dir is None:
            raise ValueError("CacheConfig.disk_tier_bytes > 0 needs CacheConfig.disk_tier_dir (the disk tier's directory)")
        self._table = TierEntries(host_bytes, disk_bytes)
        # the table's own containers, read by the cache and the tests
        self.capacity, self.used, self.entries = self._table.capacity, self._table.used, self._table.entries
        self.states, self.epochs = self._table.states, self._table.epochs
        self.disk_dir = disk_dir
        self._lock = DirectoryLock(disk_dir) if disk_dir is not None and disk_bytes else None
        self.index = index
        self.device = device
        self.corrupt_writes = False
        self._pools: dict[str, _Pool] = {}
        self.version = 0
        """Bumped whenever the set of readable entries changes (or :attr:`view`)."""
        self.view = TierView.READABLE
        """Which entries :meth:`readable` gives: those that can be swapped in now, or (what a
        lookup would find once the copies in flight land) those being swapped in, or both.
        Whoever changes it bumps :attr:`version` on both edges."""
        self.observer: Callable[[str, str, BlockHash, Tier], None] | None = None
        """Optional audit hook, called as ``observer(action, pool, hash, tier)`` when an object
        becomes readable in a tier (``"offloaded"``) or is copied back up (``"restored"``)."""
        self.offloaded = Counter[Tier]()
        self.skipped = Counter[str]()
        """Files or copies refused, by reason (``offload_corrupt``, ``layout_mismatch``, ...)."""
        self._copies = TierCopies(device)

    # -- set-up ----------------------------------------------------------------------------------
    def attach(self, stores: Iterable[ObjectStore], fingerprints: dict[str, str]) -> None:
        """Serve these pools: every eviction is copied down, lookups may consult the tiers.
        ``fingerprints`` maps each stored tensor's name to :func:`fingerprint_text` of what its
        reader expects."""
        for store in stores:
            self._pools[store.pool.name] = _Pool(store, {t.name: fingerprints[t.name] for t in store.tensors})
            store.pool.tiers = self

    @property
    def enabled(self) -> dict[Tier, bool]:
        return {tier: cap > 0 for tier, cap in self.capacity.items()}

    @property
    def hold_swap_ins(self) -> bool:
        """Whether swap-ins wait for :meth:`release` (fault ``read_during_swap_in``)."""
        return self._copies.holding

    @hold_swap_ins.setter
    def hold_swap_ins(self, value: bool) -> None:
        self._copies.holding = value

    # -- queries ---------------------------------------------------------------------------------
    def readable(self, pool: str, h: BlockHash) -> TierEntry | None:
        """The entry under ``(pool, h)`` when it can be swapped in now (``OFFLOADED``), or, as
        :attr:`view` says, the one being swapped in (``SWAPPING_IN``, not doomed)."""
        return self._table.visible(pool, h, self.view)

    def in_flight(self, pool: str, h: BlockHash) -> bool:
        """Whether the entry under ``(pool, h)`` is being copied (down or up)."""
        return self._table.in_flight(pool, h)

    # -- copy down -------------------------------------------------------------------------------
    def offload(self, pool: BlockPool, block: int, h: BlockHash) -> None:
        """Copy the object of a cached ``block`` down (called just before the block is reused).
        Nothing happens when a tier already holds it, or when it fits no tier."""
        self.poll()
        entry = self.entries.get((pool.name, h))
        if entry is not None:  # a copy exists or is under way (a doomed one is freed when it ends)
            if not entry.doomed and self.states[entry.row] is BlockState.OFFLOADED:
                self._table.touch(entry)
            return
        self._copy_down(pool, block, h, (Tier.HOST, Tier.DISK))

    def offload_now(self, pool: BlockPool, block: int, h: BlockHash, tier: Tier) -> bool:
        """Copy a cached block's object straight to ``tier`` (an explicit offload; the device copy
        stays). Returns whether the tier holds it afterwards (a file write may still be running:
        see :meth:`flush`)."""
        entry = self.entries.get((pool.name, h))
        if entry is not None:
            if entry.doomed:
                return False
            if entry.tier is tier or tier is Tier.HOST:
                return True
            if self.states[entry.row] is BlockState.OFFLOADED and entry.fence is None and self._make_room(Tier.DISK, entry.nbytes):
                self._demote(entry)
                return True
            return False
        return self._copy_down(pool, block, h, (tier,))

    def _copy_down(self, pool: BlockPool, block: int, h: BlockHash, tiers: tuple[Tier, ...]) -> bool:
        """Snapshot ``block`` into a new entry of the first of ``tiers`` with room for it: a host
        entry is readable at once, a disk entry once its file is written. False when none fits."""
        reg = self._pools[pool.name]
        nbytes = sum(t.tensor[block].numel() * t.tensor.element_size() for t in reg.store.tensors)
        tier = next((t for t in tiers if self._make_room(t, nbytes)), None)
        if tier is None:
            return False
        staging = {t.name: self._copies.stage(t.tensor[block]) for t in reg.store.tensors}
        entry = self._table.add(pool.name, h, tier, reg.store.stamp(block), nbytes, staging)
        self.offloaded[tier] += 1
        if tier is Tier.HOST:
            self._publish(entry)
        else:
            self._write(entry)
        return True

    def _publish(self, entry: TierEntry) -> None:
        self._table.apply(entry, Event.SWAP_OUT_DONE)
        self.index.add(entry.block_hash)
        self.version += 1
        if self.observer is not None:
            self.observer("offloaded", entry.pool, entry.block_hash, entry.tier)

    def _make_room(self, tier: Tier, nbytes: int) -> bool:
        """Free room for ``nbytes`` in ``tier``: the least recently used readable entries move on
        to disk (host) or are dropped. Returns False when the object cannot fit."""
        cap = self.capacity[tier]
        if nbytes > cap:
            return False
        while self.used[tier] + nbytes > cap:
            victim = self._table.victim(tier)
            if victim is None:
                return False
            if tier is Tier.HOST and self.capacity[Tier.DISK] and victim.tensors is not None and self._make_room(Tier.DISK, victim.nbytes):
                self._demote(victim)
            else:
                self._drop(victim, Event.EVICT)
        return True

    def _demote(self, entry: TierEntry) -> None:
        """Move a readable host entry to disk: its bytes stay readable from memory until the file
        is written, then only the file holds them."""
        assert self.disk_dir is not None
        self._table.move(entry, Tier.DISK)
        self.offloaded[Tier.DISK] += 1
        self._write(entry)

    def _write(self, entry: TierEntry) -> None:
        assert self.disk_dir is not None
        path = tier_files.file_path(self.disk_dir, entry.pool, entry.block_hash)
        metadata = tier_files.file_metadata(entry.pool, entry.block_hash, entry.stamp, self._pools[entry.pool].fingerprints)
        self._copies.write(entry, path, metadata, self.corrupt_writes)

    def poll(self) -> None:
        """Complete the file writes that finished: a new disk entry becomes readable, a demoted
        one drops its host bytes; a failed write drops its entry."""
        for entry, error in self._copies.finished_writes():
            live = self.entries.get((entry.pool, entry.block_hash))
            if live is not entry:  # dropped meanwhile: its file landed after the drop
                if entry.path is not None and (live is None or live.path != entry.path):
                    entry.path.unlink(missing_ok=True)  # (a newer copy under the same name keeps it)
                continue
            state = self.states[entry.row]
            if error is not None:
                log.warning("disk tier: writing %s failed: %s", entry.path, error)
                self.skipped["write_failed"] += 1
                if state is BlockState.SWAPPING_OUT:
                    self._table.apply(entry, Event.SWAP_FAIL)
                    self._table.forget(entry)
                elif state is BlockState.OFFLOADED:
                    self._drop(entry, Event.INVALIDATE)
                else:  # being read back from its host bytes: drop it when that ends
                    entry.doomed = True
                continue
            entry.tensors = None  # the file holds it now (a swap-in reading them keeps its own reference)
            if state is BlockState.SWAPPING_OUT:
                if entry.doomed:
                    self._table.apply(entry, Event.SWAP_FAIL)
                    self._table.forget(entry)
                else:
                    self._publish(entry)
            elif state is BlockState.OFFLOADED and entry.doomed:  # demoted, then dropped meanwhile
                self._drop(entry, Event.INVALIDATE)

    def flush(self) -> None:
        """Wait for every file write, then complete them (tests, shutdown)."""
        self._copies.wait_writes()
        self.poll()

    # -- dropping --------------------------------------------------------------------------------
    def drop(self, pool: str, h: BlockHash) -> None:
        """Forget the copy under ``(pool, h)`` (its device copy was declared wrong)."""
        entry = self.entries.get((pool, h))
        if entry is None:
            return
        if self.states[entry.row] is BlockState.OFFLOADED and entry.fence is None:
            self._drop(entry, Event.INVALIDATE)
        else:
            entry.doomed = True

    def _drop(self, entry: TierEntry, event: Event) -> None:
        """``OFFLOADED → FREE`` (or ``SWAPPING_IN → FREE``, a failed swap-in): unindex, delete
        its file."""
        self._table.apply(entry, event)
        self.index.remove(entry.block_hash)
        self.version += 1
        self._table.forget(entry)
        if self.observer is not None:
            self.observer("removed", entry.pool, entry.block_hash, entry.tier)

    # -- swap-in ---------------------------------------------------------------------------------
    def begin_swap_in(self, entry: TierEntry) -> None:
        """Reserve a readable entry for a swap-in (``SWAPPING_IN``: not evictable, not readable)."""
        self._table.apply(entry, Event.SWAP_IN_BEGIN)
        self.version += 1

    def cancel_swap_in(self, entry: TierEntry) -> None:
        """Call off a reserved swap-in before its copy was enqueued."""
        self._table.apply(entry, Event.SWAP_CANCEL)
        self.version += 1

    def copy_in(self, pool: BlockPool, entry: TierEntry, block: int) -> SwapIn:
        """Enqueue the copy of a reserved entry into ``block`` (allocated and leased by the
        caller, unpublished). The future's result is None when the bytes were verified and
        written into the block, else the reason they were refused."""
        reg = self._pools[pool.name]
        return SwapIn(pool, entry, block, self._copies.copy_in(reg.store.tensors, reg.fingerprints, entry, block))

    def finish_swap_in(self, swap: SwapIn) -> Reason | None:
        """Complete a finished swap-in on the caller's thread: on success publish the device
        block under the entry's hash with its stamp (the caller still holds its lease) and keep
        the entry readable; on failure drop the entry (counted by reason), leaving the block
        unpublished for the caller to release. Returns the failure reason, if any."""
        try:
            reason = swap.future.result()
        except Exception as exc:  # an unreadable file
            log.warning("%s tier: swap-in of %s failed: %s", swap.entry.tier, swap.entry.pool, exc)
            reason = Reason.OFFLOAD_CORRUPT
        entry = swap.entry
        if reason is None and entry.doomed:
            reason = Reason.EPOCH_CHANGED
        if reason is not None:
            self.skipped[str(reason)] += 1
            self._drop(entry, Event.SWAP_FAIL)
            return reason
        self._table.apply(entry, Event.SWAP_IN_DONE)
        self.version += 1
        self._table.touch(entry)
        if swap.pool.lookup(entry.block_hash) is not None:
            return None  # recomputed and cached meanwhile (by a request that did not wait): nothing to publish
        self._pools[swap.pool.name].store.set_stamp(swap.block, entry.stamp)
        swap.pool.publish(swap.block, entry.block_hash)
        swap.published = True
        if self.observer is not None:
            self.observer("restored", entry.pool, entry.block_hash, entry.tier)
        return None

    def hold(self) -> None:
        """Fault ``read_during_swap_in``: swap-ins enqueued from now on wait for :meth:`release`."""
        self._copies.hold()

    def release(self) -> None:
        """Let swap-ins held by the ``read_during_swap_in`` fault proceed."""
        self._copies.release()

    # -- restart ---------------------------------------------------------------------------------
    def rebuild(self) -> int:
        """Index the disk tier's files left by an earlier run (headers and checksums verified);
        skip — and count in :attr:`skipped` — files that are unreadable, truncated or corrupted
        (deleted: they can never be used) and files of another layout or an unknown pool (left
        alone: they may belong to another model). Returns the number of entries found."""
        if self.disk_dir is None or not self.capacity[Tier.DISK]:
            return 0
        found = 0
        fingerprints = {name: reg.fingerprints for name, reg in self._pools.items()}
        for path, pool, stored in tier_files.recover(self.disk_dir, fingerprints):  # the directory is ours: locked
            if stored is None:
                self.skipped["unknown_pool"] += 1
                continue
            if isinstance(stored, Reason):
                self._skip(path, stored, delete=stored == Reason.OFFLOAD_CORRUPT)
                continue
            assert pool is not None
            if (pool, stored.block_hash) in self.entries or not self._make_room(Tier.DISK, stored.nbytes):
                continue
            entry = self._table.add(pool, stored.block_hash, Tier.DISK, stored.stamp, stored.nbytes, None)
            entry.path = path
            self._publish(entry)
            found += 1
        if found or self.skipped:
            log.info("disk tier %s: %d objects found, skipped %s", self.disk_dir, found, dict(self.skipped) or "none")
        return found

    def _skip(self, path: Path, reason: Reason, *, delete: bool) -> None:
        self.skipped[str(reason)] += 1
        log.warning("disk tier: skipping %s (%s)", path, reason)
        if delete:
            path.unlink(missing_ok=True)

    # -- shutdown and invariants -----------------------------------------------------------------
    def close(self) -> None:
        """Finish every copy (file writes included) and stop the workers."""
        self.release()
        self.flush()
        self._copies.shutdown()
        if self._lock is not None:
            self._lock.release()  # closes the descriptor: releases the flock
            self._lock = None

    def check_invariants(self) -> None:
        """Raise AssertionError unless bytes per tier match their entries and fit the capacity,
        every entry's state is a tier state, and the LRU queues hold exactly the entries."""
        self._table.check_invariants()

    def readable_hashes(self) -> Counter[BlockHash]:
        """Hashes the readable (or in swap-in) entries hold in the prefix index."""
        return self._table.readable_hashes()
