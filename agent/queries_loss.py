"""Named query over the tokens the cache lost, by the form that limited the resume point and why.

A request's **lost tokens** are its hash-hit tokens that were not recoverable (``hash_hit_tokens -
recoverable_tokens``: matched by hash, then recomputed or replayed). They are charged to the form
that set its resume point L\\* with that form's reason. When several forms stopped at the same
point (a tie: ``requests.limiting_forms`` lists them), the request's lost tokens count under
**every** tied form, each with its own reason — its lookup's (the lookup of least usable tokens
over its layer groups and ranks, as :data:`agent.queries_cache.REQUEST_LOOKUPS` reads it), the
request's ``limiting_reason`` for the form it names — so a tie shows as a tie, not as one
arbitrary form, and the per-form totals add up to more than the tokens lost. Requests no form
limited but that still lost tokens (the admission chose to recompute, say) are the rows with a
NULL form.

Used by the Overview's "tokens lost" chart, the Forms page (which form it opens on, its reasons
ranked) and the ``kvscope up`` summary.
"""

from __future__ import annotations

from agent.named_query import (
    FILTER_SQL,
    MODEL_PARAM,
    RUN_PARAM,
    RUN_SQL,
    NamedQuery,
    QueryParam,
    engine_param,
)
from agent.rollups import LOOKUP_SLACK

_IN_WINDOW = "($since_seconds::BIGINT IS NULL OR {t}ts >= $now - to_seconds($since_seconds::BIGINT))"

TOKENS_LOST = NamedQuery(
    name="tokens_lost",
    description=(
        "Tokens lost (hash-hit minus recoverable tokens of each request) by the form that limited "
        "the resume point and its reason, most first, over the last since_seconds (absent: every "
        "stored request). A tie counts the request under every tied form, each with its own "
        "reason: tied_requests and tied_tokens_lost are the part that came from ties. form is "
        "NULL for requests no form limited that still lost tokens; form and reason filter, run_id "
        "keeps one run of the engine."
    ),
    sql=f"""
    WITH lost AS (
        SELECT engine_id, run_id, request_id, ts, limiting_form, limiting_reason,
               hash_hit_tokens - recoverable_tokens AS tokens_lost,
               len(limiting_forms) > 1 AS tied,
               CASE WHEN len(limiting_forms) > 0 THEN limiting_forms ELSE [limiting_form] END AS forms
        FROM requests
        WHERE hash_hit_tokens > recoverable_tokens AND {_IN_WINDOW.format(t="")} AND {FILTER_SQL.format(t="")}
          AND {RUN_SQL.format(t="")}
    ), charged AS (
        SELECT engine_id, run_id, request_id, ts, limiting_form, limiting_reason, tokens_lost, tied,
               unnest(forms) AS form
        FROM lost
    ), tied_reason AS (
        -- a tied form's own reason: from its lookups of that request (within the slack of its ts),
        -- of the same run (an engine keeping its id may replay the same request ids again)
        SELECT c.engine_id, c.run_id, c.request_id, c.form, arg_min(l.reason, l.usable_tokens) AS reason
        FROM charged AS c
        JOIN cache_lookups AS l
          ON l.engine_id = c.engine_id AND l.request_id = c.request_id AND l.form = c.form
         AND l.ts BETWEEN c.ts - {LOOKUP_SLACK} AND c.ts + {LOOKUP_SLACK} AND l.run_id IS NOT DISTINCT FROM c.run_id
        WHERE c.form IS DISTINCT FROM c.limiting_form
          AND ($since_seconds::BIGINT IS NULL OR l.ts >= $now - to_seconds($since_seconds::BIGINT) - {LOOKUP_SLACK})
        GROUP BY ALL
    ), reasoned AS (
        SELECT c.form,
               CASE WHEN c.form IS NOT DISTINCT FROM c.limiting_form THEN c.limiting_reason
                    ELSE coalesce(t.reason, c.limiting_reason) END AS reason,
               c.tokens_lost, c.tied
        FROM charged AS c
        LEFT JOIN tied_reason AS t
          ON t.engine_id = c.engine_id AND t.run_id IS NOT DISTINCT FROM c.run_id AND t.request_id = c.request_id AND t.form = c.form
    )
    SELECT form, reason,
           sum(tokens_lost)::BIGINT AS tokens_lost,
           count(*)::BIGINT AS requests,
           count(*) FILTER (WHERE tied)::BIGINT AS tied_requests,
           coalesce(sum(tokens_lost) FILTER (WHERE tied), 0)::BIGINT AS tied_tokens_lost
    FROM reasoned
    WHERE ($form::VARCHAR IS NULL OR form = $form) AND ($reason::VARCHAR IS NULL OR reason = $reason)
    GROUP BY form, reason
    ORDER BY tokens_lost DESC, form NULLS LAST, reason
    """,
    params=(
        QueryParam(name="since_seconds", kind=int, minimum=1, maximum=366 * 86400, description="only requests this recent (absent: all)"),
        engine_param(),
        MODEL_PARAM,
        RUN_PARAM,
        QueryParam(name="form", kind=str, description="only this limiting form"),
        QueryParam(name="reason", kind=str, description="only this reason"),
    ),
    columns=("form", "reason", "tokens_lost", "requests", "tied_requests", "tied_tokens_lost"),
)
