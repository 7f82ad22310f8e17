"""Time limits for queries: interrupt at the limit, and answer at the limit even when the query
cannot be stopped at once.

DuckDB checks for an interrupt between vectors of a pipeline, so ``interrupt()`` stops a scan or
a join within milliseconds, but one long scalar function call — ``repeat('x', 10^9)``, a
``list_sort`` over a list of tens of millions of elements — runs to its end first (measured on
duckdb 2.0.1: ``SELECT length(repeat('x', 500000000))`` interrupted at 0.5 s ended after 4.3 s,
``SELECT len(list_sort(range(30000000)))`` after 9 s). So the query runs on a worker thread
(:func:`run_in_worker`) and its caller waits only until the limit (plus
:data:`INTERRUPT_GRACE_SECONDS` for the interrupt to land); past that the caller gets
:class:`StillRunning` while the worker goes on until DuckDB returns, and only then calls its
``on_done`` (which releases the query's slot in :mod:`agent.query_gate`, so such queries cannot
pile up). This is how a server answers a statement timeout while the backend winds down
(PostgreSQL's ``statement_timeout`` sets a flag checked at the next interrupt point).

The worker thread lowers its own CPU priority (Linux per-thread niceness, :data:`QUERY_NICENESS`),
so under contention the ingest flush and the HTTP loop are scheduled first.

One :class:`Budget` per query holds the single instant its time limit counts from: the caller's
wait and the interrupt timer both end at ``start + seconds`` (the timer gets what is left when
the query starts, after admission on the slow worker). When the caller gives up first,
:meth:`Budget.abandon` says which case it was: the query never started (and now never will), or
it ran and was interrupted but has not stopped.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import duckdb

T = TypeVar("T")

INTERRUPT_GRACE_SECONDS = 0.1
"""How long past its limit a caller waits for an interrupted query to end before answering."""
QUERY_NICENESS = 10
"""Added to a query worker thread's niceness (Linux; ignored where it cannot be set)."""


class StillRunning(TimeoutError):
    """The work did not end by the time limit; it goes on in its worker thread."""


class Deadline:
    """Interrupts ``cursor`` after ``seconds`` unless stopped first; ``fired`` tells whether it
    did. The lock makes sure no interrupt lands after :meth:`stop` returned."""

    def __init__(self, cursor: duckdb.DuckDBPyConnection, seconds: float) -> None:
        self._cursor = cursor
        self._lock = threading.Lock()
        self._done = False
        self.fired = False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def start(self) -> None:
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if not self._done:
                self.fired = True
                self._cursor.interrupt()

    def fire_now(self) -> None:
        """Interrupt at once unless stopped (the limit passed and the timer thread was late)."""
        self._timer.cancel()
        self._fire()

    def stop(self) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()


class Budget:
    """One query's time limit, counted from one instant (its creation, by default: before the
    worker starts) for both the caller's wait and the interrupt timer.

    Args:
        seconds: the limit, seconds.
        clock: monotonic seconds (a parameter for tests).
    """

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._started_at = clock()
        self._lock = threading.Lock()
        self._abandoned = False
        self.guard: Deadline | None = None
        """The interrupt timer, once the query started under it (:meth:`begin`)."""

    def remaining(self) -> float:
        """Seconds left of the limit (negative once past it)."""
        return self.seconds - (self._clock() - self._started_at)

    def begin(self, cursor: duckdb.DuckDBPyConnection) -> Deadline | None:
        """Start the interrupt timer on ``cursor`` for the time left, just before the query
        runs; ``None`` (run nothing) when no time is left or the caller already gave up."""
        with self._lock:
            left = self.remaining()
            if self._abandoned or left <= 0:
                return None
            self.guard = Deadline(cursor, left)
            self.guard.start()
            return self.guard

    def abandon(self) -> bool:
        """The caller stops waiting: True when the query had started (it is interrupted now if
        its timer was late), False when it had not (:meth:`begin` will refuse it)."""
        with self._lock:
            self._abandoned = True
            guard = self.guard
        if guard is None:
            return False
        guard.fire_now()
        return True


def lower_thread_priority(niceness: int = QUERY_NICENESS) -> None:
    """Raise the calling thread's niceness by ``niceness`` (Linux schedules threads one by one;
    an unprivileged process may always lower its own priority). Does nothing where unsupported."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)


def run_in_worker(
    work: Callable[[], T],
    *,
    wait_seconds: float,
    on_done: Callable[[], None] | None = None,
    name: str = "kvscope-query",
) -> T:
    """Run ``work`` on a fresh daemon thread at lower CPU priority and wait at most
    ``wait_seconds`` for its result.

    ``on_done`` is called exactly once, from the worker, when ``work`` has really returned or
    raised — or at once, here, if the thread cannot be started.

    Raises:
        StillRunning: ``work`` had not ended after ``wait_seconds`` (it goes on; ``on_done``
            follows when it ends).
        Exception: whatever ``work`` raised.
    """
    outcome: Future[T] = Future()

    def run() -> None:
        try:
            lower_thread_priority()
            outcome.set_result(work())
        except BaseException as exc:  # handed to the waiting caller
            outcome.set_exception(exc)
        finally:
            if on_done is not None:
                on_done()

    try:
        threading.Thread(target=run, name=name, daemon=True).start()
    except BaseException:
        if on_done is not None:
            on_done()
        raise
    try:
        return outcome.result(timeout=wait_seconds)
    except TimeoutError:
        if outcome.done():  # ended in the instant between the wait and this check
            return outcome.result()
        raise StillRunning(f"still running after {wait_seconds:g} s") from None
