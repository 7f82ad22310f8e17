"""Admission of a user's SQL text to the sandbox of :mod:`agent.sql`: exactly one read
(SELECT) statement, calling no function that writes or runs SQL given as a string.

The text is split and typed by DuckDB's own parser (``duckdb.extract_statements``); the functions
it calls come from DuckDB's own parse tree (``json_serialize_sql`` on a throwaway in-memory
database), walked with an explicit stack. A statement nested so deep that its parse tree cannot
even be read back (Python's JSON decoder recurses, about 450 nested calls) is refused with a
400 that says so, as DuckDB itself refuses one past ``max_expression_depth`` (1,000).
"""

from __future__ import annotations

import json

import duckdb


class SqlError(Exception):
    """A query a user sent that cannot be answered; ``status`` is the HTTP status to return."""

    status = 400

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SqlForbidden(SqlError):
    """Not exactly one read (SELECT) statement."""

    status = 403


def check_read_only(sql: str) -> str:
    """Return the single statement of ``sql`` if it is a read (SELECT) statement.

    Raises:
        SqlError: the text does not parse (DuckDB's message), holds no statement, or nests too
            deep to check (see :func:`_function_names`).
        SqlForbidden: more than one statement, or a statement that is not a SELECT.
    """
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise SqlError(str(exc)) from None
    if not statements:
        raise SqlError("no SQL statement given")
    if len(statements) > 1:
        raise SqlForbidden(
            f"exactly one statement is allowed, got {len(statements)}; send them one at a time"
        )
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise SqlForbidden(
            f"only read statements (SELECT, WITH, FROM, VALUES, DESCRIBE, SHOW) are allowed, "
            f"not {kind.name}"
        )
    called = _function_names(sql) & FORBIDDEN_FUNCTIONS
    if called:
        raise SqlForbidden(f"function {sorted(called)[0]}() is not allowed here (it can write or run other SQL)")
    return sql


FORBIDDEN_FUNCTIONS = frozenset({"checkpoint", "force_checkpoint", "query", "query_table"})
"""Functions a SELECT may call that write (``checkpoint`` folds the WAL into the file) or that
run SQL given as a string (which this check could not see)."""


def _function_names(sql: str) -> set[str]:
    """Names of every function the statement calls, from DuckDB's own parse tree
    (``json_serialize_sql``, on a throwaway in-memory database).

    Raises:
        SqlForbidden: DuckDB cannot serialise the statement, so it cannot be checked.
        SqlError: the statement nests too deep for its parse tree to be read back.
    """
    con = duckdb.connect(":memory:")
    try:
        (text,) = con.execute("SELECT json_serialize_sql($1)", [sql]).fetchall()[0]
    finally:
        con.close()
    try:
        tree = json.loads(text)
    except RecursionError:
        raise SqlError(
            "this statement is nested too deep to check (its expressions nest past what the "
            "sandbox can read back, a few hundred levels); write it with fewer nested calls"
        ) from None
    if tree.get("error"):
        raise SqlForbidden(
            f"this statement cannot be checked ({tree.get('error_message', 'not serialisable')}); "
            "write it as a plain SELECT"
        )
    names: set[str] = set()
    stack: list[object] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            name = node.get("function_name")
            if isinstance(name, str):
                names.add(name.lower())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return names
