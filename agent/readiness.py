"""Whether the agent's data directory can be written: the disk half of ``/readyz``.

An agent whose disk is full (``ENOSPC``) or whose data directory went read-only (``EROFS``,
``EACCES``) still answers reads, but every batch it is sent fails to commit: it must not say
it is ready. :class:`DataDirProbe` finds out the way the store would: it creates a small file
in the data directory, writes and fsyncs it, and removes it again. A write probe rather than a
free-space check (``statvfs``): free blocks say nothing of a read-only remount, a quota or a
directory whose permissions changed, and a write is what fails first on a full disk.

The answer is cached for ``ttl_seconds`` (default :data:`PROBE_TTL_SECONDS`) and one probe runs
at a time (a lock): a storm of ``/readyz`` calls writes at most one small file per TTL. The
probe does blocking file I/O; ``/readyz`` runs it in a worker thread, off the event loop. Its
system calls come from a :class:`ProbeIO` (the ``os`` functions by default), so a test can make
one probe fail without touching the process's ``os`` module.

The body also carries the agent's query ``limits`` (``sql_timeout_seconds``,
``sql_queue_timeout_seconds``), from which a client sizes its own query timeout
(:func:`agent.client.query_timeout_for`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.health import Degraded

PROBE_TTL_SECONDS = 1.5
"""How long one probe's answer is reused, in seconds."""
PROBE_FILE = ".kvscope-readyz-probe"
"""The probe's file name inside the data directory (removed after each probe)."""
PROBE_BYTES = b"kvscope readyz probe\n" * 24
"""What the probe writes and fsyncs (504 bytes: enough to need a data block)."""


def describe_os_error(exc: OSError) -> str:
    """``"ENOSPC: No space left on device"`` — the errno's name and its text."""
    name = errno.errorcode.get(exc.errno, "OSError") if exc.errno is not None else "OSError"
    return f"{name}: {exc.strerror or exc}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeIO:
    """The system calls a probe makes (``os.open``, ``os.write``, ``os.fsync``, ``os.close``,
    ``os.unlink`` by default); each raises ``OSError`` as those do."""

    open: Callable[[Path, int, int], int] = field(default=os.open)
    write: Callable[[int, bytes], int] = field(default=os.write)
    fsync: Callable[[int], None] = field(default=os.fsync)
    close: Callable[[int], None] = field(default=os.close)
    unlink: Callable[[Path], None] = field(default=os.unlink)


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    """One probe's result: ``problem`` (``None``: writable) found at ``checked_at`` (the
    probe's clock, monotonic seconds)."""

    problem: str | None
    checked_at: float


class DataDirProbe:
    """Checks, at most once per ``ttl_seconds``, that files can be created, written, fsynced and
    removed in ``data_dir``.

    Args:
        data_dir: the agent's data directory (``AgentConfig.data_dir``).
        ttl_seconds: how long an answer is reused (0: probe on every call).
        clock: monotonic seconds (a parameter for tests).
        io: the system calls the probe makes (a parameter for tests).

    Raises:
        ValueError: ``ttl_seconds`` is negative or not finite.
    """

    def __init__(self, data_dir: Path, *, ttl_seconds: float = PROBE_TTL_SECONDS, clock: Callable[[], float] = time.monotonic, io: ProbeIO | None = None) -> None:
        if not 0 <= ttl_seconds < float("inf"):
            raise ValueError(f"ttl_seconds must be finite and >= 0, got {ttl_seconds}")
        self.data_dir = Path(data_dir)
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._io = io if io is not None else ProbeIO()
        self._lock = threading.Lock()
        self._answer: ProbeAnswer | None = None  # replaced whole: readable without the lock
        self.probes = 0
        """How many times the disk was actually probed (not answered from the cache)."""

    def cached(self) -> ProbeAnswer | None:
        """The last answer while it is younger than ``ttl_seconds``, else ``None``. Never
        blocks: ``/readyz`` asks this on the event loop before sending :meth:`problem` to a
        thread."""
        answer = self._answer
        if answer is None or self._clock() - answer.checked_at >= self.ttl_seconds:
            return None
        return answer

    def problem(self) -> str | None:
        """``None`` when the data directory can be written, else why not, naming the errno
        (``"the data directory /d cannot be written (ENOSPC: No space left on device)"``).

        Blocking (file I/O, fsync): call it from a worker thread. While another thread's probe
        is under way, the answer before it is returned at once (only the very first callers
        wait), so a probe stuck on a slow disk holds one thread, not one per caller. Never
        raises for an ``OSError``.
        """
        fresh = self.cached()
        if fresh is not None:
            return fresh.problem
        previous = self._answer
        if not self._lock.acquire(blocking=previous is None):
            assert previous is not None
            return previous.problem
        try:
            fresh = self.cached()  # a probe may have finished while this thread waited
            if fresh is None:
                fresh = ProbeAnswer(self._probe(), self._clock())
                self._answer = fresh
                self.probes += 1
            return fresh.problem
        finally:
            self._lock.release()

    def _probe(self) -> str | None:
        path, io = self.data_dir / PROBE_FILE, self._io
        try:
            fd = io.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                io.write(fd, PROBE_BYTES)
                io.fsync(fd)
            finally:
                io.close(fd)
            io.unlink(path)
        except OSError as exc:
            with contextlib.suppress(OSError):  # never created, or refused too: the first error says why
                io.unlink(path)
            return f"the data directory {self.data_dir} cannot be written ({describe_os_error(exc)})"
        return None


def readiness(*, schema_version: int | None, store_open: bool, disk_problem: str | None, degraded: Sequence[Degraded], limits: Mapping[str, float] | None = None) -> tuple[int, dict[str, object]]:
    """The ``/readyz`` answer: (HTTP status, body).

    * 503 ``{"status": "not_ready", "reasons": [...], "schema_version": N | null, "degraded":
      [...], "error": {"reason": ...}}`` when the store is not open or ``disk_problem`` is set
      (``error`` is the agent's uniform error body, the reasons joined);
    * 200 ``{"status": "degraded", "schema_version": N, "degraded": [{"reason", "detail",
      "since"}, ...]}`` when :class:`agent.health.Health` holds conditions;
    * 200 ``{"status": "ready", "schema_version": N, "degraded": []}`` otherwise;

    each with ``"limits": {"sql_timeout_seconds": ..., "sql_queue_timeout_seconds": ...}``.

    ``schema_version`` is the database's migration version (:data:`agent.migrations.SCHEMA_VERSION`
    once migrated), not the event schema's. ``limits`` (the agent's ``sql_timeout_seconds`` and
    ``sql_queue_timeout_seconds``, seconds) is added to every body as ``"limits"`` when given.
    """
    reasons = ([] if store_open else ["the store is not open"]) + ([disk_problem] if disk_problem else [])
    items = [item.as_json() for item in degraded]
    extra: dict[str, object] = {"limits": dict(limits)} if limits is not None else {}
    if reasons:
        return 503, {
            "status": "not_ready",
            "reasons": reasons,
            "schema_version": schema_version if store_open else None,
            "degraded": items,
            **extra,
            "error": {"reason": "not ready: " + "; ".join(reasons)},
        }
    return 200, {"status": "degraded" if items else "ready", "schema_version": schema_version, "degraded": items, **extra}
