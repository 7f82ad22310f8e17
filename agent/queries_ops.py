"""Named queries about the agent itself: the readable schema, the engines seen, recent alert rows,
ingest seq gaps and ingest health.

Each is a :class:`~agent.named_query.NamedQuery`; :mod:`agent.queries` collects them by name.
"""

from __future__ import annotations

from agent.named_query import (
    BUCKET_PARAM,
    LIMIT_PARAM,
    SINCE_PARAM,
    NamedQuery,
    engine_param,
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
    params=(SINCE_PARAM,),
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
    params=(LIMIT_PARAM,),
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
    params=(engine_param(),),
    columns=("engine_id", "max_seq", "received", "missing"),
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
    params=(SINCE_PARAM, BUCKET_PARAM, engine_param()),
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
