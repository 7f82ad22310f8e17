"""When each request of a trace replay goes out: the one schedule of the in-process replay
(:mod:`engine.trace.replay`) and of the replay against a server (:mod:`engine.trace.http_replay`).

Every session is a closed-loop client: its next request may go out once the previous one ended
and no earlier than its compressed arrival (:func:`compressed_offsets`). At most ``limit``
requests are out at once (the engine's ``max_num_seqs``); when more are due, the one that
arrived first in the trace goes first — so an engine that falls behind serves the trace in its
own order, as a one-request-at-a-time replay does, rather than putting a session's follow-up
turn behind every first turn that was queued while it waited.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from engine.trace.formats import TraceRequest


def compressed_offsets(requests: Sequence[TraceRequest], speed: float, max_wait_seconds: float) -> dict[str, float]:
    """Wall seconds from the replay's start at which each request may go out: the trace's arrival
    gaps in global order, divided by ``speed``, each capped at ``max_wait_seconds``."""
    offsets: dict[str, float] = {}
    ordered = sorted(requests, key=lambda r: r.arrival_seconds)
    clock, previous = 0.0, ordered[0].arrival_seconds if ordered else 0.0
    for r in ordered:
        clock += min(max(0.0, r.arrival_seconds - previous) / speed, max_wait_seconds)
        previous = r.arrival_seconds
        offsets[r.request_id] = clock
    return offsets


class ArrivalSchedule:
    """The replay's dispatch (module docstring); single-threaded, times in wall seconds since
    the replay's start.

    Args:
        requests: the requests to replay (any order; each session's go out in arrival order).
        speed, max_wait_seconds: as :func:`compressed_offsets`.
        limit: requests out at once (at least 1).

    Raises:
        ValueError: ``limit`` below 1.
    """

    def __init__(self, requests: Sequence[TraceRequest], *, speed: float, max_wait_seconds: float, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit = {limit} must be at least 1")
        self.limit = limit
        self.offsets = compressed_offsets(requests, speed, max_wait_seconds)
        self._order = {r.request_id: i for i, r in enumerate(sorted(requests, key=lambda r: r.arrival_seconds))}
        self._sessions: dict[str, deque[TraceRequest]] = {}
        for r in sorted(requests, key=lambda r: r.arrival_seconds):
            self._sessions.setdefault(r.session_id, deque()).append(r)
        self._busy: set[str] = set()
        self.closed = False

    @property
    def in_flight(self) -> int:
        """Requests out and not yet :meth:`ended`."""
        return len(self._busy)

    def _heads(self) -> list[TraceRequest]:
        """Each idle session's next request, in trace arrival order."""
        heads = [q[0] for sid, q in self._sessions.items() if q and sid not in self._busy]
        return sorted(heads, key=lambda r: self._order[r.request_id])

    def take_due(self, elapsed: float) -> list[TraceRequest]:
        """Pop the requests that go out now, ``elapsed`` seconds into the replay: idle sessions'
        next requests whose offset has come, first arrival first, while fewer than ``limit`` are
        out. Nothing after :meth:`close`."""
        due: list[TraceRequest] = []
        if self.closed:
            return due
        for head in self._heads():
            if self.in_flight >= self.limit:
                break
            if self.offsets[head.request_id] <= elapsed:
                self._sessions[head.session_id].popleft()
                self._busy.add(head.session_id)
                due.append(head)
        return due

    def next_due(self) -> float | None:
        """The offset at which an idle session's next request may go out (None when every
        session is busy or done, or ``limit`` requests are out, or after :meth:`close`)."""
        if self.closed or self.in_flight >= self.limit:
            return None
        offsets = [self.offsets[h.request_id] for h in self._heads()]
        return min(offsets) if offsets else None

    def ended(self, request: TraceRequest) -> None:
        """``request`` ended (answered, refused or skipped): its session may send its next one.

        Raises:
            RuntimeError: ``request`` was not out (an internal invariant).
        """
        if request.session_id not in self._busy:
            raise RuntimeError(f"request {request.request_id} ended but was not out")
        self._busy.discard(request.session_id)

    def close(self) -> None:
        """Send nothing more (a stop): the requests out still end."""
        self.closed = True

    def finished(self) -> bool:
        """Nothing out and nothing left to send (or closed)."""
        return self.in_flight == 0 and (self.closed or not any(self._sessions.values()))

    def not_sent(self) -> int:
        """Requests that never went out."""
        return sum(len(q) for q in self._sessions.values())
