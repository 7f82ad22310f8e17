"""Named, parameterised queries (``GET /v1/query/{name}``), used by the dashboard and alerts.

The public entry point: :data:`NAMED_QUERIES` and :func:`get_query`, re-exporting the machinery
(:mod:`agent.named_query`) and every query constant, which are defined by concept in
:mod:`agent.queries_cache` (requests and cache lookups), :mod:`agent.queries_loss` (tokens lost by limiting form and
reason), :mod:`agent.queries_capacity` (device memory, what-if, GPU), :mod:`agent.queries_indexer` (the CSA
indexer's sync delay) and :mod:`agent.queries_ops` (schema, engines, alerts, ingest).

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
from types import MappingProxyType

from agent.named_query import (
    MAX_NAME_CHARS,
    BadParam,
    NamedQuery,
    QueryError,
    QueryParam,
    UnknownQuery,
)
from agent.queries_cache import (
    FORM_OUTCOMES,
    FORM_TIMESERIES,
    FORM_USABLE_TIMESERIES,
    FORM_WINDOW,
    HEADLINE,
    HIT_RATE_TIMESERIES,
    LIMITING_FORMS,
    RANK_DISAGREEMENTS,
    RECENT_REQUESTS,
    REQUEST_LOOKUPS,
    TOTALS,
)
from agent.queries_capacity import (
    CAPACITY_LATEST,
    CAPACITY_TIMESERIES,
    CAPACITY_WHATIF,
    FORM_GHOSTS,
    GPU_TIMESERIES,
)
from agent.queries_indexer import INDEXER_SYNC_DELAY, INDEXER_SYNC_DELAY_SERIES
from agent.queries_loss import TOKENS_LOST
from agent.queries_ops import ALERTS_RECENT, ENGINES, INGEST_HEALTH, INGEST_SEQ_GAPS, SCHEMA

__all__ = [
    "ALERTS_RECENT",
    "CAPACITY_LATEST",
    "CAPACITY_TIMESERIES",
    "CAPACITY_WHATIF",
    "ENGINES",
    "FORM_GHOSTS",
    "FORM_OUTCOMES",
    "FORM_TIMESERIES",
    "FORM_USABLE_TIMESERIES",
    "FORM_WINDOW",
    "GPU_TIMESERIES",
    "HEADLINE",
    "HIT_RATE_TIMESERIES",
    "INDEXER_SYNC_DELAY",
    "INDEXER_SYNC_DELAY_SERIES",
    "INGEST_HEALTH",
    "INGEST_SEQ_GAPS",
    "LIMITING_FORMS",
    "MAX_NAME_CHARS",
    "NAMED_QUERIES",
    "RANK_DISAGREEMENTS",
    "RECENT_REQUESTS",
    "REQUEST_LOOKUPS",
    "SCHEMA",
    "TOKENS_LOST",
    "TOTALS",
    "BadParam",
    "NamedQuery",
    "QueryError",
    "QueryParam",
    "UnknownQuery",
    "get_query",
]

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
            HEADLINE,
            FORM_TIMESERIES,
            LIMITING_FORMS,
            RANK_DISAGREEMENTS,
            CAPACITY_TIMESERIES,
            CAPACITY_LATEST,
            CAPACITY_WHATIF,
            FORM_GHOSTS,
            GPU_TIMESERIES,
            INGEST_HEALTH,
            TOKENS_LOST,
            INDEXER_SYNC_DELAY,
            INDEXER_SYNC_DELAY_SERIES,
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
