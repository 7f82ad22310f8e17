"""Decoding event batches off the agent's main thread — in worker processes by default.

Decoding a JSON or msgpack batch (msgspec), checking it and building its Arrow tables is pure
Python and holds the GIL for milliseconds per thousand events (an Arrow body is read and checked
column by column, :mod:`agent.arrow_ingest`, at a fraction of that). In the agent's process that
would compete with the ingest flusher, whose DuckDB calls need the GIL between steps, and slow
every commit. :class:`BatchDecoder` therefore runs :func:`decode_for_ingest` in a pool of
``processes`` worker processes (``forkserver``/``spawn``: safe beside threads); with
``processes=0`` it uses a small thread pool instead (tests, tiny deployments).

The worker returns a :class:`Decoded` (the prepared batch) or a :class:`Invalid`
(the path and reason of the contract violation) — never raises for bad input, so nothing
user-caused crosses the process boundary as an exception.

A worker watches the agent's pid and exits when the agent is gone: ``ProcessPoolExecutor``
workers otherwise outlive an agent killed with SIGKILL (they hold their own queue's pipe open and
never see end-of-file).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from agent.arrow_ingest import prepare_arrow
from agent.ingest import PreparedBatch, prepare_batch
from engine.events import EventError, decode_batch
from engine.events_arrow import WireFormat, decode_body


@dataclass(frozen=True, slots=True)
class Decoded:
    """A valid batch, ready for the ingest queue (its metrics are summarised per flush:
    :mod:`agent.batch_summary`)."""

    batch: PreparedBatch
    decode_seconds: float = 0.0
    """Reading the body (for JSON/msgpack, msgspec's typed decode and the cross-field checks)."""
    check_seconds: float = 0.0
    """The Arrow checks and building the store's tables (for JSON/msgpack, the tables only)."""


@dataclass(frozen=True, slots=True)
class Invalid:
    """A batch that breaks the contract: ``path`` names the field (for an Arrow body also
    ``column`` and the first bad ``row``)."""

    path: str
    reason: str
    column: str | None = None
    row: int | None = None

    def error(self) -> EventError:
        return EventError(self.path, self.reason, column=self.column, row=self.row)


def decode_for_ingest(body: bytes, fmt: WireFormat) -> Decoded | Invalid:
    """Decode, check and prepare one request body (what a decode worker runs)."""
    started = time.perf_counter()
    try:
        if fmt == "arrow":
            arrow = decode_body(body)
            read = time.perf_counter()
            prepared = prepare_arrow(arrow)
        else:
            batch = decode_batch(body, fmt)
            read = time.perf_counter()
            prepared = prepare_batch(batch)
    except EventError as exc:
        return Invalid(exc.path, exc.reason, exc.column, exc.row)
    return Decoded(prepared, read - started, time.perf_counter() - read)


log = logging.getLogger(__name__)

PARENT_POLL_SECONDS = 1.0


def _watch_parent(pid: int) -> None:
    """Worker initializer: exit this worker (at once, without cleanup: it holds no state) once
    the agent (process ``pid``) is gone. A dead process's children are re-parented at once (even
    while it is an unreaped zombie), so the worker watches its own parent — the agent, or the
    forkserver, which exits with the agent — and also the agent's pid."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_SECONDS)
            if os.getppid() != parent:
                os._exit(0)
            try:
                os.kill(pid, 0)
            except (ProcessLookupError, PermissionError):  # gone, or the pid was reused
                os._exit(0)

    threading.Thread(target=watch, name="kvscope-parent-watch", daemon=True).start()


class BatchDecoder:
    """Runs :func:`decode_for_ingest` for JSON and msgpack bodies in ``processes`` worker
    processes (threads when ``processes`` is 0), and for Arrow bodies always in two threads of
    the agent's process: an Arrow body is read without copying and checked by numpy and pyarrow
    kernels, so shipping it to a process and its tables back (pickled) would cost more than the
    check itself (measured with ``benchmarks/ingest_load.py``: 16.2 against 13.6 ms of agent CPU
    per 1,000-event batch).

    Raises:
        ValueError: ``processes`` is negative.
    """

    def __init__(self, processes: int) -> None:
        if processes < 0:
            raise ValueError(f"decode processes must be >= 0, got {processes}")
        self.processes = processes
        self.restarts = 0
        """How many times a broken worker pool was replaced."""
        self._lock = threading.Lock()
        self._executor: Executor = self._new_executor()
        self._threads = ThreadPoolExecutor(2, thread_name_prefix="kvscope-decode-arrow")

    def _new_executor(self) -> Executor:
        if not self.processes:
            return ThreadPoolExecutor(2, thread_name_prefix="kvscope-decode")
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        return ProcessPoolExecutor(
            self.processes,
            mp_context=multiprocessing.get_context(method),
            initializer=_watch_parent,
            initargs=(os.getpid(),),
        )

    async def decode(self, body: bytes, fmt: WireFormat) -> Decoded | Invalid:
        """Decode one body on the pool. When a worker died (the pool is broken: an OOM kill,
        say), a new pool replaces it and the body is tried once more.

        Raises:
            concurrent.futures.process.BrokenProcessPool: the new pool broke too (the caller
                answers 503).
        """
        loop = asyncio.get_running_loop()
        if fmt == "arrow":
            return await loop.run_in_executor(self._threads, decode_for_ingest, body, fmt)
        executor = self._executor
        try:
            return await loop.run_in_executor(executor, decode_for_ingest, body, fmt)
        except BrokenProcessPool:
            self._replace(executor)
            return await loop.run_in_executor(self._executor, decode_for_ingest, body, fmt)

    def _replace(self, broken: Executor) -> None:
        with self._lock:
            if self._executor is not broken:
                return  # another request replaced it already
            log.error("a batch decode worker died; starting a new pool of %d", self.processes)
            self.restarts += 1
            self._executor = self._new_executor()
        broken.shutdown(wait=False, cancel_futures=True)

    def warm_up(self) -> None:
        """Start every worker now (imports take a second) instead of at the first batch."""
        if self.processes:
            futures = [self._executor.submit(decode_for_ingest, b"", "json") for _ in range(self.processes)]
            for future in futures:
                future.result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._threads.shutdown(wait=True, cancel_futures=True)
