"""``kvscope sql``: ad-hoc read-only SQL through a running agent or on a DuckDB file.

On a file, the same rules as the agent's sandbox hold: the database is opened read-only with
external access disabled, the session time zone set to UTC (as in the agent, so ``now()`` and
timestamp arithmetic do not follow the host's time zone) and the configuration locked, and only
one SELECT statement (as typed by DuckDB's own parser) is admitted.
"""

from __future__ import annotations

import io
from pathlib import Path

import duckdb
from rich.console import Console
from rich.table import Table

from agent.client import AgentClient
from agent.duckdb_settings import use_utc
from agent.sql import ResultSet, SqlError, check_read_only, render, rows_of, run_on_connection
from agent.store import lock_holder

MAX_ROWS = 10_000
TIMEOUT_SECONDS = 600.0


def run_sql(query: str, *, db: Path | None, agent: str | None, fmt: str) -> str:
    """The query's result rendered as ``table``, ``csv`` or ``json`` (the agent's JSON shape).

    Raises:
        ValueError: bad SQL, a statement that is not a read, a missing or locked database file
            (the message says what to do).
        agent.client.AgentError: the agent is unreachable or refused the query.
    """
    if db is not None:
        result = _query_file(db, query)
        if fmt == "json":
            return render(result, "json").decode() + "\n"
        if fmt == "csv":
            return render(result, "csv").decode()
        return _table(list(result.columns), rows_of(result), result.truncated)
    assert agent is not None
    client = AgentClient(base_url=agent, timeout_seconds=60)
    if fmt in ("json", "csv"):
        return client.sql(query, fmt).text + ("\n" if fmt == "json" else "")
    body = client.sql(query, "json").json()
    return _table(list(body["columns"]), body["rows"], bool(body.get("truncated")))


def _query_file(db: Path, query: str) -> ResultSet:
    try:
        check_read_only(query)
    except SqlError as exc:
        raise ValueError(exc.reason) from None
    if not db.exists():
        raise ValueError(f"{db}: no such DuckDB file")
    try:
        con = duckdb.connect(str(db), read_only=True, config={"enable_external_access": False})
    except duckdb.IOException as exc:
        holder = lock_holder(exc)
        if holder is not None:
            raise ValueError(
                f"{db} is open in a running agent ({holder}; DuckDB allows one writer process); "
                "query it through the agent with --agent URL instead"
            ) from None
        raise ValueError(f"{db}: {exc}") from None
    try:
        use_utc(con)
        con.execute("SET lock_configuration = true")
        return run_on_connection(con, query, row_limit=MAX_ROWS, timeout_seconds=TIMEOUT_SECONDS)
    except SqlError as exc:
        raise ValueError(exc.reason) from None
    finally:
        con.close()


def _table(columns: list[str], rows: list[list[object]], truncated: bool) -> str:
    table = Table()
    for c in columns:
        table.add_column(c)
    for row in rows:
        table.add_row(*("NULL" if v is None else str(v) for v in row))
    buf = io.StringIO()
    console = Console(file=buf, width=200)
    console.print(table)
    if truncated:
        console.print(f"(first {len(rows)} rows shown)")
    return buf.getvalue()
