"""Opening the database when its WAL may be damaged: never crash-loop, never lose silently.

DuckDB replays ``<database>.wal`` when it opens the file. A damaged WAL either fails the replay
(``Corrupt WAL file: … checksum does not match``: every start exits, a crash loop) or — a
truncated WAL, an overwritten header — replays short or not at all *without an error*, and the
batches the agent had acknowledged are gone. :func:`preflight` runs before the agent opens the
store:

1. When a WAL exists, a copy of its bytes is kept (``<wal>.preflight``) until the start is
   checked.
2. A **child process** opens the database (replaying the WAL), checkpoints and closes it, so a
   failure — even an abort inside DuckDB — cannot take the agent down with it. (DuckDB does not
   always checkpoint a replayed WAL at close; after an explicit ``CHECKPOINT`` a WAL that is
   still there is one DuckDB did not use.)
3. When the replay fails because of the WAL (DuckDB names it, or the child crashed inside
   DuckDB) and the database opens once the WAL is set aside, the WAL is **quarantined**: renamed
   to ``<data_dir>/quarantine/<name>.wal.<UTC time>``, bytes kept, and the database opens at its
   last checkpoint. A WAL DuckDB left in place after a successful open and checkpoint (one it did
   not recognise) is quarantined the same way. Anything else — a full or read-only disk, a
   damaged database file, a timeout, an OOM kill, another process holding the file — moves
   nothing.

After :class:`~agent.store.Store` opened, :func:`missing_acknowledged` compares the
acknowledgement log (:mod:`agent.durability`) with ``ingest_batches``: batches acknowledged but
not stored were lost with the WAL (the silent cases). Either finding makes the agent start
**degraded** (:mod:`agent.health`) with a loud log line and a metric; the engines re-send what
is above their durable watermark, so once their spools drain nothing is lost.

Raises :class:`DatabaseUnusableError` when the database cannot be opened for another reason (the
message says which; ``kvscope agent`` exits 2 with it): a damaged database file itself, a full
disk, is not something the agent can repair, and its WAL is then left where it was.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from agent.durability import AckLog, fsync_dir
from agent.ingest import registered
from agent.store import Store

log = logging.getLogger(__name__)

PREFLIGHT_TIMEOUT_SECONDS = 600.0
"""How long the child may take to replay the WAL (a 16 MiB WAL replays in about a second)."""

_CHILD = """
import sys
import duckdb
con = duckdb.connect(sys.argv[1])
con.execute("SELECT count(*) FROM duckdb_tables()").fetchall()
print("replayed", flush=True)
con.execute("CHECKPOINT")  # fold what was replayed: a WAL still there afterwards was not used
con.close()
print("checkpointed", flush=True)
"""
_LOCK_MARKER = "Conflicting lock is held"
_NOT_DAMAGE_MARKERS = ("No space left", "File too large", "Permission denied", "Read-only file system", "Disk quota")
"""Failures of the environment, not of the WAL: the agent refuses to start instead."""
_CRASH_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
"""Signals of a process that crashed inside DuckDB (a SIGKILL is the OOM killer or an operator)."""


class DatabaseUnusableError(RuntimeError):
    """The database cannot be opened, and it is not a WAL the agent can set aside: the file itself
    is damaged, the disk is full or read-only, the quarantine folder cannot be written, or
    opening it took longer than :data:`PREFLIGHT_TIMEOUT_SECONDS` (the message says which)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PreflightReport:
    """What :func:`preflight` found.

    ``quarantined``: where the WAL was moved (None: not moved); ``error``: why (DuckDB's message,
    or why the WAL was not recognised); ``wal_copy``: the copy of the WAL's bytes kept until the
    start is checked (None when there was no WAL or it was quarantined).
    """

    quarantined: Path | None = None
    error: str | None = None
    wal_copy: Path | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class _ChildResult:
    replayed: bool
    checkpointed: bool
    error: str | None
    wal_suspect: bool
    """Whether the failure can be the WAL's: DuckDB named the WAL, or crashed."""


def wal_path(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + ".wal")


def quarantine_dir(db_path: Path) -> Path:
    return db_path.parent / "quarantine"


def _open_in_child(db_path: Path) -> _ChildResult:
    """Open (replaying the WAL), checkpoint and close ``db_path`` in a child process."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(db_path)],
            capture_output=True,
            text=True,
            timeout=PREFLIGHT_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return _ChildResult(
            replayed=False,
            checkpointed=False,
            error=f"opening the database did not finish in {PREFLIGHT_TIMEOUT_SECONDS:.0f} s",
            wal_suspect=False,
        )
    replayed, checkpointed = "replayed" in done.stdout, "checkpointed" in done.stdout
    if done.returncode == 0:
        return _ChildResult(replayed=replayed, checkpointed=checkpointed, error=None, wal_suspect=False)
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    if done.returncode < 0:
        sig = signal.Signals(-done.returncode)
        error = f"the process opening the database died of {sig.name}: {' '.join(lines[-3:])}"
        return _ChildResult(replayed=replayed, checkpointed=False, error=error, wal_suspect=not replayed and sig in _CRASH_SIGNALS)
    error = lines[-1] if lines else f"exit status {done.returncode}"
    suspect = not replayed and "WAL" in error and not any(m in error for m in _NOT_DAMAGE_MARKERS)
    return _ChildResult(replayed=replayed, checkpointed=False, error=error, wal_suspect=suspect)


def quarantine(db_path: Path, source: Path, *, now: datetime | None = None) -> Path:
    """Move ``source`` (the WAL, or its kept copy) into the quarantine folder with a UTC time
    stamp in its name; returns the new path.

    Raises:
        DatabaseUnusableError: the quarantine folder cannot be created or written.
    """
    folder = quarantine_dir(db_path)
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S.%fZ")
    target = folder / f"{wal_path(db_path).name}.{stamp}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)
        fsync_dir(folder)
        fsync_dir(source.parent)
    except OSError as exc:
        raise DatabaseUnusableError(f"cannot move {source} into the quarantine folder {folder}: {exc}") from None
    return target


def preflight(db_path: Path) -> PreflightReport:
    """Make ``db_path`` openable: replay its WAL in a child, quarantine a WAL that cannot be
    replayed (see the module docstring).

    Only a failure that names the WAL (or a crash inside DuckDB) while a WAL exists, and that
    goes away once the WAL is set aside, quarantines it; a WAL DuckDB leaves unused after an
    explicit checkpoint is quarantined too. Another process holding the file is not damage:
    nothing is moved, and the caller's own open then fails naming that process (as DuckDB
    does).

    Raises:
        DatabaseUnusableError: anything else that stops the open — the file itself damaged (the
            WAL is then left in place), a full or read-only disk, a timeout, an OOM kill.
    """
    wal = wal_path(db_path)
    copy: Path | None = None
    if wal.exists():
        copy = wal.with_name(wal.name + ".preflight")
        try:
            shutil.copyfile(wal, copy)
        except OSError as exc:  # a full disk: go on without the evidence copy
            log.warning("could not keep a copy of %s before replaying it: %s", wal, exc)
            _discard(copy)
            copy = None
    first = _open_in_child(db_path)
    if first.error is not None and _LOCK_MARKER in first.error:  # not damage: Store.open names the holder
        _discard(copy)
        return PreflightReport()
    if first.error is None:
        if not wal.exists():
            return PreflightReport(wal_copy=copy)
        error = "DuckDB opened the database without replaying its WAL (its header does not match the file)"
    elif wal.exists() and first.wal_suspect:
        error = first.error
    else:
        _discard(copy)
        where = "" if not wal.exists() else f"; its WAL {wal} is left in place"
        raise DatabaseUnusableError(f"cannot open {db_path}: {first.error}{where}")
    target = quarantine(db_path, wal)
    retry = _open_in_child(db_path)
    if retry.error is not None:
        os.replace(target, wal)  # not the WAL's fault after all: leave everything as it was
        _discard(copy)
        raise DatabaseUnusableError(
            f"cannot open {db_path}: {first.error}; nor without its WAL: {retry.error}; the WAL is left in place"
        )
    _discard(copy)
    log.error(
        "STORE DEGRADED: the WAL of %s could not be replayed (%s); moved to %s (bytes kept); the "
        "database opens at its last checkpoint and engines re-send what is not durable",
        db_path,
        error,
        target,
    )
    return PreflightReport(quarantined=target, error=error)


def _discard(copy: Path | None) -> None:
    if copy is not None:
        copy.unlink(missing_ok=True)


def finish(db_path: Path, report: PreflightReport, *, lost: bool) -> Path | None:
    """After the start was checked: drop the WAL's kept copy, or — when acknowledged batches
    were found missing — quarantine it as the evidence. Returns where it went (None: dropped)."""
    if report.wal_copy is None or not report.wal_copy.exists():
        return None
    if lost:
        return quarantine(db_path, report.wal_copy)
    report.wal_copy.unlink()
    return None


def missing_acknowledged(store: Store, ack_log_file: Path) -> dict[str, list[int]]:
    """Engine id → the seqs the acknowledgement log lists as stored that ``ingest_batches`` does
    not hold as stored (acknowledged, then lost), sorted."""
    pairs, torn = AckLog.read(ack_log_file)
    if torn:
        log.warning("acknowledgement log %s: %d bytes at its end unreadable (a flush cut short; never answered)", ack_log_file, torn)
    if not pairs:
        return {}
    acked = pa.table({"engine_id": pa.array([p[0] for p in pairs], pa.string()), "seq": pa.array([p[1] for p in pairs], pa.int64())})
    with store.cursor() as cur, registered(cur, "_acked", acked):
        rows = cur.execute(
            """
            SELECT DISTINCT a.engine_id, a.seq FROM _acked a
            ANTI JOIN (SELECT engine_id, seq FROM ingest_batches WHERE status = 'stored') b
              ON a.engine_id = b.engine_id AND a.seq = b.seq
            ORDER BY 1, 2
            """
        ).fetchall()
    missing: dict[str, list[int]] = defaultdict(list)
    for engine_id, seq in rows:
        missing[engine_id].append(int(seq))
    return dict(missing)


def describe_missing(missing: dict[str, list[int]]) -> str:
    """``3 acknowledged batches missing: engine e1 seqs 30..32`` (ranges per engine)."""
    parts = []
    for engine_id, seqs in sorted(missing.items()):
        ranges: list[str] = []
        start = prev = seqs[0]
        for seq in [*seqs[1:], None]:
            if seq is not None and seq == prev + 1:
                prev = seq
                continue
            ranges.append(str(start) if start == prev else f"{start}..{prev}")
            if seq is not None:
                start = prev = seq
        parts.append(f"engine {engine_id} seqs {', '.join(ranges[:8])}{' …' if len(ranges) > 8 else ''}")
    total = sum(len(s) for s in missing.values())
    return f"{total} acknowledged batches missing after start: " + "; ".join(parts[:16])
