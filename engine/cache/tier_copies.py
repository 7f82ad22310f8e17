"""The copies between device blocks and the host/disk tiers, on worker threads (DESIGN.md §3
"Tiers", §4).

Copies run on worker threads — one writing files, :data:`READ_WORKERS` copying objects up, so a
swap-in held back (by the ``read_during_swap_in`` fault, or a slow read) never holds a
write-back up, and vice versa — and on CUDA on a side stream as well, with these fences:

* copy-down (:meth:`TierCopies.stage`): the source block is snapshotted into a staging buffer
  after every write queued on the compute stream (the side stream waits for the compute
  stream, and the compute stream waits for the copy before the block is rewritten); the file
  write (:meth:`TierCopies.write`) reads only the staging buffer (pinned buffers come from
  torch's caching host allocator, which reuses one only after the copies recorded on it finish);
* swap-in (:meth:`TierCopies.copy_in`): the copy into the destination block waits for the block's
  previous readers queued on the compute stream, then loads, verifies and writes the bytes.

Which copies run, and what the entries' states become, is the tier store's
(:class:`engine.cache.tiers.TierStore`); this module only moves bytes. Peer designs: vLLM's CPU
offloading connector and SGLang's HiCache.
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path

import torch
from torch import Tensor

from engine.cache import tier_files
from engine.cache.forms import StoredTensor
from engine.cache.tier_entries import TierEntry
from engine.events import Reason

READ_WORKERS = 4
"""Threads copying objects up: disk reads of many small files wait on I/O latency, so several
run at once (each into its own device block)."""

SWAP_GATE_SECONDS = 30.0
"""Longest a swap-in held by the ``read_during_swap_in`` fault waits for its release."""


class TierCopies:
    """The worker threads (and on CUDA the side stream) copying objects of the pools on
    ``device`` down to the tiers and back up.

    ``holding`` (fault injection, ``read_during_swap_in``): while set, every swap-in's copy
    waits for the first :meth:`release` after it was enqueued (at most
    :data:`SWAP_GATE_SECONDS`), so a read arrives while it is in flight; copies enqueued after a
    release wait for the next one.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.holding = False
        self._gate = threading.Event()
        self._gate.set()
        self._writes: list[TierEntry] = []  # entries whose file write was enqueued, oldest first
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvscope-tier-write")
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=READ_WORKERS, thread_name_prefix="kvscope-tier-read")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def stage(self, src: Tensor) -> Tensor:
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

    def write(self, entry: TierEntry, path: Path, metadata: dict[str, str], corrupt: bool) -> None:
        """Enqueue the write of ``entry``'s host bytes to the tier file ``path``
        (:func:`engine.cache.tier_files.write_file`); ``entry.fence`` is the write until
        :meth:`finished_writes` reports it."""
        assert entry.tensors is not None
        entry.path = path
        entry.fence = self._writer.submit(tier_files.write_file, path, dict(entry.tensors), metadata, corrupt)
        self._writes.append(entry)

    def finished_writes(self) -> list[tuple[TierEntry, BaseException | None]]:
        """The entries whose file write ended since the last call, oldest first, each with what
        the write raised (None: written); their fences are cleared."""
        done, pending = [], []
        for entry in self._writes:
            fence = entry.fence
            assert fence is not None
            if not fence.done():
                pending.append(entry)
                continue
            entry.fence = None
            done.append((entry, fence.exception()))
        self._writes = pending
        return done

    def wait_writes(self) -> None:
        """Wait for every file write enqueued so far to end."""
        for entry in list(self._writes):
            if entry.fence is not None:
                concurrent.futures.wait([entry.fence])

    def copy_in(
        self, tensors: list[StoredTensor], fingerprints: dict[str, str], entry: TierEntry, block: int
    ) -> concurrent.futures.Future[Reason | None]:
        """Enqueue the copy of ``entry`` (its host bytes, else its file, verified against
        ``fingerprints``) into ``block`` of the pool ``tensors`` belong to. The future's result is
        None when the bytes were written into the block, else the reason they were refused
        (``offload_corrupt``, ``layout_mismatch``); it raises what reading the file raised."""
        ready: torch.cuda.Event | None = None
        if self._stream is not None:  # the block's previous readers, queued on the compute stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        gate = self._gate if self.holding else None
        return self._reader.submit(self._read_into, tensors, fingerprints, entry, block, ready, gate)

    def _read_into(
        self,
        stored: list[StoredTensor],
        fingerprints: dict[str, str],
        entry: TierEntry,
        block: int,
        ready: torch.cuda.Event | None,
        gate: threading.Event | None,
    ) -> Reason | None:
        """Worker thread: load, verify and copy one entry into ``block`` (after ``gate`` opens,
        when the copy is held)."""
        if gate is not None:
            gate.wait(SWAP_GATE_SECONDS)
        tensors = entry.tensors
        if tensors is None:
            assert entry.path is not None
            loaded = tier_files.read_file(entry.path, fingerprints)
            if isinstance(loaded, Reason):
                return loaded
            tensors = loaded[0]
        for t in stored:
            src = tensors.get(t.name)
            if src is None or src.shape != t.tensor[block].shape or src.dtype != t.tensor.dtype:
                return Reason.LAYOUT_MISMATCH
        if self._stream is None:
            for t in stored:
                t.tensor[block].copy_(tensors[t.name])
        else:
            with torch.cuda.stream(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                for t in stored:
                    t.tensor[block].copy_(tensors[t.name], non_blocking=True)
            self._stream.synchronize()
        return None

    def hold(self) -> None:
        """Fault ``read_during_swap_in``: swap-ins enqueued from now on wait for :meth:`release`."""
        self.holding = True
        self._gate.clear()

    def release(self) -> None:
        """Let the swap-ins held by :meth:`hold` so far proceed (those enqueued later wait for
        the next release)."""
        self._gate.set()
        if self.holding:
            self._gate = threading.Event()

    def shutdown(self) -> None:
        """Let held swap-ins proceed, wait for every copy and stop the workers."""
        self.release()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
