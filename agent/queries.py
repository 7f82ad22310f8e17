"""Named, parameterised queries (``GET /v1/query/{name}``), used by the dashboard and alerts.

Each :class:`NamedQuery` is fixed SQL with DuckDB ``$name`` prepared parameters — user input is
bound, never formatted into the text — and declares its parameters with a type, a default and a
range. :meth:`NamedQuery.bind` turns query-string values into typed parameters and raises
:class:`BadParam` naming the parameter; :func:`get_query` raises :class:`UnknownQuery` listing
the known names. ``now`` (a naive UTC timestamp) is supplied by the caller, never the user:
"since" windows are ``[now - since_seconds, ...)``.

Ratios are ratios of token **sums** (DESIGN.md §3) and NULL when the denominator is 0. Token sums
are ``BIGINT`` and 0, not NULL, when nothing matched. Time buckets are aligned to multiples of
``bucket_seconds`` since the unix epoch and labelled by their start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType

import duckdb

from agent.migrations import RECOVERY_BUCKETS_V3, bucket_column
from agent.rollups import LOOKUP_SLACK

MAX_NAME_CHARS = 256


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


def _engine(description: str = "only this engine") -> QueryParam:
    return QueryParam(name="engine_id", kind=str, description=description)


_MODEL = QueryParam(name="model", kind=str, description="only this model")
_SINCE = QueryParam(
    name="since_seconds",
    kind=int,
    default=3600,
    minimum=1,
    maximum=366 * 86400,
    description="window start, seconds before now",
)
_BUCKET = QueryParam(
    name="bucket_seconds",
    kind=int,
    default=60,
    minimum=1,
    maximum=86400,
    description="bucket width",
)
_LIMIT = QueryParam(name="limit", kind=int, default=100, minimum=1, maximum=10_000)
_FILTER = """
    ($engine_id::VARCHAR IS NULL OR {t}engine_id = $engine_id)
    AND ($model::VARCHAR IS NULL OR {t}model = $model)
"""
_BUCKET_EXPR = "time_bucket(to_seconds($bucket_seconds::BIGINT), {t}ts, TIMESTAMP '1970-01-01')"

TOTALS = NamedQuery(
    name="totals",
    description="Lifetime request and token totals.",
    sql="""
    SELECT
        count(*) AS requests,
        coalesce(sum(prompt_tokens), 0)::BIGINT AS prompt_tokens,
        coalesce(sum(hash_hit_tokens), 0)::BIGINT AS hash_hit_tokens,
        coalesce(sum(recoverable_tokens), 0)::BIGINT AS recoverable_tokens,
        coalesce(sum(replayed_tokens), 0)::BIGINT AS replayed_tokens,
        coalesce(sum(recomputed_tokens), 0)::BIGINT AS recomputed_tokens
    FROM requests
    WHERE $engine_id::VARCHAR IS NULL OR engine_id = $engine_id
    """,
    params=(_engine(),),
    columns=(
        "requests",
        "prompt_tokens",
        "hash_hit_tokens",
        "recoverable_tokens",
        "replayed_tokens",
        "recomputed_tokens",
    ),
)

FORM_OUTCOMES = NamedQuery(
    name="form_outcomes",
    description="Lookups per form, outcome and reason, with their usable and recoverable tokens.",
    sql="""
    SELECT
        form,
        outcome,
        reason,
        count(*) AS lookups,
        sum(usable_tokens)::BIGINT AS usable_tokens,
        sum(recoverable_tokens)::BIGINT AS recoverable_tokens
    FROM cache_lookups
    WHERE $engine_id::VARCHAR IS NULL OR engine_id = $engine_id
    GROUP BY form, outcome, reason
    ORDER BY form, outcome, reason
    """,
    params=(_engine(),),
    columns=("form", "outcome", "reason", "lookups", "usable_tokens", "recoverable_tokens"),
)

HIT_RATE_TIMESERIES = NamedQuery(
    name="hit_rate_timeseries",
    description="Per time bucket: request token sums and the raw and recoverable hit rates.",
    sql=f"""
    SELECT
        {_BUCKET_EXPR.format(t="")} AS bucket,
        count(*) AS requests,
        sum(prompt_tokens)::BIGINT AS prompt_tokens,
        sum(hash_hit_tokens)::BIGINT AS hash_hit_tokens,
        sum(recoverable_tokens)::BIGINT AS recoverable_tokens,
        sum(replayed_tokens)::BIGINT AS replayed_tokens,
        sum(recomputed_tokens)::BIGINT AS recomputed_tokens,
        sum(hash_hit_tokens)::DOUBLE / nullif(sum(prompt_tokens), 0) AS raw_hit_rate,
        sum(recoverable_tokens)::DOUBLE / nullif(sum(prompt_tokens), 0) AS recoverable_hit_rate
    FROM requests
    WHERE ts >= $now - to_seconds($since_seconds::BIGINT) AND {_FILTER.format(t="")}
    GROUP BY bucket
    ORDER BY bucket
    """,
    params=(_SINCE, _BUCKET, _engine(), _MODEL),
    columns=(
        "bucket",
        "requests",
        "prompt_tokens",
        "hash_hit_tokens",
        "recoverable_tokens",
        "replayed_tokens",
        "recomputed_tokens",
        "raw_hit_rate",
        "recoverable_hit_rate",
    ),
)

FORM_USABLE_TIMESERIES = NamedQuery(
    name="form_usable_timeseries",
    description=(
        "Per time bucket and form: the form's usable tokens over the prompt tokens of the "
        "requests that looked it up. A form's usable tokens per request are the minimum over "
        "its lookups (layer groups, tensor-parallel ranks) with ts within an hour of the "
        "request's; requests are bucketed by their ts. Buckets of whole minutes read the "
        "form_usable_minute rollup (folded every rollup interval, like cache_minute), others the "
        "raw tables; a request whose request event is not stored yet is left out."
    ),
    sql=f"""
    WITH rolled AS (
        SELECT time_bucket(to_seconds($bucket_seconds::BIGINT), minute, TIMESTAMP '1970-01-01') AS bucket,
               form, sum(usable_tokens) AS usable_tokens, sum(prompt_tokens) AS prompt_tokens
        FROM form_usable_minute
        WHERE $bucket_seconds::BIGINT % 60 = 0
          -- the window's first minute whole (a minute cannot be split): like a raw first bucket
          AND minute >= date_trunc('minute', $now - to_seconds($since_seconds::BIGINT)) AND {_FILTER.format(t="")}
        GROUP BY ALL
    ), per_request AS (
        SELECT r.ts, r.prompt_tokens, l.form, min(l.usable_tokens) AS usable_tokens
        FROM requests AS r
        JOIN cache_lookups AS l USING (engine_id, request_id)
        WHERE $bucket_seconds::BIGINT % 60 <> 0
          AND r.ts >= $now - to_seconds($since_seconds::BIGINT) AND {_FILTER.format(t="r.")}
          -- a request's lookups: within an hour of its ts (agent.rollups.LOOKUP_SLACK)
          AND l.ts >= $now - to_seconds($since_seconds::BIGINT) - {LOOKUP_SLACK}
          AND l.ts BETWEEN r.ts - {LOOKUP_SLACK} AND r.ts + {LOOKUP_SLACK}
        GROUP BY r.engine_id, r.request_id, r.ts, r.prompt_tokens, l.form
    ), raw AS (
        SELECT {_BUCKET_EXPR.format(t="")} AS bucket, form,
               sum(usable_tokens) AS usable_tokens, sum(prompt_tokens) AS prompt_tokens
        FROM per_request
        GROUP BY ALL
    )
    SELECT bucket, form, usable_tokens::BIGINT AS usable_tokens, prompt_tokens::BIGINT AS prompt_tokens,
           usable_tokens::DOUBLE / nullif(prompt_tokens, 0) AS usable_rate
    FROM (SELECT * FROM rolled UNION ALL SELECT * FROM raw)
    ORDER BY bucket, form
    """,
    params=(_SINCE, _BUCKET, _engine(), _MODEL),
    columns=("bucket", "form", "usable_tokens", "prompt_tokens", "usable_rate"),
)

RECENT_REQUESTS = NamedQuery(
    name="recent_requests",
    description=(
        "The latest requests, newest first; optionally only those in the last since_seconds, "
        "with ts in [start_ts, end_ts) (unix seconds: one chart bucket), limited by one form "
        "(the named limiting_form, not any form of a tie), or whose request id contains search "
        "(case-insensitive). limiting_forms lists every form tied as limiting ([] when none, or "
        "for rows stored before schema 9)."
    ),
    sql=f"""
    SELECT * EXCLUDE (ingested_at)
    FROM requests
    WHERE {_FILTER.format(t="")}
      AND ($since_seconds::BIGINT IS NULL OR ts >= $now - to_seconds($since_seconds::BIGINT))
      AND ($start_ts::DOUBLE IS NULL OR ts >= make_timestamp(($start_ts::DOUBLE * 1e6)::BIGINT))
      AND ($end_ts::DOUBLE IS NULL OR ts < make_timestamp(($end_ts::DOUBLE * 1e6)::BIGINT))
      AND ($limiting_form::VARCHAR IS NULL OR limiting_form = $limiting_form)
      AND ($search::VARCHAR IS NULL OR contains(lower(request_id), lower($search)))
    ORDER BY ts DESC, request_id
    LIMIT $limit
    """,
    params=(
        _LIMIT,
        _engine(),
        _MODEL,
        QueryParam(name="since_seconds", kind=int, minimum=1, maximum=366 * 86400, description="only requests this recent"),
        QueryParam(name="start_ts", kind=float, minimum=0, maximum=2**33, description="only requests at or after (unix seconds)"),
        QueryParam(name="end_ts", kind=float, minimum=0, maximum=2**33, description="only requests before (unix seconds)"),
        QueryParam(name="limiting_form", kind=str, description="only requests this form limited"),
        QueryParam(name="search", kind=str, description="part of the request id (case-insensitive)"),
    ),
    columns=(
        "ts",
        "engine_id",
        "request_id",
        "model",
        "prompt_tokens",
        "output_tokens",
        "hash_hit_tokens",
        "resume_tokens",
        "recoverable_tokens",
        "replayed_tokens",
        "recomputed_tokens",
        "approximate",
        "limiting_form",
        "limiting_reason",
        "admission",
        "ttft_seconds",
        "e2e_seconds",
        "predicted_seconds",
        "actual_seconds",
        "limiting_forms",
    ),
)

REQUEST_LOOKUPS = NamedQuery(
    name="request_lookups",
    description=(
        "One request's lookups per form (the minimum over its layer groups and tensor-parallel "
        "ranks, as the resume point sees them): outcome, reason, tier, hash-hit, usable and "
        "recoverable tokens, replayed tokens, recovery seconds."
    ),
    sql="""
    SELECT form,
           arg_min(outcome, usable_tokens) AS outcome,
           arg_min(reason, usable_tokens) AS reason,
           arg_min(tier, usable_tokens) AS tier,
           min(hash_hit_tokens)::BIGINT AS hash_hit_tokens,
           min(usable_tokens)::BIGINT AS usable_tokens,
           min(recoverable_tokens)::BIGINT AS recoverable_tokens,
           max(replayed_tokens)::BIGINT AS replayed_tokens,
           bool_or(approximate) AS approximate,
           max(recovery_seconds) AS recovery_seconds
    FROM cache_lookups
    WHERE request_id = $request_id AND ($engine_id::VARCHAR IS NULL OR engine_id = $engine_id)
    GROUP BY form
    ORDER BY usable_tokens, form
    """,
    params=(QueryParam(name="request_id", kind=str, description="the request"), _engine()),
    columns=(
        "form",
        "outcome",
        "reason",
        "tier",
        "hash_hit_tokens",
        "usable_tokens",
        "recoverable_tokens",
        "replayed_tokens",
        "approximate",
        "recovery_seconds",
    ),
)

SCHEMA = NamedQuery(
    name="schema",
    description="The tables and columns SQL can read (the dashboard's SQL page shows them).",
    sql="""
    SELECT table_name, column_name, data_type
    FROM information_schema.columns
    WHERE table_schema = 'main'
    ORDER BY table_name, ordinal_position
    """,
    columns=("table_name", "column_name", "data_type"),
)

ENGINES = NamedQuery(
    name="engines",
    description="The engines and models that finished requests in the window, busiest first.",
    sql="""
    SELECT engine_id, model, count(*) AS requests, max(ts) AS last_seen
    FROM requests
    WHERE ts >= $now - to_seconds($since_seconds::BIGINT)
    GROUP BY engine_id, model
    ORDER BY requests DESC, engine_id, model
    LIMIT 1000
    """,
    params=(_SINCE,),
    columns=("engine_id", "model", "requests", "last_seen"),
)

ALERTS_RECENT = NamedQuery(
    name="alerts_recent",
    description=(
        "The latest alert rows, newest first: transitions (firing, resolved), delivered notifications "
        "and failed deliveries (event, receiver, error)."
    ),
    sql="""
    SELECT ts, alert, fingerprint, state, value, labels, summary, description, event, receiver, error
    FROM alerts
    ORDER BY ts DESC, fingerprint
    LIMIT $limit
    """,
    params=(_LIMIT,),
    columns=(
        "ts", "alert", "fingerprint", "state", "value", "labels", "summary", "description", "event", "receiver", "error",
    ),
)

INGEST_SEQ_GAPS = NamedQuery(
    name="ingest_seq_gaps",
    description=(
        "Per engine: the highest batch seq received, how many seqs were received (stored or "
        "rejected) and how many below the highest never arrived (seqs start at 0; seqs from 2^40 "
        "up come from older clients' wall-clock numbering and are counted from their first)."
    ),
    sql="""
    SELECT engine_id,
           max(seq) AS max_seq,
           count(DISTINCT seq) AS received,
           (coalesce(max(seq) FILTER (WHERE seq < 1099511627776) + 1
                     - count(DISTINCT seq) FILTER (WHERE seq < 1099511627776), 0)
            + coalesce(max(seq) FILTER (WHERE seq >= 1099511627776)::HUGEINT
                       - min(seq) FILTER (WHERE seq >= 1099511627776) + 1
                       - count(DISTINCT seq) FILTER (WHERE seq >= 1099511627776), 0))::BIGINT
           AS missing
    FROM ingest_batches
    WHERE status IN ('stored', 'rejected')
      AND ($engine_id::VARCHAR IS NULL OR engine_id = $engine_id)
    GROUP BY engine_id
    ORDER BY missing DESC, engine_id
    """,
    params=(_engine(),),
    columns=("engine_id", "max_seq", "received", "missing"),
)

FORM_WINDOW = NamedQuery(
    name="form_window",
    description=(
        "Per form and tier over the window, from the cache_minute rollup (minutes merge "
        "exactly): lookups, hash-hit and recoverable tokens, their ratio, lookups that recovered "
        "or replayed state within 100 ms."
    ),
    sql="""
    SELECT form, tier,
           sum(lookups)::BIGINT AS lookups,
           sum(hash_hit_tokens)::BIGINT AS hash_hit_tokens,
           sum(recoverable_tokens)::BIGINT AS recoverable_tokens,
           sum(recoverable_tokens) / nullif(sum(hash_hit_tokens), 0) AS recoverable_ratio,
           sum(recovery_le_0_1)::BIGINT AS recovered_within_100ms
    FROM cache_minute
    WHERE minute >= $now - to_seconds($since_seconds::BIGINT)
      AND ($engine_id::VARCHAR IS NULL OR engine_id = $engine_id)
      AND ($model::VARCHAR IS NULL OR model = $model)
    GROUP BY form, tier
    ORDER BY form, tier
    """,
    params=(_engine(), _MODEL, _SINCE),
    columns=(
        "form",
        "tier",
        "lookups",
        "hash_hit_tokens",
        "recoverable_tokens",
        "recoverable_ratio",
        "recovered_within_100ms",
    ),
)

_LE_COLUMNS = [bucket_column(b) for b in RECOVERY_BUCKETS_V3]

FORM_TIMESERIES = NamedQuery(
    name="form_timeseries",
    description=(
        "Per time bucket (whole minutes, from the cache_minute rollup), form, tier, outcome and "
        "reason: lookups, hash-hit and recoverable tokens, and the cumulative recovery-latency "
        "bucket counts (recovery_le_*: lookups that recovered or replayed state within that many "
        "seconds). The Forms page's outcomes, reasons, latency quantiles, heatmap and tier split."
    ),
    sql=f"""
    SELECT time_bucket(to_seconds(greatest($bucket_seconds::BIGINT, 60)), minute, TIMESTAMP '1970-01-01') AS bucket,
           form, tier, outcome, reason,
           sum(lookups)::BIGINT AS lookups,
           sum(hash_hit_tokens)::BIGINT AS hash_hit_tokens,
           sum(recoverable_tokens)::BIGINT AS recoverable_tokens,
           {", ".join(f"sum({c})::BIGINT AS {c}" for c in _LE_COLUMNS)}
    FROM cache_minute
    WHERE minute >= $now - to_seconds($since_seconds::BIGINT)
      AND ($form::VARCHAR IS NULL OR form = $form)
      AND {_FILTER.format(t="")}
    GROUP BY ALL
    ORDER BY bucket, form, tier, outcome, reason
    """,
    params=(_SINCE, _BUCKET, _engine(), _MODEL, QueryParam(name="form", kind=str, description="only this form")),
    columns=("bucket", "form", "tier", "outcome", "reason", "lookups", "hash_hit_tokens", "recoverable_tokens", *_LE_COLUMNS),
)

LIMITING_FORMS = NamedQuery(
    name="limiting_forms",
    description=(
        "Per time bucket: requests by the form named as setting their resume point (NULL: none "
        "limited it). A request whose limit was a tie counts once, under its limiting_form; the "
        "tied forms are recent_requests' limiting_forms."
    ),
    sql=f"""
    SELECT {_BUCKET_EXPR.format(t="")} AS bucket, limiting_form, count(*) AS requests
    FROM requests
    WHERE ts >= $now - to_seconds($since_seconds::BIGINT) AND {_FILTER.format(t="")}
    GROUP BY ALL
    ORDER BY bucket, limiting_form NULLS FIRST
    """,
    params=(_SINCE, _BUCKET, _engine(), _MODEL),
    columns=("bucket", "limiting_form", "requests"),
)

_SNAPSHOTS = f"""snapshots AS (  -- one row per engine, form, tier and snapshot: a form's pools summed
        SELECT engine_id, form, tier, ts, sum(used_bytes) AS used_bytes, sum(used_blocks) AS used_blocks,
               sum(cached_blocks) AS cached_blocks, sum(free_blocks) AS free_blocks, sum(total_blocks) AS total_blocks
        FROM engine_stats
        WHERE ts >= $now - to_seconds($since_seconds::BIGINT) AND {_FILTER.format(t="")}
        GROUP BY ALL
    )"""
"""The engines' stats snapshots in the window, shared by the capacity queries."""

CAPACITY_TIMESERIES = NamedQuery(
    name="capacity_timeseries",
    description=(
        "Per time bucket, form and tier, from the engines' stats snapshots (a form's pools summed "
        "per snapshot): each engine's mean over the bucket, summed over engines — bytes and "
        "blocks used, blocks cached (reusable), free and total."
    ),
    sql=f"""
    WITH {_SNAPSHOTS},
    per_engine AS (
        SELECT {_BUCKET_EXPR.format(t="")} AS bucket, engine_id, form, tier,
               avg(used_bytes) AS used_bytes, avg(used_blocks) AS used_blocks, avg(cached_blocks) AS cached_blocks,
               avg(free_blocks) AS free_blocks, max(total_blocks) AS total_blocks
        FROM snapshots
        GROUP BY ALL
    )
    SELECT bucket, form, tier,
           sum(used_bytes)::BIGINT AS used_bytes, sum(used_blocks)::BIGINT AS used_blocks,
           sum(cached_blocks)::BIGINT AS cached_blocks, sum(free_blocks)::BIGINT AS free_blocks,
           sum(total_blocks)::BIGINT AS total_blocks
    FROM per_engine
    GROUP BY ALL
    ORDER BY bucket, form, tier
    """,
    params=(_SINCE, _BUCKET, _engine(), _MODEL),
    columns=("bucket", "form", "tier", "used_bytes", "used_blocks", "cached_blocks", "free_blocks", "total_blocks"),
)

CAPACITY_LATEST = NamedQuery(
    name="capacity_latest",
    description=(
        "Per form and tier: each engine's latest stats snapshot in the window, summed over engines "
        "(bytes and blocks used, cached, free, total)."
    ),
    sql=f"""
    WITH {_SNAPSHOTS},
    latest AS (
        SELECT engine_id, form, tier,
               arg_max(used_bytes, ts) AS used_bytes, arg_max(used_blocks, ts) AS used_blocks,
               arg_max(cached_blocks, ts) AS cached_blocks, arg_max(free_blocks, ts) AS free_blocks,
               arg_max(total_blocks, ts) AS total_blocks
        FROM snapshots
        GROUP BY ALL
    )
    SELECT form, tier, sum(used_bytes)::BIGINT AS used_bytes, sum(used_blocks)::BIGINT AS used_blocks,
           sum(cached_blocks)::BIGINT AS cached_blocks, sum(free_blocks)::BIGINT AS free_blocks,
           sum(total_blocks)::BIGINT AS total_blocks, count(*) AS engines
    FROM latest
    GROUP BY ALL
    ORDER BY form, tier
    """,
    params=(_SINCE, _engine(), _MODEL),
    columns=("form", "tier", "used_bytes", "used_blocks", "cached_blocks", "free_blocks", "total_blocks", "engines"),
)

_WHATIF_FORMS = ("full_kv", "swa_window", "compressed_kv", "uncompressed_tail", "indexer_state", "linear_state")
_EXTRA = tuple(
    QueryParam(
        name=f"extra_mib_{f}", kind=float, default=0.0, minimum=-1e9, maximum=1e9,
        description=f"more device memory for {f}, MiB (negative: less)",
    )
    for f in _WHATIF_FORMS
)  # fmt: skip
_EXTRA_BYTES = "1048576 * CASE l.form " + " ".join(f"WHEN '{f}' THEN $extra_mib_{f}::DOUBLE" for f in _WHATIF_FORMS) + " ELSE 0 END"

CAPACITY_WHATIF = NamedQuery(
    name="capacity_whatif",
    description=(
        "The recorded requests of the window replayed against more or less device memory per "
        "form: with more, each lookup that lost tokens to evictions resumes at its ghost point "
        "when its ghost memory fits the form's extra MiB; with less, each lookup whose spare "
        "memory the cut exceeds resumes nowhere (it may have had a lower point). Both are estimates. A "
        "request's resume point is the minimum over its forms, and the rates are Σ resume tokens "
        "/ Σ prompt tokens. replay_rate is the same with no change (how close the model comes to "
        "recorded_rate, what the engine did)."
    ),
    sql=f"""
    WITH per_form AS (
        SELECT r.engine_id, r.request_id, r.prompt_tokens, r.recoverable_tokens AS recorded, l.form,
               min(l.usable_tokens) AS usable,
               min(CASE
                       -- more memory: a lookup that lost tokens resumes at its ghost point if that fits
                       WHEN {_EXTRA_BYTES} >= 0 THEN
                           CASE WHEN l.ghost_bytes <= {_EXTRA_BYTES} THEN l.ghost_tokens ELSE l.usable_tokens END
                       -- less: a lookup whose spare memory the cut exceeds (or is unknown) resumes nowhere
                       WHEN l.usable_tokens > 0 AND coalesce(l.spare_bytes < -({_EXTRA_BYTES}), true) THEN 0
                       ELSE l.usable_tokens
                   END) AS usable_if
        FROM requests AS r
        JOIN cache_lookups AS l USING (engine_id, request_id)
        WHERE r.ts >= $now - to_seconds($since_seconds::BIGINT) AND {_FILTER.format(t="r.")}
          AND l.ts >= $now - to_seconds($since_seconds::BIGINT) - {LOOKUP_SLACK}
          AND l.ts BETWEEN r.ts - {LOOKUP_SLACK} AND r.ts + {LOOKUP_SLACK}
        GROUP BY ALL
    ), per_request AS (
        SELECT prompt_tokens, recorded, min(usable) AS replay, min(usable_if) AS what_if
        FROM per_form
        GROUP BY engine_id, request_id, prompt_tokens, recorded
    )
    SELECT count(*) AS requests, coalesce(sum(prompt_tokens), 0)::BIGINT AS prompt_tokens,
           coalesce(sum(recorded), 0)::BIGINT AS recorded_tokens, coalesce(sum(replay), 0)::BIGINT AS replay_tokens,
           coalesce(sum(what_if), 0)::BIGINT AS what_if_tokens,
           sum(recorded)::DOUBLE / nullif(sum(prompt_tokens), 0) AS recorded_rate,
           sum(replay)::DOUBLE / nullif(sum(prompt_tokens), 0) AS replay_rate,
           sum(what_if)::DOUBLE / nullif(sum(prompt_tokens), 0) AS what_if_rate
    FROM per_request
    """,
    params=(_SINCE, _engine(), _MODEL, *_EXTRA),
    columns=(
        "requests", "prompt_tokens", "recorded_tokens", "replay_tokens", "what_if_tokens",
        "recorded_rate", "replay_rate", "what_if_rate",
    ),
)  # fmt: skip

FORM_GHOSTS = NamedQuery(
    name="form_ghosts",
    description=(
        "Per form over the window: lookups that lost tokens (invalidated), how many of those more "
        "device memory would have saved (a ghost point), and, over every lookup with a ghost point "
        "(Tail-Replay's replayed ones too: more memory would have made them exact), the memory "
        "that took (MiB: median, 90th percentile, largest) and the tokens it would have added."
    ),
    sql=f"""
    SELECT form,
           count(*) FILTER (WHERE outcome = 'invalidated') AS lost_lookups,
           count(ghost_bytes) FILTER (WHERE outcome = 'invalidated') AS saved_by_memory,
           quantile_cont(ghost_bytes, 0.5) / 1048576 AS ghost_mib_p50,
           quantile_cont(ghost_bytes, 0.9) / 1048576 AS ghost_mib_p90,
           max(ghost_bytes) / 1048576 AS ghost_mib_max,
           coalesce(sum(ghost_tokens - usable_tokens) FILTER (WHERE ghost_bytes IS NOT NULL), 0)::BIGINT AS ghost_gain_tokens
    FROM cache_lookups
    WHERE ts >= $now - to_seconds($since_seconds::BIGINT) AND {_FILTER.format(t="")}
    GROUP BY form
    ORDER BY form
    """,
    params=(_SINCE, _engine(), _MODEL),
    columns=("form", "lost_lookups", "saved_by_memory", "ghost_mib_p50", "ghost_mib_p90", "ghost_mib_max", "ghost_gain_tokens"),
)

GPU_TIMESERIES = NamedQuery(
    name="gpu_timeseries",
    description="Per time bucket and GPU, from the agent's NVML sampler: memory used and total, utilisation.",
    sql=f"""
    SELECT {_BUCKET_EXPR.format(t="")} AS bucket, gpu_index, any_value(name) AS name,
           avg(memory_used_bytes)::BIGINT AS memory_used_bytes, max(memory_total_bytes)::BIGINT AS memory_total_bytes,
           avg(utilization_ratio) AS utilization_ratio
    FROM gpu_stats
    WHERE ts >= $now - to_seconds($since_seconds::BIGINT)
    GROUP BY ALL
    ORDER BY bucket, gpu_index
    """,
    params=(_SINCE, _BUCKET),
    columns=("bucket", "gpu_index", "name", "memory_used_bytes", "memory_total_bytes", "utilization_ratio"),
)

INGEST_HEALTH = NamedQuery(
    name="ingest_health",
    description=(
        "Per time bucket (by when the agent received the batch): batches stored, duplicate and "
        "rejected, events stored, seq gaps detected, and the p50/p95 ingest lag (seconds from a "
        "request's ts to its storing)."
    ),
    sql="""
    WITH b AS (
        SELECT time_bucket(to_seconds($bucket_seconds::BIGINT), received_at, TIMESTAMP '1970-01-01') AS bucket,
               count(*) FILTER (WHERE status = 'stored') AS stored_batches,
               count(*) FILTER (WHERE status = 'duplicate') AS duplicate_batches,
               count(*) FILTER (WHERE status = 'rejected') AS rejected_batches,
               coalesce(sum(rows) FILTER (WHERE status = 'stored'), 0)::BIGINT AS events
        FROM ingest_batches
        WHERE received_at >= $now - to_seconds($since_seconds::BIGINT)
          AND ($engine_id::VARCHAR IS NULL OR engine_id = $engine_id)
        GROUP BY ALL
    ),
    g AS (
        SELECT time_bucket(to_seconds($bucket_seconds::BIGINT), detected_at, TIMESTAMP '1970-01-01') AS bucket,
               sum(last_missing - first_missing + 1)::BIGINT AS missing_batches
        FROM ingest_gaps
        WHERE detected_at >= $now - to_seconds($since_seconds::BIGINT)
          AND ($engine_id::VARCHAR IS NULL OR engine_id = $engine_id)
        GROUP BY ALL
    ),
    l AS (
        SELECT time_bucket(to_seconds($bucket_seconds::BIGINT), ingested_at, TIMESTAMP '1970-01-01') AS bucket,
               quantile_cont(epoch(ingested_at) - epoch(ts), 0.5) AS lag_p50_seconds,
               quantile_cont(epoch(ingested_at) - epoch(ts), 0.95) AS lag_p95_seconds
        FROM requests
        WHERE ingested_at >= $now - to_seconds($since_seconds::BIGINT)
          AND ($engine_id::VARCHAR IS NULL OR engine_id = $engine_id)
        GROUP BY ALL
    )
    SELECT bucket,
           coalesce(stored_batches, 0) AS stored_batches, coalesce(duplicate_batches, 0) AS duplicate_batches,
           coalesce(rejected_batches, 0) AS rejected_batches, coalesce(events, 0)::BIGINT AS events,
           coalesce(missing_batches, 0)::BIGINT AS missing_batches, lag_p50_seconds, lag_p95_seconds
    FROM b FULL OUTER JOIN g USING (bucket) FULL OUTER JOIN l USING (bucket)
    ORDER BY bucket
    """,
    params=(_SINCE, _BUCKET, _engine()),
    columns=(
        "bucket",
        "stored_batches",
        "duplicate_batches",
        "rejected_batches",
        "events",
        "missing_batches",
        "lag_p50_seconds",
        "lag_p95_seconds",
    ),
)

NAMED_QUERIES: Mapping[str, NamedQuery] = MappingProxyType(
    {
        q.name: q
        for q in (
            TOTALS,
            FORM_OUTCOMES,
            HIT_RATE_TIMESERIES,
            FORM_USABLE_TIMESERIES,
            RECENT_REQUESTS,
            ENGINES,
            SCHEMA,
            REQUEST_LOOKUPS,
            ALERTS_RECENT,
            INGEST_SEQ_GAPS,
            FORM_WINDOW,
            FORM_TIMESERIES,
            LIMITING_FORMS,
            CAPACITY_TIMESERIES,
            CAPACITY_LATEST,
            CAPACITY_WHATIF,
            FORM_GHOSTS,
            GPU_TIMESERIES,
            INGEST_HEALTH,
        )
    }
)
"""Every named query, by name."""


def get_query(name: str) -> NamedQuery:
    """The named query ``name``. Raises :class:`UnknownQuery` listing the known names."""
    try:
        return NAMED_QUERIES[name]
    except KeyError:
        raise UnknownQuery(name, sorted(NAMED_QUERIES)) from None
