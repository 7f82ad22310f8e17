"""Named queries over the CSA indexer's sync delay (issue 23): how far the indexer's state trailed
the main compressed KV boundary where lookups met it (``cache_lookups.indexer_sync_delay_tokens``
and ``indexer_sync_delay_seconds``, migration 10; rows stored before it read 0).

Only ``indexer_state`` lookups carry the delay (every other form's is 0), so both queries read
those alone. A healthy engine reports 0 everywhere: the Forms page shows "in sync" then.

* :data:`INDEXER_SYNC_DELAY` — per time bucket and layer group: lookups, those that met a
  trailing index, and the max / p95 delay in tokens and in seconds (the Forms page's panel);
* :data:`INDEXER_SYNC_DELAY_SERIES` — per (engine, model, layer_group): the window's largest
  delay in tokens, only where it exceeds a threshold (the ``indexer_sync_delay`` alert kind
  evaluates it as its ``value``).
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

_INDEXER_LOOKUPS = "form = 'indexer_state' AND ts >= $now - to_seconds($since_seconds::BIGINT)"
"""Constant SQL (no user input): the window's ``indexer_state`` lookups."""

INDEXER_SYNC_DELAY = NamedQuery(
    name="indexer_sync_delay",
    description=(
        "Per time bucket and indexer layer group, from the raw indexer_state lookups: lookups, those "
        "whose indexer state trailed the main compressed KV boundary (trailing_lookups), and the max "
        "and p95 of the delay in tokens and in seconds since that state last matched (0: in sync)."
    ),
    sql=f"""
    SELECT {BUCKET_EXPR.format(t="")} AS bucket, layer_group,
           count(*)::BIGINT AS lookups,
           count(*) FILTER (WHERE indexer_sync_delay_tokens > 0)::BIGINT AS trailing_lookups,
           max(indexer_sync_delay_tokens)::BIGINT AS max_delay_tokens,
           quantile_cont(indexer_sync_delay_tokens, 0.95)::DOUBLE AS p95_delay_tokens,
           max(indexer_sync_delay_seconds)::DOUBLE AS max_delay_seconds,
           quantile_cont(indexer_sync_delay_seconds, 0.95)::DOUBLE AS p95_delay_seconds
    FROM cache_lookups
    WHERE {_INDEXER_LOOKUPS} AND {FILTER_SQL.format(t="")}
    GROUP BY ALL
    ORDER BY bucket, layer_group
    """,
    params=(SINCE_PARAM, BUCKET_PARAM, engine_param(), MODEL_PARAM),
    columns=(
        "bucket",
        "layer_group",
        "lookups",
        "trailing_lookups",
        "max_delay_tokens",
        "p95_delay_tokens",
        "max_delay_seconds",
        "p95_delay_seconds",
    ),
)

INDEXER_SYNC_DELAY_SERIES = NamedQuery(
    name="indexer_sync_delay_series",
    description=(
        "Per engine, model and indexer layer group: the largest indexer sync delay (tokens) of the "
        "indexer_state lookups over the last since_seconds, only where it exceeds threshold_tokens "
        "(the indexer_sync_delay alert kind's value; labels engine, model, layer_group)."
    ),
    sql=f"""
    SELECT engine_id AS engine, model, layer_group::VARCHAR AS layer_group,
           max(indexer_sync_delay_tokens)::BIGINT AS value
    FROM cache_lookups
    WHERE {_INDEXER_LOOKUPS} AND ts < $now
    GROUP BY ALL
    HAVING max(indexer_sync_delay_tokens) > $threshold_tokens::BIGINT
    ORDER BY engine, model, layer_group
    """,
    params=(
        QueryParam(name="since_seconds", kind=int, default=300, minimum=1, maximum=86400, description="the window, seconds before now"),
        QueryParam(name="threshold_tokens", kind=int, default=0, minimum=0, maximum=2**40, description="report only delays above this"),
    ),
    columns=("engine", "model", "layer_group", "value"),
)
