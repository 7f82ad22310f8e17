"""The agent's DuckDB store.

Contract:

* :meth:`Store.open` opens (or creates) the file, applies the missing migrations of
  :mod:`agent.migrations`, then disables external access and locks the configuration for the
  whole database instance. Both settings are one-way: after them no statement on any cursor can
  read or write files outside the database (``read_csv``, ``COPY``, ``ATTACH``, ``INSTALL``) or
  change a setting. Python objects registered on a cursor (Arrow tables) stay readable. Before
  that it sets the session time zone to UTC, the memory limit and the threads for the instance
  (:mod:`agent.duckdb_settings`), so every cursor sees them.
* One writer: :meth:`Store.transaction` holds a lock for the whole transaction, so writes are
  serialised; it commits on normal exit and rolls back on any exception.
* Readers use :meth:`Store.cursor`: a fresh cursor (DuckDB connection to the same instance) per
  call, so a thread never shares a cursor and a query can be interrupted on its own cursor.
* :meth:`Store.close` waits for open cursors (without the writer lock, so a Parquet export
  holding a cursor can still commit), checkpoints and closes; the store cannot be used afterwards.
  A query DuckDB cannot stop at once (one long function call, :mod:`agent.deadline`) may outlast
  the wait: close names it in a warning, interrupts it and retries briefly, and if DuckDB still
  refuses leaves the connection to the process's exit — committed writes are in the WAL, which
  the next open replays (:mod:`agent.durability` marks only checkpointed seqs durable).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Self

import duckdb

from agent.duckdb_settings import apply_instance_settings
from agent.migrations import MIGRATIONS, Migration

log = logging.getLogger(__name__)

CLOSE_INTERRUPT_SECONDS = 2.0
"""How long :meth:`Store.close` retries, after interrupting the cursors still running past its
wait, before it leaves the connection open."""

def utc_now() -> datetime:
    """Now as a naive UTC datetime: the form every TIMESTAMP column of the store holds."""
    return datetime.now(UTC).replace(tzinfo=None)


def to_timestamp(unix_seconds: float) -> datetime:
    """Unix seconds as a naive UTC datetime (microsecond precision), for query parameters."""
    return datetime.fromtimestamp(unix_seconds, UTC).replace(tzinfo=None)


def lock_holder(exc: BaseException) -> str | None:
    """The process DuckDB names as holding a database file's lock, when ``exc`` is that conflict
    (DuckDB allows one read-write process per file); None for any other error."""
    marker = "Conflicting lock is held in"
    text = str(exc)
    if not isinstance(exc, duckdb.IOException) or marker not in text:
        return None
    return text.split(marker, 1)[1].split(". See also", 1)[0].strip()


class SchemaTooNewError(RuntimeError):
    """The database was written by a newer agent; this one cannot use it (a user can fix this by
    upgrading, or by pointing at another data directory)."""


class StoreClosedError(RuntimeError):
    """The store was used after :meth:`Store.close`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenReport:
    """What :meth:`Store.open` did: the migration versions it applied (empty when the file was
    already current) and the resulting schema version."""

    applied: tuple[int, ...]
    schema_version: int


class Store:
    """The DuckDB database of one agent. Thread-safe; see the module docstring."""

    def __init__(self, path: Path, con: duckdb.DuckDBPyConnection, report: OpenReport) -> None:
        """Use :meth:`open`; this only wraps an already prepared connection."""
        self.path = path
        self.open_report = report
        self._con: duckdb.DuckDBPyConnection | None = con
        self._write_lock = threading.Lock()
        self._cursor_lock = threading.Lock()
        self._cursors_closed = threading.Condition(self._cursor_lock)
        self._cursors: dict[int, tuple[duckdb.DuckDBPyConnection, str]] = {}
        """Open cursors by a serial number: the cursor and what it is for."""
        self._serial = itertools.count()
        self._close_requested = False
        self._closing = False  # past close's wait: new cursors are refused
        self._connection_left_open = False

    @classmethod
    def open(
        cls,
        path: str | Path,
        migrations: tuple[Migration, ...] = MIGRATIONS,
        *,
        wal_autocheckpoint_bytes: int | None = None,
        memory_limit_bytes: int | None = None,
        threads: int | None = None,
    ) -> Self:
        """Open ``path`` (parent folders are created), migrate it, lock it down.

        ``wal_autocheckpoint_bytes`` sets DuckDB's ``wal_autocheckpoint`` (checkpoint when the WAL
        reaches that size) before the configuration is locked; ``None`` keeps DuckDB's default.
        Every cursor of the store uses ``TimeZone = 'UTC'`` whatever the host's time zone, and
        ``memory_limit_bytes`` / ``threads`` (``None``: half of RAM / one fewer than the CPUs);
        see :mod:`agent.duckdb_settings`.

        Raises:
            duckdb.Error: the file cannot be opened (for example another process holds it) or a
                migration fails (that migration is rolled back, the file keeps the earlier ones).
            SchemaTooNewError: the file has a schema version newer than this code knows.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        con = duckdb.connect(str(path))
        try:
            apply_instance_settings(con, memory_limit_bytes=memory_limit_bytes, threads=threads)
            report = _migrate(con, migrations)
            if wal_autocheckpoint_bytes is not None:
                con.execute(f"SET wal_autocheckpoint = '{int(wal_autocheckpoint_bytes)}B'")
            con.execute("SET enable_external_access = false")
            con.execute("SET lock_configuration = true")
        except BaseException:
            con.close()
            raise
        return cls(path, con, report)

    @property
    def is_open(self) -> bool:
        """Whether the store can be used: False once :meth:`close` has begun closing."""
        return self._con is not None and not self._closing

    @property
    def close_requested(self) -> bool:
        """True once :meth:`close` was called (it may still be waiting for open cursors, which
        can still commit meanwhile)."""
        return self._close_requested

    @property
    def connection_left_open(self) -> bool:
        """True after a :meth:`close` that DuckDB refused (a query still ran): DuckDB then runs
        no new statement on the connection (so the store is not open for use) but still holds
        the database (and its file lock) until a later ``close()`` succeeds or the process
        exits."""
        return self._connection_left_open

    @property
    def running(self) -> tuple[str, ...]:
        """What each open cursor is for (its ``purpose``, else its thread's name)."""
        with self._cursor_lock:
            return tuple(purpose for _, purpose in self._cursors.values())

    @property
    def schema_version(self) -> int:
        return self.open_report.schema_version

    def _connection(self) -> duckdb.DuckDBPyConnection:
        if self._con is None or self._closing:
            raise StoreClosedError(f"store {self.path} is closed")
        return self._con

    @contextmanager
    def cursor(self, *, purpose: str | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
        """A fresh cursor for reading, closed on exit. Use it from one thread only. ``purpose``
        (default: the thread's name) is what :meth:`close` names if the cursor outlasts its wait.

        Raises:
            StoreClosedError: the store is closed or closing.
        """
        with self._cursor_lock:
            cur = self._connection().cursor()
            serial = next(self._serial)
            self._cursors[serial] = (cur, purpose or f"thread {threading.current_thread().name}")
        try:
            yield cur
        finally:
            cur.close()
            with self._cursor_lock:
                del self._cursors[serial]
                self._cursors_closed.notify_all()

    @contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """Hold the writer lock and run one transaction on a fresh cursor.

        Commits when the block exits normally; rolls back and re-raises on any exception, so a
        failed write leaves the database unchanged.
        """
        with self._write_lock, self.cursor() as cur:
            cur.execute("BEGIN TRANSACTION")
            try:
                yield cur
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")

    def checkpoint(self, *, after: Callable[[], None] | None = None) -> None:
        """Fold the WAL into the database file (``CHECKPOINT``), holding the writer lock so no
        write transaction of this store is open meanwhile; ``after`` runs once the checkpoint
        succeeded, still under the lock (what :mod:`agent.durability` marks durable).

        Raises:
            duckdb.Error, StoreClosedError: the store failed or is closed (``after`` not run).
        """
        with self._write_lock, self.cursor() as cur:
            cur.execute("CHECKPOINT")
            if after is not None:
                after()

    def close(self, *, cursor_wait_seconds: float = 30.0, interrupt_wait_seconds: float = CLOSE_INTERRUPT_SECONDS) -> bool:
        """Checkpoint (fold the WAL into the file) and close. Idempotent; True once DuckDB's
        connection is closed.

        First waits up to ``cursor_wait_seconds`` for open cursors to close, without the writer
        lock (a cursor's holder may still commit): DuckDB refuses to close a connection while
        one of its cursors still runs, as a query answered 408 at its time limit may (one long
        function call, :mod:`agent.deadline`). Past the wait it logs a warning naming what still
        runs, refuses new cursors, checkpoints, and closes; if DuckDB refuses because a cursor is
        busy, it interrupts the open cursors and retries for ``interrupt_wait_seconds``. If
        DuckDB still refuses, it logs an error and returns False: :attr:`is_open` is False,
        :attr:`connection_left_open` True, and a later ``close()`` tries again. Never raises for
        a busy cursor.

        Raises:
            duckdb.Error: the checkpoint failed (raised after the close was attempted; the WAL
                keeps what it did not fold in).
        """
        with self._cursor_lock:
            if self._con is None:
                return True
            self._close_requested = True
            if not self._cursors_closed.wait_for(lambda: not self._cursors, timeout=cursor_wait_seconds):
                log.warning(
                    "closing store %s: still running after %g s: %s; checkpointing and closing without them",
                    self.path, cursor_wait_seconds, "; ".join(p for _, p in self._cursors.values()),
                )
        with self._write_lock, self._cursor_lock:
            con = self._con
            if con is None:  # closed by another thread meanwhile
                return True
            self._closing = True
            failure: duckdb.Error | None = None
            if not self._connection_left_open:  # after a refused close DuckDB runs no statement on it
                try:
                    con.execute("CHECKPOINT")
                except duckdb.Error as exc:
                    failure = exc
            closed = self._close_connection(con, interrupt_wait_seconds)
            if closed:
                self._con = None
            self._connection_left_open = not closed
        if failure is not None:
            raise failure
        return closed

    def _close_connection(self, con: duckdb.DuckDBPyConnection, interrupt_wait_seconds: float) -> bool:
        """Close ``con`` (the cursor lock held); interrupt busy cursors and retry while DuckDB
        refuses. False when it still refuses after ``interrupt_wait_seconds``."""
        try:
            con.close()
            return True
        except duckdb.ResourceInUseException:
            pass
        busy = "; ".join(p for _, p in self._cursors.values()) or "a cursor"
        for cur, _ in self._cursors.values():
            with contextlib.suppress(duckdb.Error):  # a cursor closed meanwhile
                cur.interrupt()
        until = time.monotonic() + interrupt_wait_seconds
        while True:
            self._cursors_closed.wait(timeout=max(0.0, min(0.05, until - time.monotonic())))
            try:
                con.close()
                return True
            except duckdb.ResourceInUseException:
                if time.monotonic() >= until:
                    break
        log.error(
            "store %s left open: DuckDB refuses to close it while %s still runs, even %g s after "
            "an interrupt; committed writes are in its WAL, which the next start replays",
            self.path, busy, interrupt_wait_seconds,
        )
        return False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _migrate(con: duckdb.DuckDBPyConnection, migrations: tuple[Migration, ...]) -> OpenReport:
    versions = [m.version for m in migrations]
    if versions != list(range(1, len(migrations) + 1)):
        raise RuntimeError(f"migration versions must be 1..n without gaps, got {versions}")
    con.execute(
        """
        CREATE TABLE IF NOT EXISTS schema_migrations (
            version INTEGER PRIMARY KEY,
            name VARCHAR NOT NULL,
            applied_at TIMESTAMP NOT NULL
        )
        """
    )
    ((current,),) = con.execute(
        "SELECT coalesce(max(version), 0) FROM schema_migrations"
    ).fetchall()
    if current > len(migrations):
        raise SchemaTooNewError(
            f"database schema version {current} is newer than this agent's "
            f"{len(migrations)}; upgrade kvscope"
        )
    applied: list[int] = []
    for migration in migrations[current:]:
        con.execute("BEGIN TRANSACTION")
        try:
            for statement in migration.statements:
                con.execute(statement)
            con.execute(
                "INSERT INTO schema_migrations VALUES ($version, $name, $applied_at)",
                {"version": migration.version, "name": migration.name, "applied_at": utc_now()},
            )
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")
        applied.append(migration.version)
    return OpenReport(applied=tuple(applied), schema_version=len(migrations))
