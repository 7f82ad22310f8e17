"""The read-only SQL sandbox behind ``POST /v1/sql`` (and the runner of named queries).

Rules, in the order they apply:

1. **One read statement** (:mod:`agent.sql_check`). The text is split and typed by DuckDB's own
   parser (``duckdb.extract_statements``); exactly one statement of type ``SELECT`` is admitted
   (this includes ``WITH``, ``FROM t``, ``VALUES``, ``DESCRIBE``, ``SHOW``, ``SUMMARIZE``).
   Anything else — ``COPY``, ``ATTACH``, ``SET``, ``INSERT``, ``DELETE``, ``PRAGMA``, ``CALL``,
   ``EXPLAIN`` — or more than one statement is refused (:class:`SqlForbidden`, HTTP 403); one
   nested too deep to check is a 400.
2. **No files.** The store disabled external access for the whole instance, so ``read_csv``,
   ``glob`` or ``read_parquet`` on a path fail with DuckDB's permission error (HTTP 400).
3. **Read-only transaction.** The statement runs inside ``BEGIN TRANSACTION READ ONLY`` on its own
   cursor and is rolled back, so even a ``SELECT`` with a side effect cannot change data.
4. **Row cap.** At most ``row_limit`` rows are fetched (the engine streams, so the rest is never
   computed); ``truncated`` says whether more existed.
5. **Time limit.** A timer thread calls ``interrupt()`` on the query's cursor after
   ``timeout_seconds``; the query stops and :class:`SqlTimeout` (HTTP 408) is raised. The time
   limit covers execution and fetching. :func:`run_read_query` runs the query on a worker thread
   (:mod:`agent.deadline`), so the 408 comes at the limit even for one long function call that
   DuckDB can only stop when the call returns; the worker ends later and then calls ``on_done``.
   The limit counts from before the worker starts, for the wait and the timer alike: admission
   on the slow worker spends it, and a query whose limit passed before it started never runs
   (its 408 says so).
6. **UTC.** The store's connections use ``TimeZone = 'UTC'`` (:mod:`agent.duckdb_settings`),
   so ``now()`` and timestamp arithmetic do not depend on the host's time zone.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Literal

import duckdb
import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from agent.deadline import INTERRUPT_GRACE_SECONDS, Budget, StillRunning, run_in_worker
from agent.sql_check import FORBIDDEN_FUNCTIONS, SqlError, SqlForbidden, check_read_only
from agent.store import Store

__all__ = [
    "FORBIDDEN_FUNCTIONS",
    "MEDIA_TYPES",
    "RESULT_FORMATS",
    "ResultFormat",
    "ResultSet",
    "SqlError",
    "SqlForbidden",
    "SqlTimeout",
    "check_read_only",
    "render",
    "rows_of",
    "run_on_connection",
    "run_read_query",
]

ResultFormat = Literal["json", "csv", "arrow"]
RESULT_FORMATS: tuple[ResultFormat, ...] = ("json", "csv", "arrow")
MEDIA_TYPES: dict[ResultFormat, str] = {
    "json": "application/json",
    "csv": "text/csv; charset=utf-8",
    "arrow": "application/vnd.apache.arrow.stream",
}
_BATCH_ROWS = 2048


class SqlTimeout(SqlError):
    """The query ran past the time limit and was interrupted."""

    status = 408


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultSet:
    """A capped query result: ``table`` holds at most the row limit; ``types`` are DuckDB's
    type names (``BIGINT``, ``TIMESTAMP``, ...), one per column."""

    columns: tuple[str, ...]
    types: tuple[str, ...]
    table: pa.Table
    truncated: bool

    @property
    def row_count(self) -> int:
        return self.table.num_rows


def run_read_query(
    store: Store,
    sql: str,
    parameters: Mapping[str, object] | None = None,
    *,
    row_limit: int,
    timeout_seconds: float,
    on_done: Callable[[], None] | None = None,
    untrusted: bool = False,
) -> ResultSet:
    """Run one SELECT (already admitted by :func:`check_read_only`, or a trusted named query)
    with ``$name`` parameters on a fresh cursor of the store, on a worker thread; see
    :func:`run_on_connection`.

    The answer comes by ``timeout_seconds`` (plus a 0.1 s grace for the interrupt to land)
    even when the query cannot be stopped at once; it then goes on until DuckDB returns.
    ``on_done`` is called exactly once, when the query has really ended (see
    :func:`agent.deadline.run_in_worker`). ``untrusted``: ``sql`` came from a user; it is admitted
    with :func:`check_read_only` first, on the worker thread (at its lower CPU priority).

    Raises:
        SqlError, SqlTimeout, ValueError: as :func:`run_on_connection`; :class:`SqlTimeout` also
            when the query still runs at the limit.
        SqlForbidden: ``untrusted`` and not a single read statement.
    """

    budget = Budget(timeout_seconds)  # one start for the wait below and the interrupt timer

    def work() -> ResultSet:
        if untrusted:
            check_read_only(sql)
        with store.cursor(purpose="query " + " ".join(sql.split())[:160]) as cur:
            return run_on_connection(cur, sql, parameters, row_limit=row_limit, timeout_seconds=timeout_seconds, budget=budget)

    try:
        return run_in_worker(work, wait_seconds=budget.remaining() + INTERRUPT_GRACE_SECONDS, on_done=on_done)
    except StillRunning:
        if not budget.abandon():
            raise SqlTimeout(_not_started(timeout_seconds)) from None
        raise SqlTimeout(
            f"query exceeded the time limit of {timeout_seconds:g} s; it was interrupted but is one "
            "long function call that ends only when that call returns (it keeps its query slot "
            "until then)"
        ) from None


def _not_started(timeout_seconds: float) -> str:
    return (
        f"the time limit of {timeout_seconds:g} s passed before the query started (the agent was "
        "too busy: checking the SQL and opening its cursor took that long); it was not run and "
        "will not be, send it again"
    )


def run_on_connection(
    cur: duckdb.DuckDBPyConnection,
    sql: str,
    parameters: Mapping[str, object] | None = None,
    *,
    row_limit: int,
    timeout_seconds: float,
    budget: Budget | None = None,
) -> ResultSet:
    """Run one admitted SELECT on ``cur`` (a connection or cursor used by this thread only) in a
    read-only transaction that is rolled back, fetching at most ``row_limit`` rows and
    interrupting it after ``timeout_seconds``.

    ``budget``: the time limit counted from an earlier instant (:func:`run_read_query`'s, so the
    interrupt comes when its caller stops waiting); ``None``: ``timeout_seconds`` from now.

    Raises:
        SqlError: DuckDB rejected or failed the query (its message; permission errors included).
        SqlTimeout: the query was interrupted at the limit, or the budget was spent (or given up
            by its caller) before the query started (then nothing ran).
        ValueError: ``row_limit`` below 1.
    """
    if row_limit < 1:
        raise ValueError(f"row_limit must be >= 1, got {row_limit}")
    budget = budget if budget is not None else Budget(timeout_seconds)
    cur.execute("BEGIN TRANSACTION READ ONLY")
    try:
        guard = budget.begin(cur)
        if guard is None:
            raise SqlTimeout(_not_started(budget.seconds))
        try:
            relation = cur.sql(sql, params=dict(parameters) if parameters else None)
            if relation is None:  # a SELECT always yields a relation; be loud if not
                raise RuntimeError("a read statement produced no relation")
            columns = tuple(relation.columns)
            types = tuple(str(t) for t in relation.types)
            if "UHUGEINT" in types:  # Arrow has no unsigned 128-bit type: keep it exact as text
                relation = relation.project(
                    ", ".join(
                        f"CAST({_quote(c)} AS VARCHAR) AS {_quote(c)}" if t == "UHUGEINT" else _quote(c)
                        for c, t in zip(columns, types, strict=True)
                    )
                )
            batches: list[pa.RecordBatch] = []
            rows = 0
            with relation.to_arrow_reader(_BATCH_ROWS) as reader:
                for batch in reader:
                    batches.append(batch)
                    rows += batch.num_rows
                    if rows > row_limit:
                        break
                schema = reader.schema
        finally:
            guard.stop()
    except duckdb.InterruptException:
        if guard is not None and guard.fired:
            raise SqlTimeout(
                f"query exceeded the time limit of {budget.seconds:g} s and was interrupted"
            ) from None
        raise
    except duckdb.Error as exc:
        raise SqlError(str(exc)) from None
    finally:
        # Closing the cursor would discard the transaction anyway; never mask the error.
        with contextlib.suppress(duckdb.Error):
            cur.execute("ROLLBACK")
    table = pa.Table.from_batches(batches, schema=schema)
    return ResultSet(
        columns=columns,
        types=types,
        table=table.slice(0, row_limit),
        truncated=table.num_rows > row_limit,
    )


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def render(result: ResultSet, fmt: ResultFormat) -> bytes:
    """Serialise ``result`` as JSON (``{"columns", "types", "rows", "row_count",
    "truncated"}``, timestamps as ISO-8601 strings), CSV (header row first) or an Arrow IPC
    stream (``truncated`` in the schema metadata)."""
    if fmt == "json":
        return _render_json(result)
    if fmt == "csv":
        return _render_csv(result)
    if fmt == "arrow":
        return _render_arrow(result)
    raise ValueError(f"unknown result format {fmt!r}; known: {', '.join(RESULT_FORMATS)}")


def rows_of(result: ResultSet) -> list[list[object]]:
    """The result's rows as lists of Python values (column order kept, duplicate names safe).
    Intervals become ISO-8601 durations (``P1M2DT3.5S``); dates and timestamps Python cannot
    hold (DuckDB's ``infinity``, years past 9999) become strings; everything else is as Arrow
    gives it."""
    columns = [[_plain(v) for v in _pylist(column)] for column in result.table.columns]
    return [list(row) for row in zip(*columns, strict=True)] if columns else []


def _pylist(column: pa.ChunkedArray) -> list[object]:
    try:
        return column.to_pylist()
    except (OverflowError, ValueError):
        if not pa.types.is_temporal(column.type):
            return [_scalar_or_text(value) for value in column]
    # DuckDB stores ±infinity as the extreme integer of the physical type
    wide = column.type.bit_width == 64
    storage = column.cast(pa.int64() if wide else pa.int32())
    high = 2**63 - 1 if wide else 2**31 - 1
    out: list[object] = []
    for raw, value in zip(storage.to_pylist(), column, strict=True):
        if raw is None:
            out.append(None)
        elif raw == high:
            out.append("infinity")
        elif raw == -high:
            out.append("-infinity")
        else:
            out.append(_scalar_or_text(value))
    return out


def _scalar_or_text(value: pa.Scalar) -> object:
    """A value as Python, or as text when Python cannot hold it (a nested date past 9999)."""
    try:
        return value.as_py()
    except (OverflowError, ValueError):
        try:
            return str(pc.cast(value, pa.string()))
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
            return f"<{value.type} value out of Python's range>"


def _plain(value: object) -> object:
    if isinstance(value, pa.MonthDayNano):
        return f"P{value.months}M{value.days}DT{value.nanoseconds / 1e9:g}S"
    return value


def _json_fallback(value: object) -> object:
    """Values msgspec cannot encode by itself become their text."""
    return str(value)


_json_encoder = msgspec.json.Encoder(enc_hook=_json_fallback, decimal_format="number")


def _render_json(result: ResultSet) -> bytes:
    return _json_encoder.encode(
        {
            "columns": list(result.columns),
            "types": list(result.types),
            "rows": rows_of(result),
            "row_count": result.row_count,
            "truncated": result.truncated,
        }
    )


def _csv_value(value: object) -> object:
    """CSV cells: empty for NULL, ISO-8601 times, ``true``/``false``, base64 blobs (as in
    JSON), JSON for lists and structs."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, list | dict):
        return _json_encoder.encode(value).decode("utf-8")
    if isinstance(value, float | timedelta | Decimal):
        return str(value)
    return value


def _render_csv(result: ResultSet) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(result.columns)
    for row in rows_of(result):
        writer.writerow([_csv_value(v) for v in row])
    return out.getvalue().encode("utf-8")


def _render_arrow(result: ResultSet) -> bytes:
    table = result.table.replace_schema_metadata(
        {"kvscope.truncated": "true" if result.truncated else "false"}
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue())
