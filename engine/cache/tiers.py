"""Host and disk tiers: copies of cached objects below the device (DESIGN.md §3 "Tiers", §4).

Every object a device pool evicts (a KV page, a compressed entry page, a tail or indexer slot, a
recurrent checkpoint) is copied down before its block is reused (write-back), first to ``host``
memory (pinned on CUDA) and, when the host tier is full, moved on to ``disk``: one file per object
under the tier directory, in the safetensors format, whose header carries the pool, the prefix
hash, the object's stamp, the layout fingerprint of every tensor and a SHA-256 of the tensor
bytes. A swap-in copies an object back into a freshly allocated device block; the tiers keep
their copy (inclusive), so the next eviction of the same object copies nothing.

Each copy is an entry that moves through the lifecycle table of :mod:`engine.cache.lifecycle`
(``SWAPPING_OUT → OFFLOADED → SWAPPING_IN → OFFLOADED``; dropped: ``FREE``). Copies run on worker
threads (one ``ThreadPoolExecutor`` writing files, one of :data:`READ_WORKERS` threads copying
objects up; on CUDA a side stream as well) with per-entry fences:

* copy-down: the source block is snapshotted into a staging buffer after every write to it
  (on CUDA the side stream waits for the compute stream, and the compute stream waits for the
  copy before the block is rewritten); the file write reads only the staging buffer, which is
  dropped once the write completes (pinned buffers come from torch's caching host allocator,
  which reuses one only after the copies recorded on it finish);
* swap-in: the destination block is leased by the swap-in and not findable until the copy is
  verified and the main thread publishes it; an entry being read is ``SWAPPING_IN`` and a lookup
  that needs it waits for its future or lowers L* with reason ``in_flight_swap``.

A restore whose checksum or fingerprint does not match drops the entry and reports
``offload_corrupt`` / ``layout_mismatch``: the request resumes lower, never from wrong bytes.
:meth:`TierStore.rebuild` finds the disk tier's objects again after a restart from the file
headers, skipping (and counting) unreadable, truncated, corrupted or mismatched files.

Peer designs: vLLM's CPU offloading connector and SGLang's HiCache (host tier, write-back on
eviction, prefetch before scheduling); file format: safetensors.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import Tensor

from engine.cache.block_pool import BlockPool
from engine.cache.forms import ObjectStore, Stamp
from engine.cache.hashing import BlockHash, PrefixIndex
from engine.cache.lifecycle import BlockState, Event, transition
from engine.cache.validation import LayoutFingerprint
from engine.events import Reason, Tier

log = logging.getLogger(__name__)

FILE_FORMAT = "kvscope-tier-object/1"
"""``format`` in every tier file's header; files of another format are skipped."""

FILE_SUFFIX = ".safetensors"

READ_WORKERS = 4
"""Threads copying objects up: disk reads of many small files wait on I/O latency, so several
run at once (each into its own device block)."""

LOCK_FILE = ".lock"
"""Held (``flock``) by the engine using a disk tier directory: one engine per directory."""

SWAP_GATE_SECONDS = 30.0
"""Longest a swap-in held by the ``read_during_swap_in`` fault waits for its release."""


def fingerprint_text(fp: LayoutFingerprint) -> str:
    """A layout fingerprint as written into a tier file's header."""
    return json.dumps([str(fp.dtype), list(fp.block_shape), list(fp.axis_order), fp.kernel_abi, fp.model_revision])


def _stamp_to_json(stamp: Stamp) -> str:
    return json.dumps([s.hex() if isinstance(s, bytes) else s for s in stamp])


def _stamp_from_json(text: str) -> Stamp:
    """Inverse of :func:`_stamp_to_json` (hex strings are hashes)."""
    values = json.loads(text)
    if not isinstance(values, list):
        raise ValueError("stamp is not a list")
    out: list[int | bytes | None] = []
    for v in values:
        if v is None or isinstance(v, int):
            out.append(v)
        elif isinstance(v, str):
            out.append(bytes.fromhex(v))
        else:
            raise ValueError(f"stamp value {v!r}")
    return tuple(out)


HEADER_FIELDS = ("pool", "hash", "stamp", "fingerprints")
"""Header fields the checksum covers besides the tensor bytes."""


def _digest(tensors: dict[str, Tensor], metadata: dict[str, str]) -> str:
    """SHA-256 over the header fields that name the object and the tensors' bytes in name
    order."""
    h = hashlib.sha256()
    for key in HEADER_FIELDS:
        h.update(f"{key}={metadata.get(key, '')}\n".encode())
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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
class _Pool:
    store: ObjectStore
    fingerprints: dict[str, str]


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
        self.capacity = {Tier.HOST: host_bytes, Tier.DISK: disk_bytes}
        self.used = {Tier.HOST: 0, Tier.DISK: 0}
        self.disk_dir = disk_dir
        self._lock: int | None = None
        if disk_dir is not None and disk_bytes:
            try:
                disk_dir.mkdir(parents=True, exist_ok=True)
                self._lock = os.open(disk_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise ValueError(f"disk tier directory {disk_dir}: {exc}") from None
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(self._lock)
                self._lock = None
                raise ValueError(
                    f"disk tier directory {disk_dir} is in use by another engine; give each engine its own "
                    "CacheConfig.disk_tier_dir"
                ) from None
            # an engine dropped without close() gives the directory back when collected
            self._unlock = weakref.finalize(self, os.close, self._lock)
        self.index = index
        self.device = device
        self.corrupt_writes = False
        self.hold_swap_ins = False
        self._gate = threading.Event()
        self._gate.set()
        self._pools: dict[str, _Pool] = {}
        self.entries: dict[tuple[str, BlockHash], TierEntry] = {}
        self._lru: dict[Tier, OrderedDict[TierEntry, None]] = {Tier.HOST: OrderedDict(), Tier.DISK: OrderedDict()}
        self.states: list[BlockState] = []
        self.epochs: list[int] = []
        self._free_rows: list[int] = []
        self._writes: list[TierEntry] = []
        self.swaps: list[SwapIn] = []
        """Swap-ins started by a prefetch and not yet committed."""
        self.restored: OrderedDict[tuple[str, BlockHash], tuple[Tier, int, float]] = OrderedDict()
        """Objects a prefetch brought back, not yet claimed by a request: (tier, bytes, seconds)."""
        self.version = 0
        """Bumped whenever the set of readable entries changes."""
        self.observer: Callable[[str, str, BlockHash, Tier], None] | None = None
        """Optional audit hook, called as ``observer(action, pool, hash, tier)`` when an object
        becomes readable in a tier (``"offloaded"``) or is copied back up (``"restored"``)."""
        self.offloaded = Counter[Tier]()
        self.skipped = Counter[str]()
        """Files or copies refused, by reason (``offload_corrupt``, ``layout_mismatch``, ...)."""
        # one worker writes files, others copy objects up: a swap-in held back (by the
        # read_during_swap_in fault, or a slow read) never holds a write-back up, and vice versa
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvscope-tier-write")
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=READ_WORKERS, thread_name_prefix="kvscope-tier-read")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

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

    # -- queries ---------------------------------------------------------------------------------
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

    # -- copy down -------------------------------------------------------------------------------
    def offload(self, pool: BlockPool, block: int, h: BlockHash) -> None:
        """Copy the object of a cached ``block`` down (called just before the block is reused).
        Nothing happens when a tier already holds it, or when it fits no tier."""
        self.poll()
        entry = self.entries.get((pool.name, h))
        if entry is not None:  # a copy exists or is under way (a doomed one is freed when it ends)
            if not entry.doomed and self.states[entry.row] is BlockState.OFFLOADED:
                self._lru[entry.tier].move_to_end(entry)
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
        staging = {t.name: self._stage(t.tensor[block]) for t in reg.store.tensors}
        entry = self._new_entry(pool.name, h, tier, reg.store.stamp(block), nbytes, staging)
        self.offloaded[tier] += 1
        if tier is Tier.HOST:
            self._publish(entry)
        else:
            self._write(entry)
        return True

    def _stage(self, src: Tensor) -> Tensor:
        """A host copy of one block's tensor. On CUDA: a pinned buffer filled on the side stream
        after every write queued on the compute stream; the compute stream then waits for the
        copy, so the block is not rewritten before it is read."""
        if self._stream is None:
            return src.detach().clone()
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            dst.copy_(src, non_blocking=True)
        current.wait_stream(self._stream)
        self._stream.synchronize()  # the host bytes are read by the worker thread next
        return dst

    def _new_entry(self, pool: str, h: BlockHash, tier: Tier, stamp: Stamp, nbytes: int, tensors: dict[str, Tensor] | None) -> TierEntry:
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = len(self.states)
            self.states.append(BlockState.FREE)
            self.epochs.append(0)
        entry = TierEntry(row=row, pool=pool, block_hash=h, tier=tier, stamp=stamp, nbytes=nbytes, tensors=tensors)
        self._apply(entry, Event.SWAP_OUT_BEGIN)
        self.entries[(pool, h)] = entry
        self.used[tier] += nbytes
        self._lru[tier][entry] = None
        return entry

    def _publish(self, entry: TierEntry) -> None:
        self._apply(entry, Event.SWAP_OUT_DONE)
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
        lru = self._lru[tier]
        while self.used[tier] + nbytes > cap:
            victim = next((e for e in lru if self.states[e.row] is BlockState.OFFLOADED and e.fence is None), None)
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
        del self._lru[entry.tier][entry]
        self.used[entry.tier] -= entry.nbytes
        entry.tier = Tier.DISK
        self.used[Tier.DISK] += entry.nbytes
        self._lru[Tier.DISK][entry] = None
        self.offloaded[Tier.DISK] += 1
        self._write(entry)

    def _write(self, entry: TierEntry) -> None:
        assert self.disk_dir is not None and entry.tensors is not None
        entry.path = self.disk_dir / f"{hashlib.sha1(entry.pool.encode()).hexdigest()[:10]}-{entry.block_hash.hex()}{FILE_SUFFIX}"
        metadata = {
            "format": FILE_FORMAT,
            "pool": entry.pool,
            "hash": entry.block_hash.hex(),
            "stamp": _stamp_to_json(entry.stamp),
            "fingerprints": json.dumps(self._pools[entry.pool].fingerprints, sort_keys=True),
        }
        entry.fence = self._writer.submit(_write_file, entry.path, dict(entry.tensors), metadata, self.corrupt_writes)
        self._writes.append(entry)

    def poll(self) -> None:
        """Complete the file writes that finished: a new disk entry becomes readable, a demoted
        one drops its host bytes; a failed write drops its entry."""
        pending = []
        for entry in self._writes:
            fence = entry.fence
            assert fence is not None
            if not fence.done():
                pending.append(entry)
                continue
            entry.fence = None
            error = fence.exception()
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
                    self._apply(entry, Event.SWAP_FAIL)
                    self._forget(entry)
                elif state is BlockState.OFFLOADED:
                    self._drop(entry, Event.INVALIDATE)
                else:  # being read back from its host bytes: drop it when that ends
                    entry.doomed = True
                continue
            entry.tensors = None  # the file holds it now (a swap-in reading them keeps its own reference)
            if state is BlockState.SWAPPING_OUT:
                if entry.doomed:
                    self._apply(entry, Event.SWAP_FAIL)
                    self._forget(entry)
                else:
                    self._publish(entry)
            elif state is BlockState.OFFLOADED and entry.doomed:  # demoted, then dropped meanwhile
                self._drop(entry, Event.INVALIDATE)
        self._writes = pending

    def flush(self) -> None:
        """Wait for every file write, then complete them (tests, shutdown)."""
        for entry in list(self._writes):
            if entry.fence is not None:
                concurrent.futures.wait([entry.fence])
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
        """``OFFLOADED → FREE``: unindex, delete its file."""
        self._apply(entry, event)
        self.index.remove(entry.block_hash)
        self.version += 1
        self._forget(entry)
        if self.observer is not None:
            self.observer("removed", entry.pool, entry.block_hash, entry.tier)

    def _forget(self, entry: TierEntry) -> None:
        del self.entries[(entry.pool, entry.block_hash)]
        del self._lru[entry.tier][entry]
        self.used[entry.tier] -= entry.nbytes
        self._free_rows.append(entry.row)
        if entry.path is not None and entry.fence is None:  # a write in flight: poll deletes it
            entry.path.unlink(missing_ok=True)
        entry.tensors = None

    def _apply(self, entry: TierEntry, event: Event) -> BlockState:
        return transition(self.states, self.epochs, entry.row, event, owner=f"{entry.tier} tier")

    # -- swap-in ---------------------------------------------------------------------------------
    def begin_swap_in(self, entry: TierEntry) -> None:
        """Reserve a readable entry for a swap-in (``SWAPPING_IN``: not evictable, not readable)."""
        self._apply(entry, Event.SWAP_IN_BEGIN)
        self.version += 1

    def cancel_swap_in(self, entry: TierEntry) -> None:
        """Call off a reserved swap-in before its copy was enqueued."""
        self._apply(entry, Event.SWAP_CANCEL)
        self.version += 1

    def copy_in(self, pool: BlockPool, entry: TierEntry, block: int) -> SwapIn:
        """Enqueue the copy of a reserved entry into ``block`` (allocated and leased by the
        caller, unpublished). The future's result is None when the bytes were verified and
        written into the block, else the reason they were refused."""
        reg = self._pools[pool.name]
        ready: torch.cuda.Event | None = None
        if self._stream is not None:  # the block's previous readers, queued on the compute stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        future = self._reader.submit(self._read_into, reg, entry, block, ready)
        return SwapIn(pool, entry, block, future)

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
            self._apply(entry, Event.SWAP_FAIL)
            self.index.remove(entry.block_hash)
            self.version += 1
            self._forget(entry)
            if self.observer is not None:
                self.observer("removed", entry.pool, entry.block_hash, entry.tier)
            return reason
        self._apply(entry, Event.SWAP_IN_DONE)
        self.version += 1
        self._lru[entry.tier].move_to_end(entry)
        if swap.pool.lookup(entry.block_hash) is not None:
            return None  # recomputed and cached meanwhile (by a request that did not wait): nothing to publish
        self._pools[swap.pool.name].store.set_stamp(swap.block, entry.stamp)
        swap.pool.publish(swap.block, entry.block_hash)
        swap.published = True
        if self.observer is not None:
            self.observer("restored", entry.pool, entry.block_hash, entry.tier)
        return None

    def release(self) -> None:
        """Let swap-ins held by the ``read_during_swap_in`` fault proceed."""
        self._gate.set()

    def _read_into(self, reg: _Pool, entry: TierEntry, block: int, ready: torch.cuda.Event | None = None) -> Reason | None:
        """Worker thread: load, verify and copy one entry into ``block``."""
        if self.hold_swap_ins:
            self._gate.wait(SWAP_GATE_SECONDS)
        tensors = entry.tensors
        if tensors is None:
            assert entry.path is not None
            loaded = _read_file(entry.path, reg.fingerprints)
            if isinstance(loaded, Reason):
                return loaded
            tensors = loaded[0]
        for t in reg.store.tensors:
            src = tensors.get(t.name)
            if src is None or src.shape != t.tensor[block].shape or src.dtype != t.tensor.dtype:
                return Reason.LAYOUT_MISMATCH
        if self._stream is None:
            for t in reg.store.tensors:
                t.tensor[block].copy_(tensors[t.name])
        else:
            with torch.cuda.stream(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                for t in reg.store.tensors:
                    t.tensor[block].copy_(tensors[t.name], non_blocking=True)
            self._stream.synchronize()
        return None

    def hold(self) -> None:
        """Fault ``read_during_swap_in``: swap-ins enqueued from now on wait for :meth:`release`."""
        self.hold_swap_ins = True
        self._gate.clear()

    # -- restart ---------------------------------------------------------------------------------
    def rebuild(self) -> int:
        """Index the disk tier's files left by an earlier run (headers and checksums verified);
        skip — and count in :attr:`skipped` — files that are unreadable, truncated or corrupted
        (deleted: they can never be used) and files of another layout or an unknown pool (left
        alone: they may belong to another model). Returns the number of entries found."""
        if self.disk_dir is None or not self.capacity[Tier.DISK]:
            return 0
        found = 0
        for partial in self.disk_dir.glob("*.tmp"):  # a write cut short by a crash (the directory is ours: locked)
            partial.unlink(missing_ok=True)
        stamped = []
        for path in self.disk_dir.glob(f"*{FILE_SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                stamped.append((path.stat().st_mtime, path))
        files = [path for _, path in sorted(stamped)]
        for path in files:
            try:
                with safetensors.safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
            except Exception:
                self._skip(path, Reason.OFFLOAD_CORRUPT, delete=True)
                continue
            pool = meta.get("pool")
            if meta.get("format") != FILE_FORMAT or pool not in self._pools:
                self.skipped["unknown_pool"] += 1
                continue
            loaded = _read_file(path, self._pools[pool].fingerprints)
            if isinstance(loaded, Reason):
                self._skip(path, loaded, delete=loaded == Reason.OFFLOAD_CORRUPT)
                continue
            tensors, meta = loaded
            try:
                h = bytes.fromhex(meta["hash"])
                stamp = _stamp_from_json(meta["stamp"])
                if stamp and not isinstance(stamp[0], int):
                    raise ValueError("a stamp starts with its boundary in tokens")
            except (KeyError, ValueError):
                self._skip(path, Reason.OFFLOAD_CORRUPT, delete=True)
                continue
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            if (pool, h) in self.entries or not self._make_room(Tier.DISK, nbytes):
                continue
            entry = self._new_entry(pool, h, Tier.DISK, stamp, nbytes, None)
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
        """Finish every copy (file writes included) and stop the worker."""
        self.release()
        self.flush()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        if self._lock is not None:
            self._unlock()  # closes the descriptor: releases the flock
            self._lock = None

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

    def readable_hashes(self) -> Counter[BlockHash]:
        """Hashes the readable (or in swap-in) entries hold in the prefix index."""
        return Counter(
            e.block_hash for e in self.entries.values() if self.states[e.row] in (BlockState.OFFLOADED, BlockState.SWAPPING_IN)
        )


def round_trip(tier: Tier, directory: Path | None, nbytes: int, count: int = 1) -> float:
    """Copy ``count`` objects of ``nbytes`` down to ``tier`` and time bringing them back up
    together through the tier's own path (host: copies; disk: files written and dropped from the
    OS page cache, then read and verified on :data:`READ_WORKERS` threads); returns the seconds
    per object of the way up, for the admission's calibration."""
    src = torch.zeros(nbytes, dtype=torch.uint8)
    if tier is Tier.HOST or directory is None:
        down = [src.clone() for _ in range(count)]
        t0 = time.perf_counter()
        for d in down:
            d.clone()
        return (time.perf_counter() - t0) / count
    paths = [directory / f"calibration-{os.getpid()}-{threading.get_ident()}-{i}.probe" for i in range(count)]
    try:
        for path in paths:
            _write_file(path, {"x": src}, {"fingerprints": "{}"}, False)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):  # Linux: read from the disk, not the page cache
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        with concurrent.futures.ThreadPoolExecutor(max_workers=READ_WORKERS) as pool:
            t0 = time.perf_counter()
            results = list(pool.map(lambda p: _read_file(p, {}), paths))
            seconds = time.perf_counter() - t0
        if any(isinstance(r, Reason) for r in results):
            raise RuntimeError(f"{directory}: a calibration file failed verification")
        return seconds / count
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


def _write_file(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str], corrupt: bool) -> None:
    """Worker thread: write one tier file atomically (a temporary file renamed into place)."""
    meta = {**metadata, "checksum": _digest(tensors, metadata)}
    data = safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if corrupt:  # fault injection: flip the last byte of the tensor data
            f.seek(len(data) - 1)
            f.write(bytes([data[-1] ^ 0xFF]))
    os.replace(tmp, path)


def _read_file(path: Path, fingerprints: dict[str, str]) -> tuple[dict[str, Tensor], dict[str, str]] | Reason:
    """Load and verify one tier file: ``(tensors, header metadata)``, or the reason it is
    refused (``offload_corrupt``: unreadable, truncated or a checksum mismatch;
    ``layout_mismatch``: written for another layout)."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception:
        return Reason.OFFLOAD_CORRUPT
    try:
        stored = json.loads(meta.get("fingerprints", "null"))
    except ValueError:
        return Reason.OFFLOAD_CORRUPT
    if stored != fingerprints:
        return Reason.LAYOUT_MISMATCH
    if meta.get("checksum") != _digest(tensors, meta):
        return Reason.OFFLOAD_CORRUPT
    return tensors, meta


