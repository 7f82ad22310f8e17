"""Named queries over device memory: capacity time series and latest snapshot from the engines'
stats, the what-if replay against more or less memory per form, per-form ghost points, and the
agent's GPU samples.

Each is a :class:`~agent.named_query.NamedQuery`; :mod:`agent.queries` collects them by name.
"""

from __future__ import annotations

from agent.named_query import (
    BUCKET_EXPR,
    BUCKET_PARAM,
    FILTER_SQL,
    MODEL_PARAM,
    SINCE_PARAM,
    NamedQuery,
    QueryParam,
    engine_param,
)
from agent.rollups import LOOKUP_SLACK

_SNAPSHOTS = f"""snapshots AS (  -- one row per engine, form, tier and snapshot: a form's pools summed
        SELECT engine_id, form, tier, ts, sum(used_bytes) AS used_bytes, sum(used_blocks) AS used_blocks,
               sum(cached_blocks) AS cached_blocks, sum(free_blocks) AS free_blocks, sum(total_blocks) AS total_blocks
        FROM engine_stats
        WHERE ts >= $now - to_seconds($since_seconds::BIGINT) AND {FILTER_SQL.format(t="")}
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
        SELECT {BUCKET_EXPR.format(t="")} AS bucket, engine_id, form, tier,
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
    params=(SINCE_PARAM, BUCKET_PARAM, engine_param(), MODEL_PARAM),
    columns=("bucket", "form", "tier", "used_bytes", "used_blocks", "cached_blocks", "free_blocks", "total_blocks"),
)

CAPACITY_LATEST = NamedQuery(
    name="capacity_latest",
    description=(
        "Per form and tier: each engine's latest stats snapshot in the window, summed over the "
        "engines seen in the last recent_seconds (default 300; an engine that stopped sending "
        "stats earlier is left out) — bytes and blocks used, cached, free, total."
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
        HAVING max(ts) >= $now - to_seconds($recent_seconds::BIGINT)
    )
    SELECT form, tier, sum(used_bytes)::BIGINT AS used_bytes, sum(used_blocks)::BIGINT AS used_blocks,
           sum(cached_blocks)::BIGINT AS cached_blocks, sum(free_blocks)::BIGINT AS free_blocks,
           sum(total_blocks)::BIGINT AS total_blocks, count(*) AS engines
    FROM latest
    GROUP BY ALL
    ORDER BY form, tier
    """,
    params=(
        SINCE_PARAM,
        engine_param(),
        MODEL_PARAM,
        QueryParam(name="recent_seconds", kind=int, default=300, minimum=1, maximum=366 * 86400, description="only engines with a snapshot this recent"),
    ),
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
        SELECT r.engine_id, r.run_id, r.request_id, r.prompt_tokens, r.recoverable_tokens AS recorded, l.form,
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
        JOIN cache_lookups AS l ON l.engine_id = r.engine_id AND l.request_id = r.request_id AND l.run_id IS NOT DISTINCT FROM r.run_id
        WHERE r.ts >= $now - to_seconds($since_seconds::BIGINT) AND {FILTER_SQL.format(t="r.")}
          AND l.ts >= $now - to_seconds($since_seconds::BIGINT) - {LOOKUP_SLACK}
          AND l.ts BETWEEN r.ts - {LOOKUP_SLACK} AND r.ts + {LOOKUP_SLACK}
        GROUP BY ALL
    ), per_request AS (
        SELECT prompt_tokens, recorded, min(usable) AS replay, min(usable_if) AS what_if
        FROM per_form
        GROUP BY engine_id, run_id, request_id, prompt_tokens, recorded
    )
    SELECT count(*) AS requests, coalesce(sum(prompt_tokens), 0)::BIGINT AS prompt_tokens,
           coalesce(sum(recorded), 0)::BIGINT AS recorded_tokens, coalesce(sum(replay), 0)::BIGINT AS replay_tokens,
           coalesce(sum(what_if), 0)::BIGINT AS what_if_tokens,
           sum(recorded)::DOUBLE / nullif(sum(prompt_tokens), 0) AS recorded_rate,
           sum(replay)::DOUBLE / nullif(sum(prompt_tokens), 0) AS replay_rate,
           sum(what_if)::DOUBLE / nullif(sum(prompt_tokens), 0) AS what_if_rate
    FROM per_request
    """,
    params=(SINCE_PARAM, engine_param(), MODEL_PARAM, *_EXTRA),
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
    WHERE ts >= $now - to_seconds($since_seconds::BIGINT) AND {FILTER_SQL.format(t="")}
    GROUP BY form
    ORDER BY form
    """,
    params=(SINCE_PARAM, engine_param(), MODEL_PARAM),
    columns=("form", "lost_lookups", "saved_by_memory", "ghost_mib_p50", "ghost_mib_p90", "ghost_mib_max", "ghost_gain_tokens"),
)

GPU_TIMESERIES = NamedQuery(
    name="gpu_timeseries",
    description="Per time bucket and GPU, from the agent's NVML sampler: memory used and total, utilisation.",
    sql=f"""
    SELECT {BUCKET_EXPR.format(t="")} AS bucket, gpu_index, any_value(name) AS name,
           avg(memory_used_bytes)::BIGINT AS memory_used_bytes, max(memory_total_bytes)::BIGINT AS memory_total_bytes,
           avg(utilization_ratio) AS utilization_ratio
    FROM gpu_stats
    WHERE ts >= $now - to_seconds($since_seconds::BIGINT)
    GROUP BY ALL
    ORDER BY bucket, gpu_index
    """,
    params=(SINCE_PARAM, BUCKET_PARAM),
    columns=("bucket", "gpu_index", "name", "memory_used_bytes", "memory_total_bytes", "utilization_ratio"),
)
