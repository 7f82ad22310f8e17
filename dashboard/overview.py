"""The Overview page: is the cache saving what it seems to save?

Panels (all from the agent's named queries, refreshed every :data:`REFRESH_SECONDS` inside one
``st.fragment``; each query is cached for :data:`CACHE_TTL_SECONDS`):

* the headline: recoverable and raw hit rate over a trailing window (``headline``; 5 minutes
  unless chosen) with the change from the window before, in percentage points — below
  :data:`MIN_HEADLINE_PROMPT_TOKENS` prompt tokens it says "not enough traffic" and the volume
  it saw, never 0 %;
* recoverable vs raw hit rate over time (``hit_rate_timeseries``) — the gap is what hybrid
  caches lose between "hash hit" and "actually reused" — and a link to the requests of the bucket
  with the widest raw − recoverable gap (the Requests page, narrowed to that bucket);
* prompt tokens split into recoverable / replayed / recomputed per bucket;
* each form's usable rate over time (``form_usable_timeseries``): which form explains the gap;
* tokens lost by the form that limited the resume point and its reason over the time range
  (``tokens_lost``; a tie counts under every tied form, drawn lighter), and a link to the Forms
  page on the form that lost most tokens and its reason (:mod:`dashboard.losses`);
* a banner while alerts fire (``GET /v1/alerts``), each alert naming a form linking to the
  Forms page on that form and reason, and ingest health: the agent's ``/readyz``
  status when it is degraded (each condition's reason and detail: a quarantined WAL, say) or not
  ready (why: a full disk, say) — shown even before any request arrived — and, from
  ``ingest_health``, events per second, p95 ingest lag, batches rejected and seq gaps.

Lines are broken where a bucket has no data, every form, outcome and series keeps one colour on
every page (:mod:`dashboard.palette`), and time axes read 24-hour UTC.

Under the title, as on every page, the "stale since" badge while the agent does not answer
(:mod:`dashboard.agent_status`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.agent_status import agent_status_badge, check_agent, readiness_notice
from dashboard.client import AgentClient, AgentError
from dashboard.common import (
    REFRESH_SECONDS,
    Filters,
    current_client,
    query,
    requests_link,
    sidebar_filters,
    stacked_bars,
    time_tooltip,
    time_x,
    unix_seconds,
    utc_times,
    with_gaps,
)
from dashboard.losses import losses_chart, most_lost
from dashboard.palette import color, reason_label

HEADLINE_WINDOWS = {"1 minute": 60, "5 minutes": 300, "15 minutes": 900}
"""The headline's trailing windows (the first choice shown is 5 minutes)."""

MIN_HEADLINE_PROMPT_TOKENS = 1000
"""Below this many prompt tokens in the headline's window a rate is noise: "not enough traffic"."""


def _percent(ratio: float | None) -> str:
    return "n/a" if ratio is None or math.isnan(ratio) else f"{ratio:.1%}"


def _delta_pp(current: float | None, previous: float | None) -> str | None:
    if current is None or previous is None or math.isnan(current) or math.isnan(previous):
        return None
    return f"{(current - previous) * 100:+.1f} pp"


def render() -> None:
    """The page body (called by ``st.navigation``)."""
    st.title("Overview")
    st.caption(
        "Recoverable hit rate = prompt tokens served from cache with no recomputation / prompt "
        "tokens; raw hit rate = hash-hit tokens / prompt tokens. Ratios of token sums per bucket."
    )
    client = current_client()
    agent_status_badge(client)
    filters = sidebar_filters(client)
    choice = st.selectbox("Headline over the last", list(HEADLINE_WINDOWS), index=1, key="overview_headline")
    live_panels(client, filters, HEADLINE_WINDOWS[choice or "5 minutes"])


@st.fragment(run_every=REFRESH_SECONDS)
def live_panels(client: AgentClient, filters: Filters, headline_seconds: int = 300) -> None:
    """The live part of the page; reruns on its own every :data:`REFRESH_SECONDS`."""
    try:
        rates = query(client, "hit_rate_timeseries", **filters.params())
        forms = query(client, "form_usable_timeseries", **filters.params())
        headline = query(client, "headline", window_seconds=headline_seconds, engine_id=filters.engine, model=filters.model)
    except AgentError as exc:
        st.error(str(exc))
        return
    _alert_banner(client, filters)
    if rates.empty:
        readiness_notice(check_agent(client))
        st.info(f"No requests in this window yet (agent at {client.base_url}).")
        return
    _headline(headline, headline_seconds)
    rates = rates.set_index("bucket")
    st.subheader("Recoverable vs raw hit rate")
    st.altair_chart(
        _lines(
            rates[["recoverable_hit_rate", "raw_hit_rate"]].rename(
                columns={"recoverable_hit_rate": "recoverable", "raw_hit_rate": "raw"}
            ),
            "series",
            "rate",
            filters.bucket_seconds,
        ),
        width="stretch",
    )
    _widest_gap_link(rates, filters)
    st.subheader("Prompt tokens: recoverable / replayed / recomputed")
    tokens = rates[["recoverable_tokens", "replayed_tokens", "recomputed_tokens"]].rename(columns=lambda c: c.removesuffix("_tokens"))
    st.altair_chart(stacked_bars(tokens, "part", "prompt tokens", kind="series"), width="stretch")
    st.subheader("Usable rate per form")
    if filters.form is not None:
        forms = forms[forms["form"] == filters.form]
    if forms.empty:
        st.info("No cache lookups in this window yet.")
    else:
        usable = forms.pivot(index="bucket", columns="form", values="usable_rate")
        st.altair_chart(_lines(usable, "form", "usable rate", filters.bucket_seconds, kind="form"), width="stretch")
    _losses(client, filters)
    _ingest_health(client, filters)


def widest_gap_bucket(rates: pd.DataFrame) -> tuple[pd.Timestamp, float, float] | None:
    """The bucket (index of ``rates``) with the widest raw − recoverable hit-rate gap among those
    with prompt tokens, and its raw and recoverable rates; the latest such bucket on a tie; None
    when no bucket has a rate."""
    gap = (rates["raw_hit_rate"] - rates["recoverable_hit_rate"]).dropna()
    if gap.empty:
        return None
    widest = gap[gap == gap.max()].index.max()
    return widest, float(rates.loc[widest, "raw_hit_rate"]), float(rates.loc[widest, "recoverable_hit_rate"])


def _widest_gap_link(rates: pd.DataFrame, filters: Filters) -> None:
    found = widest_gap_bucket(rates)
    if found is None:
        return
    bucket, raw, recoverable = found
    end = unix_seconds(bucket) + filters.bucket_seconds
    start = max(unix_seconds(bucket), time.time() - filters.since_seconds)  # the window's first bucket is partial
    requests_link(
        filters,
        f"The requests behind the widest raw − recoverable gap: {pd.Timestamp(start, unit='s'):%H:%M:%S}–{pd.Timestamp(end, unit='s'):%H:%M:%S} UTC, "
        f"{raw:.1%} raw, {recoverable:.1%} recoverable",
        start=start,
        end=end,
    )


def _alert_banner(client: AgentClient, filters: Filters) -> None:
    """While alerts fire: how many and which, each linking to the Forms page on the form and
    reason it names (an alert naming none, such as a hit-rate drop, opens the page on its engine,
    where the form that lost most tokens is shown first)."""
    from dashboard.pages import page

    try:
        alerts = client.active_alerts()
    except AgentError:
        return  # an agent without a rule scheduler: no banner (the Alerts page explains)
    firing = [a for a in alerts if a["state"] == "firing"]
    if not firing:
        return
    st.error(f"{len(firing)} alert(s) firing: {', '.join(sorted({a['alertname'] for a in firing}))} — see the Alerts page.")
    for key in sorted({_alert_target(a) for a in firing}):
        name, engine, form, reason = key
        where = " — ".join(p for p in (form, reason_label(reason) if reason else None) if p) or "the form that lost most tokens"
        params = {"window": filters.window, "engine": engine, "form": form, "reason": reason}
        st.page_link(
            page("forms"),
            label=f"{name}{f' on {engine}' if engine else ''}: open Forms on {where}",
            icon=":material/notifications_active:",
            query_params={k: v for k, v in params.items() if v},
        )


def _alert_target(alert: dict[str, Any]) -> tuple[str, str | None, str | None, str | None]:
    labels = alert.get("labels") or {}
    reason = labels.get("reason") or ("tp_disagree" if alert.get("alertname") == "TensorParallelRankDisagreement" else None)
    return str(alert["alertname"]), labels.get("engine"), labels.get("form"), reason


def _losses(client: AgentClient, filters: Filters) -> None:
    from dashboard.pages import page

    st.subheader("Tokens lost by limiting form and reason")
    try:
        table = query(client, "tokens_lost", since_seconds=filters.since_seconds, engine_id=filters.engine, model=filters.model)
    except AgentError as exc:
        st.error(str(exc))
        return
    if filters.form is not None and not table.empty:
        table = table[table["form"] == filters.form]
    if table.empty:
        st.caption("No request lost a hash-hit token in this window.")
        return
    st.caption(
        "Hash-hit tokens that were recomputed or replayed, charged to the form that set the resume "
        "point with its reason; a request whose forms tied counts under each tied form (lighter)."
    )
    st.altair_chart(losses_chart(table), width="stretch")
    top = most_lost(table)
    if top is None:
        return
    st.page_link(
        page("forms"),
        label=f"Most tokens lost: {top.form} — {reason_label(top.reason)}, {top.reason_tokens:,} of {top.form_tokens:,} tokens",
        icon=":material/troubleshoot:",
        query_params=_forms_params(filters, top.form, top.reason),
    )


def _forms_params(filters: Filters, form: str, reason: str | None) -> dict[str, str]:
    params = {"window": filters.window, "engine": filters.engine, "model": filters.model, "form": form, "reason": reason}
    return {k: v for k, v in params.items() if v is not None}


def _ingest_health(client: AgentClient, filters: Filters) -> None:
    st.subheader("Ingest health")
    readiness_notice(check_agent(client))
    try:
        health = query(client, "ingest_health", since_seconds=filters.since_seconds, bucket_seconds=filters.bucket_seconds, engine_id=filters.engine)
    except AgentError as exc:
        st.error(str(exc))
        return
    if health.empty:
        st.caption("No batches received in this window.")
        return
    seconds = max(filters.bucket_seconds, 1)
    # the latest *finished* bucket, and only if it is recent: an old one would show a stale rate
    newest_finished = pd.Timestamp.now(tz="UTC").tz_localize(None).floor(f"{seconds}s") - pd.Timedelta(seconds=seconds)
    recent = health[health["bucket"] == newest_finished]
    events = int(recent["events"].sum()) if not recent.empty else 0
    columns = st.columns(4)
    columns[0].metric("Events/s (last full bucket)", f"{events / seconds:,.1f}")
    lag = recent["lag_p95_seconds"].iloc[0] if not recent.empty else float("nan")
    columns[1].metric("Ingest lag p95 (last full bucket)", "n/a" if pd.isna(lag) else f"{lag:.2f} s")
    columns[2].metric("Batches rejected", f"{int(health['rejected_batches'].sum()):,}")
    columns[3].metric("Seq gaps detected", f"{int(health['missing_batches'].sum()):,}")


def _lines(wide: pd.DataFrame, series: str, value: str, bucket_seconds: float, *, kind: str = "series") -> alt.Chart:
    """A line chart with a point per bucket (a single bucket still shows), rates in [0, 1],
    broken where a bucket has no value (:func:`dashboard.common.with_gaps`), each series in its
    fixed colour (:func:`dashboard.palette.color` of ``kind``)."""
    x = wide.index.name or "index"
    long = with_gaps(wide.reset_index().melt(id_vars=x, var_name=series, value_name=value), x, series, value, bucket_seconds)
    return (
        alt.Chart(utc_times(long, x))
        .mark_line(point=True)
        .encode(
            x=time_x(x),
            y=alt.Y(f"{value}:Q", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%")),
            color=color(series, kind, wide.columns),
            detail="segment:N",
            tooltip=[time_tooltip(x), f"{series}:N", alt.Tooltip(f"{value}:Q", format=".1%")],
        )
    )


def _headline(headline: pd.DataFrame, window_seconds: int) -> None:
    """Recoverable and raw hit rate over the trailing window, and the change from the window
    before, both only with at least :data:`MIN_HEADLINE_PROMPT_TOKENS` prompt tokens."""
    row = headline.iloc[0] if not headline.empty else None
    label = next(name for name, seconds in HEADLINE_WINDOWS.items() if seconds == window_seconds)

    def rates(prefix: str) -> tuple[float, float] | None:
        if row is None or int(row[f"{prefix}prompt_tokens"]) < MIN_HEADLINE_PROMPT_TOKENS:
            return None
        prompt = int(row[f"{prefix}prompt_tokens"])
        return int(row[f"{prefix}recoverable_tokens"]) / prompt, int(row[f"{prefix}hash_hit_tokens"]) / prompt

    now, before = rates(""), rates("previous_")
    prompt = 0 if row is None else int(row["prompt_tokens"])
    columns = st.columns(4)
    if now is None:
        columns[0].metric("Recoverable hit rate", "not enough traffic")
        columns[1].metric("Raw hit rate", "not enough traffic")
        columns[2].metric("Raw − recoverable", "n/a")
        st.caption(f"{prompt:,} prompt tokens in the last {label}; the headline needs {MIN_HEADLINE_PROMPT_TOKENS:,}.")
    else:
        columns[0].metric("Recoverable hit rate", _percent(now[0]), _delta_pp(now[0], before[0] if before else None))
        columns[1].metric("Raw hit rate", _percent(now[1]), _delta_pp(now[1], before[1] if before else None))
        columns[2].metric("Raw − recoverable", _percent(now[1] - now[0]))
    columns[3].metric(f"Prompt tokens (last {label})", f"{prompt:,}")
