"""The telemetry client's in-memory buffer: what :meth:`TelemetryClient.emit
<engine.telemetry.TelemetryClient.emit>` puts events on, on the engine's hot path.

:meth:`EventBuffer.put` is one bound check and one ``collections.deque.append`` (atomic under the
GIL; no lock, no condition variable): a full buffer refuses the event (the caller counts it
dropped). The one consumer, the client's sender thread, takes batches with :meth:`EventBuffer.take`
— when ``batch_max_events`` are waiting, when the first of them has waited ``batch_max_seconds``,
or at once while someone waits in :meth:`EventBuffer.drained` — and reports each batch done
(:meth:`EventBuffer.done`), so ``drained`` knows when everything put was handled. The same shape
as the OpenTelemetry SDK's ``BatchSpanProcessor`` (a bounded queue, a size or delay trigger, a
forced flush).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from engine.events import Event


class EventBuffer:
    """A bounded buffer of events with one consumer.

    Args:
        max_events: events held at most; :meth:`put` refuses more.
        batch_max_events / batch_max_seconds: when :meth:`take` hands out a batch.

    Raises:
        ValueError: a non-positive limit.
    """

    def __init__(self, max_events: int, batch_max_events: int, batch_max_seconds: float) -> None:
        if max_events <= 0 or batch_max_events <= 0 or batch_max_seconds <= 0:
            raise ValueError("telemetry queue and batch limits must be positive")
        self.max_events = max_events
        self.batch_max_events = batch_max_events
        self.batch_max_seconds = batch_max_seconds
        self._events: deque[Event] = deque()
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._taken = 0
        self._hurry = 0

    def __len__(self) -> int:
        return len(self._events)

    def put(self, event: Event) -> bool:
        """Add ``event``; False (nothing added) when the buffer is full. Never blocks."""
        events = self._events
        if len(events) >= self.max_events:
            return False
        events.append(event)
        if len(events) == self.batch_max_events:
            self._wake.set()
        return True

    def take(self, idle_seconds: float, stop: Callable[[], bool]) -> list[Event]:
        """The next batch (at most ``batch_max_events``, oldest first), waiting up to
        ``idle_seconds`` for a first event and then up to ``batch_max_seconds`` for the batch to
        fill (not while :meth:`drained` waits or once ``stop()`` is true). Empty when nothing
        came. Call :meth:`done` after handling a non-empty batch."""
        if not self._events:
            self._wake.wait(idle_seconds)
            self._wake.clear()
            if not self._events:
                return []
        deadline = time.monotonic() + self.batch_max_seconds
        while len(self._events) < self.batch_max_events and not self._hurry and not stop():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._wake.wait(min(remaining, 0.05))
            self._wake.clear()
        with self._cond:
            events = self._events
            batch = [events.popleft() for _ in range(min(len(events), self.batch_max_events))]
            self._taken = len(batch)
        return batch

    def done(self) -> None:
        """The batch :meth:`take` handed out is handled (sent, spooled or given up on)."""
        with self._cond:
            self._taken = 0
            self._cond.notify_all()

    def drained(self, timeout_seconds: float | None) -> bool:
        """Wait until every event put was taken and handled; True if that happened in time.
        While it waits, :meth:`take` does not wait for batches to fill."""
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        with self._cond:
            self._hurry += 1
        self._wake.set()
        try:
            with self._cond:
                while self._events or self._taken:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._cond.wait(0.05 if remaining is None else min(remaining, 0.05))
            return True
        finally:
            with self._cond:
                self._hurry -= 1
