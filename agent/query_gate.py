"""Admission control for the agent's read queries (``POST /v1/sql``, ``GET /v1/query/{name}``).

At most ``max_running`` such queries run at once. One more waits up to ``queue_timeout_seconds``
for a slot, then is refused with :class:`QueryBusy` (HTTP 429 with ``Retry-After``), so heavy
readers cannot take the CPU, memory and DuckDB threads that ingest needs (measured before the
cap: ten queries at once raised ingest latency from 0.25 s to 2.19 s). A slot is released when the
query has really ended — not when its caller got a 408 — so queries DuckDB cannot stop at once
(:mod:`agent.deadline`) cannot pile up.

Alert rule inputs (:mod:`alerts.inputs`) do not pass through the gate: they are the agent's own
reserved path, never refused. They add at most one running query per rule to those admitted
here — not one in all: rule groups evaluate concurrently, and an ``expr`` query answered as timed
out may still run when the next evaluation starts, so a rule whose previous query still runs is
skipped for that evaluation (:class:`alerts.inputs.RunningQueries`) rather than starting another.

The gate is an :class:`asyncio.Semaphore` bound to the app's event loop (waiting costs no
thread); the worker thread that ran the query releases its slot through
``loop.call_soon_threadsafe``. The pattern is a bounded bulkhead with a queue timeout, as
PgBouncer's ``max_client_conn``/``query_wait_timeout`` or Envoy's ``max_pending_requests``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable
from typing import TypeVar

import anyio.to_thread

T = TypeVar("T")


class QueryBusy(Exception):
    """Every query slot stayed taken for the whole queue timeout; ``retry_after_seconds`` is the
    ``Retry-After`` to send with the 429."""

    status = 429

    def __init__(self, reason: str, retry_after_seconds: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_seconds = retry_after_seconds


class Slot:
    """One admitted query's slot. :meth:`release` is thread-safe and idempotent."""

    def __init__(self, gate: QueryGate, loop: asyncio.AbstractEventLoop) -> None:
        self._gate = gate
        self._loop = loop
        self._lock = threading.Lock()
        self._released = False

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        with contextlib.suppress(RuntimeError):  # the loop already closed: nothing waits any more
            self._loop.call_soon_threadsafe(self._gate._release_one)


class QueryGate:
    """At most ``max_running`` admitted queries at once; see the module docstring.

    Raises:
        ValueError: ``max_running`` below 1 or a negative ``queue_timeout_seconds``.
    """

    def __init__(self, max_running: int, queue_timeout_seconds: float) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if queue_timeout_seconds < 0:
            raise ValueError(f"queue_timeout_seconds must be >= 0, got {queue_timeout_seconds}")
        self.max_running = max_running
        self.queue_timeout_seconds = queue_timeout_seconds
        self._semaphore = asyncio.Semaphore(max_running)
        self._running = 0
        self._waiting = 0

    @property
    def running(self) -> int:
        """Slots taken now (queries admitted and not yet ended)."""
        return self._running

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        return self._waiting

    @property
    def retry_after_seconds(self) -> int:
        """``Retry-After`` of a refusal: the queue timeout rounded up, at least 1 s."""
        return max(1, math.ceil(self.queue_timeout_seconds))

    async def admit(self) -> Slot:
        """Take a slot, waiting at most ``queue_timeout_seconds``; release it with
        :meth:`Slot.release` (from any thread).

        Raises:
            QueryBusy: no slot became free in time.
        """
        if self._semaphore.locked() or self._waiting:
            self._waiting += 1
            try:
                if self.queue_timeout_seconds == 0:
                    raise TimeoutError
                await asyncio.wait_for(
                    self._semaphore.acquire(), timeout=self.queue_timeout_seconds
                )
            except TimeoutError:
                raise QueryBusy(
                    f"{self.max_running} queries are running, the most this agent runs at once, "
                    f"and none ended within {self.queue_timeout_seconds:g} s; retry later",
                    self.retry_after_seconds,
                ) from None
            finally:
                self._waiting -= 1
        else:
            await self._semaphore.acquire()  # a slot is free: returns at once
        self._running += 1
        return Slot(self, asyncio.get_running_loop())

    def _release_one(self) -> None:
        self._running -= 1
        self._semaphore.release()

    async def run(self, work: Callable[[Callable[[], None]], T]) -> T:
        """Admit, then run ``work(release)`` on a thread of the app's thread pool and return its
        result. ``work`` must arrange for ``release`` to be called once its query has really
        ended (:func:`agent.sql.run_read_query` does, through its ``on_done``); if ``work``
        never starts (the request was cancelled first), the slot is released here.

        Raises:
            QueryBusy: no slot became free in time.
            Exception: whatever ``work`` raised.
        """
        slot = await self.admit()
        started = False

        def call() -> T:
            nonlocal started
            started = True
            return work(slot.release)

        try:
            return await anyio.to_thread.run_sync(call)
        finally:
            if not started:
                slot.release()
