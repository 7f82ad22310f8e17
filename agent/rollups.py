"""The rollups folded from stored rows (DESIGN.md §6): ``cache_minute`` and
``form_usable_minute``, each folded from the rows stored since its watermark
(``rollup_watermarks``, by ``ingested_at``), moved in the same transaction. The maintenance job
runs :func:`fold_cache_minute` and :func:`fold_form_usable_minute` every
``rollup_interval_seconds``; docs/agent.md ("Rollups") states what each minute sums.
"""

from __future__ import annotations

from datetime import datetime

import duckdb

from agent.ingest import RECOVERING_SQL, RECOVERY_BUCKETS
from agent.migrations import bucket_column
from agent.store import Store

_BUCKET_SELECT = ", ".join(
    f"count(*) FILTER (WHERE {RECOVERING_SQL} AND recovery_seconds <= {bound!r})"
    for bound in RECOVERY_BUCKETS
)
_SUMMED = (
    "lookups",
    "approximate_lookups",
    "hash_hit_tokens",
    "usable_tokens",
    "recoverable_tokens",
    "replayed_tokens",
    "bytes_moved",
    "recovery_seconds_sum",
    *(bucket_column(b) for b in RECOVERY_BUCKETS),
)
_CACHE_MINUTE_UPSERT = f"""
    INSERT INTO cache_minute
    SELECT date_trunc('minute', ts), engine_id, model, form, tier, outcome, reason,
           count(*), count(*) FILTER (WHERE approximate),
           sum(hash_hit_tokens), sum(usable_tokens), sum(recoverable_tokens),
           sum(replayed_tokens), sum(bytes_moved), sum(recovery_seconds),
           {_BUCKET_SELECT}
    FROM cache_lookups
    WHERE ingested_at > $low AND ingested_at <= $high
    GROUP BY ALL
    ON CONFLICT (minute, engine_id, model, form, tier, outcome, reason) DO UPDATE SET
    {", ".join(f"{c} = {c} + EXCLUDED.{c}" for c in _SUMMED)}
"""


def fold_cache_minute(store: Store) -> int:
    """Fold the ``cache_lookups`` rows stored since the last fold into ``cache_minute``; returns
    how many rows were folded.

    Rows are taken by ``ingested_at`` above the ``cache_minute`` watermark, up to the newest
    committed one; the watermark moves in the same transaction as the sums, so every row is
    folded exactly once, late events (an old ``ts``) land in their own minute, and a crash
    between folds only delays them. Correct because the ingest flusher stamps ``ingested_at`` in
    increasing order and commits flushes one after the other: when a row stamped ``W`` is
    visible, every row stamped before ``W`` is too. Runs under the store's writer lock (between
    two flushes).

    Raises:
        duckdb.Error, StoreClosedError: the store failed; nothing moved.
    """
    with store.transaction() as cur:
        low = _watermark(cur, "cache_minute")
        ((high, count),) = cur.execute(
            "SELECT max(ingested_at), count(*) FROM cache_lookups WHERE ingested_at > $low",
            {"low": low},
        ).fetchall()
        if count:
            cur.execute(_CACHE_MINUTE_UPSERT, {"low": low, "high": high})
            _move_watermark(cur, "cache_minute", high)
    return int(count)


def _watermark(cur: duckdb.DuckDBPyConnection, name: str) -> datetime:
    """The ``ingested_at`` a rollup has folded up to (the epoch before its first fold)."""
    rows = cur.execute("SELECT ingested_at FROM rollup_watermarks WHERE name = $name", {"name": name}).fetchall()
    return rows[0][0] if rows else datetime(1970, 1, 1)


def _move_watermark(cur: duckdb.DuckDBPyConnection, name: str, high: datetime) -> None:
    cur.execute(
        "INSERT INTO rollup_watermarks VALUES ($name, $high) ON CONFLICT (name) DO UPDATE SET ingested_at = EXCLUDED.ingested_at",
        {"name": name, "high": high},
    )


LOOKUP_SLACK = "INTERVAL 1 HOUR"
"""A request's lookups are those of its engine and id with ``ts`` within this of the request's
own ``ts``, either side (lookups happen at admission, the request event at the end; a producer's
clocks may differ a little); others — of requests that ran longer — are left out, by the fold
and by the raw queries alike."""

_FORM_USABLE_UPSERT = f"""
    INSERT INTO form_usable_minute
    WITH touched AS (  -- requests stored since the fold, and older ones a late lookup belongs to
        SELECT engine_id, run_id, request_id, model, ts, prompt_tokens, ingested_at > $low AS new
        FROM requests
        WHERE ingested_at <= $high AND (
            ingested_at > $low
            OR (ts >= $late_low::TIMESTAMP - {LOOKUP_SLACK} AND ts <= $late_high::TIMESTAMP + {LOOKUP_SLACK} AND (engine_id, request_id) IN (
                SELECT engine_id, request_id FROM cache_lookups WHERE ingested_at > $low AND ingested_at <= $high
            ))
        )
    ), per_form AS (
        SELECT r.engine_id, r.run_id, r.request_id, r.model, r.ts, r.prompt_tokens, r.new, l.form,
               min(l.usable_tokens) AS usable_now,
               min(l.usable_tokens) FILTER (WHERE l.ingested_at <= $low) AS usable_before
        FROM touched AS r
        JOIN cache_lookups AS l ON l.engine_id = r.engine_id AND l.request_id = r.request_id AND l.run_id IS NOT DISTINCT FROM r.run_id
        WHERE l.ingested_at <= $high
          AND l.ts >= (SELECT min(ts) FROM touched) - {LOOKUP_SLACK}
          AND l.ts BETWEEN r.ts - {LOOKUP_SLACK} AND r.ts + {LOOKUP_SLACK}
        GROUP BY ALL
    )
    SELECT date_trunc('minute', ts), engine_id, model, form,
           -- a request counts once per form: when it (or its first lookup of the form) is folded;
           -- a late lookup that lowers the minimum subtracts the difference
           count(*) FILTER (WHERE new OR usable_before IS NULL),
           sum(CASE WHEN new OR usable_before IS NULL THEN usable_now ELSE usable_now - usable_before END),
           sum(CASE WHEN new OR usable_before IS NULL THEN prompt_tokens ELSE 0 END)
    FROM per_form
    GROUP BY ALL
    ON CONFLICT (minute, engine_id, model, form) DO UPDATE SET
        requests = requests + EXCLUDED.requests,
        usable_tokens = usable_tokens + EXCLUDED.usable_tokens,
        prompt_tokens = prompt_tokens + EXCLUDED.prompt_tokens
"""


def fold_form_usable_minute(store: Store) -> int:
    """Fold the requests stored since the last fold, and the lookups stored since then whose
    request was folded before, into ``form_usable_minute``; returns how many requests and
    lookups were new.

    A row holds, per minute of the requests' ``ts``, engine, model and form: how many requests
    looked the form up, Σ of each request's usable tokens of the form (the minimum over its
    lookups: layer groups, tensor-parallel ranks) and Σ of their prompt tokens — what
    ``form_usable_timeseries`` computes from the raw tables, so that a day's Overview reads a few
    thousand rows instead of every lookup. A lookup stored after its request was folded lowers
    that request's minimum by the difference; a request with no stored lookup of a form does not
    count for it until one arrives. Watermark and atomicity as :func:`fold_cache_minute`.

    Raises:
        duckdb.Error, StoreClosedError: the store failed; nothing moved.
    """
    with store.transaction() as cur:
        low = _watermark(cur, "form_usable_minute")
        ((high, requests, lookups, late_low, late_high),) = cur.execute(
            """
            SELECT greatest(r.high, l.high), r.n, l.n, l.low_ts, l.high_ts
            FROM (SELECT max(ingested_at) AS high, count(*) AS n FROM requests WHERE ingested_at > $low) AS r,
                 (SELECT max(ingested_at) AS high, count(*) AS n, min(ts) AS low_ts, max(ts) AS high_ts
                  FROM cache_lookups WHERE ingested_at > $low) AS l
            """,
            {"low": low},
        ).fetchall()
        if requests or lookups:
            cur.execute(
                _FORM_USABLE_UPSERT,
                {"low": low, "high": high, "late_low": late_low, "late_high": late_high},
            )
            _move_watermark(cur, "form_usable_minute", high)
    return int(requests) + int(lookups)
