"""Named queries over requests and their cache lookups: lifetime totals, per-form outcomes, hit-rate,
usable-token and per-form time series, recent requests and one request's lookups, the per-form
window and the limiting forms.

Each is a :class:`~agent.named_query.NamedQuery`; :mod:`agent.queries` collects them by name.
"""

from __future__ import annotations

from agent.migrations import RECOVERY_BUCKETS_V3, bucket_column
from agent.named_query import (
    BUCKET_EXPR,
    BUCKET_PARAM,
    FILTER_SQL,
    LIMIT_PARAM,
    MODEL_PARAM,
    RUN_PARAM,
    RUN_SQL,
    SINCE_PARAM,
    NamedQuery,
    QueryParam,
    engine_param,
)
from agent.rollups import LOOKUP_SLACK

TOTALS = NamedQuery(
    name="totals",
    description="Lifetime request and token totals (run_id: of one run of the engine).",
    sql=f"""
    SELECT
        count(*) AS requests,
        coalesce(sum(prompt_tokens), 0)::BIGINT AS prompt_tokens,
        coalesce(sum(hash_hit_tokens), 0)::BIGINT AS hash_hit_tokens,
        coalesce(sum(recoverable_tokens), 0)::BIGINT AS recoverable_tokens,
        coalesce(sum(replayed_tokens), 0)::BIGINT AS replayed_tokens,
        coalesce(sum(recomputed_tokens), 0)::BIGINT AS recomputed_tokens
    FROM requests
    WHERE ($engine_id::VARCHAR IS NULL OR engine_id = $engine_id) AND {RUN_SQL.format(t="")}
    """,
    params=(engine_param(), RUN_PARAM),
    columns=(
        "requests",
        "prompt_tokens",
        "hash_hit_tokens",
        "recoverable_tokens",
        "replayed_tokens",
        "recomputed_tokens",
    ),
)

_HEADLINE_SUMS = ("prompt_tokens", "hash_hit_tokens", "recoverable_tokens")

HEADLINE = NamedQuery(
    name="headline",
    description=(
        "The Overview's headline: prompt, hash-hit and recoverable token sums of the requests in "
        "the trailing window_seconds, and of the window before it (previous_*), with their counts."
    ),
    sql=f"""
    SELECT
        count(*) FILTER (WHERE ts >= $now - to_seconds($window_seconds::BIGINT)) AS requests,
        {", ".join(f"coalesce(sum({c}) FILTER (WHERE ts >= $now - to_seconds($window_seconds::BIGINT)), 0)::BIGINT AS {c}" for c in _HEADLINE_SUMS)},
        count(*) FILTER (WHERE ts < $now - to_seconds($window_seconds::BIGINT)) AS previous_requests,
        {", ".join(f"coalesce(sum({c}) FILTER (WHERE ts < $now - to_seconds($window_seconds::BIGINT)), 0)::BIGINT AS previous_{c}" for c in _HEADLINE_SUMS)}
    FROM requests
    WHERE ts >= $now - to_seconds(2 * $window_seconds::BIGINT) AND ts < $now AND {FILTER_SQL.format(t="")}
    """,
    params=(
        QueryParam(name="window_seconds", kind=int, default=300, minimum=10, maximum=86400, description="the trailing window, seconds"),
        engine_param(),
        MODEL_PARAM,
    ),
    columns=("requests", *_HEADLINE_SUMS, "previous_requests", *(f"previous_{c}" for c in _HEADLINE_SUMS)),
)

FORM_OUTCOMES = NamedQuery(
    name="form_outcomes",
    description="Lookups per form, outcome and reason, with their usable and recoverable tokens (run_id: of one run).",
    sql=f"""
    SELECT
        form,
        outcome,
        reason,
        count(*) AS lookups,
        sum(usable_tokens)::BIGINT AS usable_tokens,
        sum(recoverable_tokens)::BIGINT AS recoverable_tokens
    FROM cache_lookups
    WHERE ($engine_id::VARCHAR IS NULL OR engine_id = $engine_id) AND {RUN_SQL.format(t="")}
    GROUP BY form, outcome, reason
    ORDER BY form, outcome, reason
    """,
    params=(engine_param(), RUN_PARAM),
    columns=("form", "outcome", "reason", "lookups", "usable_tokens", "recoverable_tokens"),
)

HIT_RATE_TIMESERIES = NamedQuery(
    name="hit_rate_timeseries",
    description="Per time bucket: request token sums and the raw and recoverable hit rates.",
    sql=f"""
    SELECT
        {BUCKET_EXPR.format(t="")} AS bucket,
        count(*) AS requests,
        sum(prompt_tokens)::BIGINT AS prompt_tokens,
        sum(hash_hit_tokens)::BIGINT AS hash_hit_tokens,
        sum(recoverable_tokens)::BIGINT AS recoverable_tokens,
        sum(replayed_tokens)::BIGINT AS replayed_tokens,
        sum(recomputed_tokens)::BIGINT AS recomputed_tokens,
        sum(hash_hit_tokens)::DOUBLE / nullif(sum(prompt_tokens), 0) AS raw_hit_rate,
        sum(recoverable_tokens)::DOUBLE / nullif(sum(prompt_tokens), 0) AS recoverable_hit_rate
    FROM requests
    WHERE ts >= $now - to_seconds($since_seconds::BIGINT) AND {FILTER_SQL.format(t="")}
    GROUP BY bucket
    ORDER BY bucket
    """,
    params=(SINCE_PARAM, BUCKET_PARAM, engine_param(), MODEL_PARAM),
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
          AND minute >= date_trunc('minute', $now - to_seconds($since_seconds::BIGINT)) AND {FILTER_SQL.format(t="")}
        GROUP BY ALL
    ), per_request AS (
        SELECT r.ts, r.prompt_tokens, l.form, min(l.usable_tokens) AS usable_tokens
        FROM requests AS r
        JOIN cache_lookups AS l ON l.engine_id = r.engine_id AND l.request_id = r.request_id AND l.run_id IS NOT DISTINCT FROM r.run_id
        WHERE $bucket_seconds::BIGINT % 60 <> 0
          AND r.ts >= $now - to_seconds($since_seconds::BIGINT) AND {FILTER_SQL.format(t="r.")}
          -- a request's lookups: within an hour of its ts (agent.rollups.LOOKUP_SLACK)
          AND l.ts >= $now - to_seconds($since_seconds::BIGINT) - {LOOKUP_SLACK}
          AND l.ts BETWEEN r.ts - {LOOKUP_SLACK} AND r.ts + {LOOKUP_SLACK}
        GROUP BY r.engine_id, r.run_id, r.request_id, r.ts, r.prompt_tokens, l.form
    ), raw AS (
        SELECT {BUCKET_EXPR.format(t="")} AS bucket, form,
               sum(usable_tokens) AS usable_tokens, sum(prompt_tokens) AS prompt_tokens
        FROM per_request
        GROUP BY ALL
    )
    SELECT bucket, form, usable_tokens::BIGINT AS usable_tokens, prompt_tokens::BIGINT AS prompt_tokens,
           usable_tokens::DOUBLE / nullif(prompt_tokens, 0) AS usable_rate
    FROM (SELECT * FROM rolled UNION ALL SELECT * FROM raw)
    ORDER BY bucket, form
    """,
    params=(SINCE_PARAM, BUCKET_PARAM, engine_param(), MODEL_PARAM),
    columns=("bucket", "form", "usable_tokens", "prompt_tokens", "usable_rate"),
)

RECENT_REQUESTS = NamedQuery(
    name="recent_requests",
    description=(
        "The latest requests, newest first; optionally only those in the last since_seconds, "
        "with ts in [start_ts, end_ts) (unix seconds: one chart bucket), limited by one form "
        "(the named limiting_form or any form of a tie) and/or one reason (limiting_reason: with "
        "limiting_form, that form's own reason, as tokens_lost charges a tie), or whose request id contains search "
        "(case-insensitive). limiting_forms lists every form tied as limiting ([] when none, or "
        "for rows stored before schema 9)."
    ),
    sql=f"""
    SELECT * EXCLUDE (ingested_at)
    FROM requests
    WHERE {FILTER_SQL.format(t="")}
      AND ($since_seconds::BIGINT IS NULL OR ts >= $now - to_seconds($since_seconds::BIGINT))
      AND ($start_ts::DOUBLE IS NULL OR ts >= make_timestamp(($start_ts::DOUBLE * 1e6)::BIGINT))
      AND ($end_ts::DOUBLE IS NULL OR ts < make_timestamp(($end_ts::DOUBLE * 1e6)::BIGINT))
      AND ($limiting_form::VARCHAR IS NULL OR limiting_form = $limiting_form OR list_contains(limiting_forms, $limiting_form))
      AND ($limiting_reason::VARCHAR IS NULL OR CASE
            WHEN $limiting_form::VARCHAR IS NULL OR limiting_form = $limiting_form THEN limiting_reason = $limiting_reason
            -- a tied form's own reason, as tokens_lost charges it: its lookup of least usable tokens
            ELSE coalesce((
                SELECT arg_min(l.reason, l.usable_tokens) FROM cache_lookups AS l
                WHERE l.engine_id = requests.engine_id AND l.request_id = requests.request_id AND l.form = $limiting_form
                  AND l.ts BETWEEN requests.ts - {LOOKUP_SLACK} AND requests.ts + {LOOKUP_SLACK}
            ), limiting_reason) = $limiting_reason END)
      AND ($search::VARCHAR IS NULL OR contains(lower(request_id), lower($search)))
    ORDER BY ts DESC, request_id
    LIMIT $limit
    """,
    params=(
        LIMIT_PARAM,
        engine_param(),
        MODEL_PARAM,
        QueryParam(name="since_seconds", kind=int, minimum=1, maximum=366 * 86400, description="only requests this recent"),
        QueryParam(name="start_ts", kind=float, minimum=0, maximum=2**33, description="only requests at or after (unix seconds)"),
        QueryParam(name="end_ts", kind=float, minimum=0, maximum=2**33, description="only requests before (unix seconds)"),
        QueryParam(name="limiting_form", kind=str, description="only requests this form limited, alone or tied"),
        QueryParam(name="limiting_reason", kind=str, description="only requests whose resume point stopped for this reason"),
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
        "run_id",
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
    params=(QueryParam(name="request_id", kind=str, description="the request"), engine_param()),
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
    params=(engine_param(), MODEL_PARAM, SINCE_PARAM),
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
      AND {FILTER_SQL.format(t="")}
    GROUP BY ALL
    ORDER BY bucket, form, tier, outcome, reason
    """,
    params=(SINCE_PARAM, BUCKET_PARAM, engine_param(), MODEL_PARAM, QueryParam(name="form", kind=str, description="only this form")),
    columns=("bucket", "form", "tier", "outcome", "reason", "lookups", "hash_hit_tokens", "recoverable_tokens", *_LE_COLUMNS),
)

RANK_DISAGREEMENTS = NamedQuery(
    name="rank_disagreements",
    description=(
        "Per form and tensor-parallel rank over the window, from the raw lookups: lookups another "
        "rank held back (reason tp_disagree, tp_rank = that rank), the tokens they lost (hash hit "
        "minus recoverable), the requests involved and the last time it happened."
    ),
    sql=f"""
    SELECT form, tp_rank,
           count(*)::BIGINT AS lookups,
           sum(hash_hit_tokens - recoverable_tokens)::BIGINT AS tokens_lost,
           count(DISTINCT request_id)::BIGINT AS requests,
           max(ts) AS last_seen
    FROM cache_lookups
    WHERE ts >= $now - to_seconds($since_seconds::BIGINT) AND reason = 'tp_disagree' AND {FILTER_SQL.format(t="")}
    GROUP BY form, tp_rank
    ORDER BY tokens_lost DESC, form, tp_rank
    """,
    params=(SINCE_PARAM, engine_param(), MODEL_PARAM),
    columns=("form", "tp_rank", "lookups", "tokens_lost", "requests", "last_seen"),
)

LIMITING_FORMS = NamedQuery(
    name="limiting_forms",
    description=(
        "Per time bucket: requests by the form named as setting their resume point (NULL: none "
        "limited it). A request whose limit was a tie counts once, under its limiting_form; the "
        "tied forms are recent_requests' limiting_forms."
    ),
    sql=f"""
    SELECT {BUCKET_EXPR.format(t="")} AS bucket, limiting_form, count(*) AS requests
    FROM requests
    WHERE ts >= $now - to_seconds($since_seconds::BIGINT) AND {FILTER_SQL.format(t="")}
    GROUP BY ALL
    ORDER BY bucket, limiting_form NULLS FIRST
    """,
    params=(SINCE_PARAM, BUCKET_PARAM, engine_param(), MODEL_PARAM),
    columns=("bucket", "limiting_form", "requests"),
)
