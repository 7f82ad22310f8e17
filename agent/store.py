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
* :meth:`Store.close` checkpoints and closes; the store cannot be used afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Self

import duckdb

from agent.duckdb_settings import apply_instance_settings
from agent.migrations import MIGRATIONS, Migration


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
        self._open_cursors = 0

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
        return self._con is not None

    @property
    def schema_version(self) -> int:
        return self.open_report.schema_version

    def _connection(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            raise StoreClosedError(f"store {self.path} is closed")
        return self._con

    @contextmanager
    def cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A fresh cursor for reading, closed on exit. Use it from one thread only."""
        with self._cursor_lock:
            cur = self._connection().cursor()
            self._open_cursors += 1
        try:
            yield cur
        finally:
            cur.close()
            with self._cursor_lock:
                self._open_cursors -= 1
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

    def close(self, *, cursor_wait_seconds: float = 30.0) -> None:
        """Checkpoint (fold the WAL into the file) and close. Idempotent.

        First waits up to ``cursor_wait_seconds`` for open cursors to close: DuckDB refuses to
        close a connection while one of its cursors still runs, as a query answered 408 at its
        time limit may (one long function call, :mod:`agent.deadline`).
        """
        with self._write_lock, self._cursor_lock:
            if self._con is None:
                return
            self._cursors_closed.wait_for(lambda: self._open_cursors == 0, timeout=cursor_wait_seconds)
            con, self._con = self._con, None
            try:
                con.execute("CHECKPOINT")
            finally:
                con.close()

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
