"""The agent's own health: what ``/readyz`` reports besides "the store is open".

An agent is **ready** (200), **degraded** (200: it stores and answers, but something an operator
must know about happened — a quarantined WAL, acknowledged batches found missing at start) or
**not ready** (503: the store is not open, or the data directory cannot be written).

:class:`Health` collects the degraded conditions; :mod:`agent.server` adds them at start
(:mod:`agent.wal_guard`), ``/readyz`` and the dashboard's ingest health read them. Each
condition has a stable ``reason`` code, a human ``detail`` and the unix time it was raised.
Conditions stay until the process restarts: a quarantined WAL is a fact of this run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass

DEGRADED_REASONS = ("wal_quarantined", "acknowledged_batches_missing")
"""Reason codes of degraded conditions."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Degraded:
    """One degraded condition: ``reason`` (one of :data:`DEGRADED_REASONS`), ``detail`` (for
    people: what happened, where the evidence is kept), ``since`` (unix seconds)."""

    reason: str
    detail: str
    since: float

    def as_json(self) -> dict[str, object]:
        return asdict(self)


class Health:
    """Thread-safe list of the degraded conditions of this agent process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Degraded] = []

    def degrade(self, reason: str, detail: str, *, since: float | None = None) -> Degraded:
        """Record a condition.

        Raises:
            ValueError: ``reason`` is not one of :data:`DEGRADED_REASONS` (a caller bug).
        """
        if reason not in DEGRADED_REASONS:
            raise ValueError(f"unknown degraded reason {reason!r}")
        item = Degraded(reason=reason, detail=detail, since=time.time() if since is None else since)
        with self._lock:
            self._items.append(item)
        return item

    @property
    def degraded(self) -> tuple[Degraded, ...]:
        with self._lock:
            return tuple(self._items)
