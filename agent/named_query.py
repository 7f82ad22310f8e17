"""The named-query machinery: :class:`NamedQuery`, :class:`QueryParam`, the user errors they
raise, and the parameters and SQL fragments the query definitions share.

A :class:`NamedQuery` is fixed SQL with DuckDB ``$name`` prepared parameters — user input is
bound, never formatted into the text — and declares its parameters with a type, a default and a
range. :meth:`NamedQuery.bind` turns query-string values into typed parameters and raises
:class:`BadParam` naming the parameter. ``now`` (a naive UTC timestamp) is supplied by the
caller, never the user: "since" windows are ``[now - since_seconds, ...)``.

The shared fragments below are constant SQL text (no user input): :data:`FILTER_SQL` and
:data:`BUCKET_EXPR` take ``t``, a table prefix such as ``"r."`` or ``""``, via ``str.format``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import duckdb

MAX_NAME_CHARS = 256
"""The longest ``str`` parameter value accepted, in characters."""


class QueryError(Exception):
    """A user error in a named-query call; ``status`` is the HTTP status."""

    status = 400

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnknownQuery(QueryError):
    status = 404

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown query {name!r}; known queries: {', '.join(known)}")
        self.known = known


class BadParam(QueryError):
    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"parameter {param!r}: {reason}")
        self.param = param


@dataclass(frozen=True, slots=True, kw_only=True)
class QueryParam:
    """One parameter: ``kind`` is ``int``, ``float`` or ``str``; ``default`` ``None`` makes it
    optional (bound as NULL, meaning "no filter"); numbers are checked against [minimum, maximum]."""

    name: str
    kind: type[int] | type[float] | type[str]
    default: int | float | str | None = None
    minimum: float | None = None
    maximum: float | None = None
    description: str = ""

    def parse(self, raw: str) -> int | float | str:
        """The typed value of a query-string value. Raises :class:`BadParam`."""
        if self.kind is str:
            if not 0 < len(raw) <= MAX_NAME_CHARS:
                raise BadParam(self.name, f"must be 1..{MAX_NAME_CHARS} characters")
            return raw
        try:
            value: int | float = int(raw) if self.kind is int else float(raw)
        except ValueError:
            raise BadParam(self.name, f"must be {self.kind.__name__}, got {raw!r}") from None
        if self.kind is float and value != value:  # NaN
            raise BadParam(self.name, "must be a number, got NaN")
        if self.minimum is not None and value < self.minimum:
            raise BadParam(self.name, f"must be >= {self.minimum:g}, got {raw}")
        if self.maximum is not None and value > self.maximum:
            raise BadParam(self.name, f"must be <= {self.maximum:g}, got {raw}")
        return value


@dataclass(frozen=True, slots=True, kw_only=True)
class NamedQuery:
    """A named query: ``sql`` uses exactly the declared parameters, plus ``$now`` optionally.
    ``columns`` documents the result columns."""

    name: str
    description: str
    sql: str
    params: tuple[QueryParam, ...] = ()
    columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        (statement,) = duckdb.extract_statements(self.sql)
        if statement.type != duckdb.StatementType.SELECT:
            raise ValueError(f"query {self.name}: only SELECT statements may be named queries")
        declared = {p.name for p in self.params}
        used = set(statement.named_parameters)
        if "now" in declared or used - {"now"} != declared:
            raise ValueError(
                f"query {self.name}: declared parameters {sorted(declared)} do not match the "
                f"SQL's {sorted(used - {'now'})} (now is implicit)"
            )

    @property
    def uses_now(self) -> bool:
        return "$now" in self.sql

    def bind(self, raw: Mapping[str, str], *, now: datetime) -> dict[str, object]:
        """Typed parameters for the SQL from query-string values; missing ones take defaults.

        Raises:
            BadParam: an unknown parameter, or a value of the wrong type or out of range.
        """
        known = {p.name: p for p in self.params}
        for key in raw:
            if key not in known:
                names = ", ".join(known) or "none"
                raise BadParam(key, f"unknown parameter of query {self.name}; known: {names}")
        bound: dict[str, object] = {
            p.name: p.parse(raw[p.name]) if p.name in raw else p.default for p in self.params
        }
        if self.uses_now:
            bound["now"] = now
        return bound


def engine_param(description: str = "only this engine") -> QueryParam:
    """The optional ``engine_id`` filter parameter (``str``; absent: every engine)."""
    return QueryParam(name="engine_id", kind=str, description=description)


MODEL_PARAM = QueryParam(name="model", kind=str, description="only this model")
RUN_PARAM = QueryParam(name="run_id", kind=str, description="only this run (process start) of the engine: its batches' run_id")
RUN_SQL = "($run_id::VARCHAR IS NULL OR {t}run_id = $run_id)"
"""The optional ``run_id`` filter (NULL: every run; rows stored without a run id match only then)."""
SINCE_PARAM = QueryParam(
    name="since_seconds",
    kind=int,
    default=3600,
    minimum=1,
    maximum=366 * 86400,
    description="window start, seconds before now",
)
BUCKET_PARAM = QueryParam(
    name="bucket_seconds",
    kind=int,
    default=60,
    minimum=1,
    maximum=86400,
    description="bucket width",
)
LIMIT_PARAM = QueryParam(name="limit", kind=int, default=100, minimum=1, maximum=10_000)
FILTER_SQL = """
    ($engine_id::VARCHAR IS NULL OR {t}engine_id = $engine_id)
    AND ($model::VARCHAR IS NULL OR {t}model = $model)
"""
"""The optional ``engine_id`` and ``model`` filters (NULL: no filter); ``{t}``: table prefix."""
BUCKET_EXPR = "time_bucket(to_seconds($bucket_seconds::BIGINT), {t}ts, TIMESTAMP '1970-01-01')"
"""The start of ``{t}ts``'s ``bucket_seconds``-wide bucket, aligned to the unix epoch."""
