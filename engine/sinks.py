"""Where the engine hands its events: the :class:`EventSink` protocol, and the sinks that keep
no connection (telemetry off, or events read in-process). The client that ships events to the
agent is :class:`engine.telemetry.TelemetryClient`."""

from __future__ import annotations

from typing import Protocol

from engine.events import Event


class EventSink(Protocol):
    """Anything the engine can hand events to."""

    def emit(self, event: Event) -> None: ...

    def flush(self, timeout_seconds: float | None = None) -> bool: ...

    def close(self, timeout_seconds: float | None = None) -> None: ...


class NullSink:
    """Discards events (telemetry off)."""

    def emit(self, event: Event) -> None:
        pass

    def flush(self, timeout_seconds: float | None = None) -> bool:
        return True

    def close(self, timeout_seconds: float | None = None) -> None:
        pass


class ListSink:
    """Keeps every event in memory (tests, and callers that read events in-process)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def flush(self, timeout_seconds: float | None = None) -> bool:
        return True

    def close(self, timeout_seconds: float | None = None) -> None:
        pass
