"""The Requests page: recent requests, searchable, and one request's story.

* **Recent requests** (``recent_requests``, filtered by the agent): those of the sidebar's time
  range, or of one chart bucket when the page was opened from a drop on the Overview (``?start=``
  and ``?end=``, unix seconds), of its engine and model, limited by its form when one is chosen,
  stopped for the URL's reason (``?reason=``, from the Forms page), and whose id contains the
  search text: prompt tokens, hash hit, resume point L*, recoverable /
  replayed / recomputed tokens, the limiting form and reason, the admission, TTFT.
* **One request** (``request_lookups``): each form's usable length as a bar against the hash hit
  and the resume point L* the request used (the shortest usable form limits it), with its
  outcome, reason and tier; the plan chosen (admission), predicted vs actual seconds, and TTFT.
  When forms tied as limiting (``limiting_forms`` holds more than one), the caption names them:
  ``Limited by swa_window (swa_evicted; tied: full_kv, swa_window).``

Times are UTC, as the agent stores them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.agent_status import agent_status_badge
from dashboard.client import AgentError
from dashboard.common import Filters, current_client, query, sidebar_filters

LIMIT = 500
COLUMNS = [
    "ts", "request_id", "limiting_form", "limiting_reason", "prompt_tokens", "hash_hit_tokens", "resume_tokens",
    "recoverable_tokens", "replayed_tokens", "recomputed_tokens", "admission", "ttft_seconds", "engine_id",
]  # fmt: skip
"""The table's columns: what limited the request comes first, so it is on screen."""


@dataclass(frozen=True, slots=True)
class Span:
    """One chart bucket, [start, end) in unix seconds, from the URL (``?start=&end=``)."""

    start: float
    end: float

    def label(self) -> str:
        return f"{utc(self.start)} – {utc(self.end)} UTC"


def utc(unix_seconds: float) -> str:
    return datetime.fromtimestamp(unix_seconds, UTC).strftime("%Y-%m-%d %H:%M:%S")


def span_from_url() -> Span | None:
    """The bucket the URL names, or None (a malformed one is reported on the page and ignored)."""
    raw = (st.query_params.get("start"), st.query_params.get("end"))
    if raw == (None, None):
        return None
    try:
        start, end = (float(v) for v in raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        st.warning(f"Ignored the URL's time span start={raw[0]!r}, end={raw[1]!r}: both must be unix seconds.")
        return None
    if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end):
        st.warning(f"Ignored the URL's time span start={raw[0]!r}, end={raw[1]!r}: start must be before end.")
        return None
    return Span(start, end)


def _clear_span() -> None:
    for key in ("start", "end"):
        if key in st.query_params:
            del st.query_params[key]


def render() -> None:
    """The page body (called by ``st.navigation``)."""
    st.title("Requests")
    client = current_client()
    agent_status_badge(client)
    filters = sidebar_filters(client)
    span = span_from_url()
    reason = st.query_params.get("reason") or None
    search = st.text_input("Search request ids", key="request_search", placeholder="part of a request id")
    params: dict[str, object] = {
        "limit": LIMIT, "engine_id": filters.engine, "model": filters.model,
        "limiting_form": filters.form, "limiting_reason": reason, "search": search or None,
    }  # fmt: skip
    if span is not None:
        params.update(start_ts=span.start, end_ts=span.end)
        st.button("Show the whole time range", key="request_clear_span", on_click=_clear_span)
    else:
        params["since_seconds"] = filters.since_seconds
    try:
        recent = query(client, "recent_requests", **params)
    except AgentError as exc:
        st.error(str(exc))
        return
    scope = describe(filters, span, search, reason)
    if recent.empty:
        st.info(f"No requests {scope}.")
        return
    st.caption(f"The latest {len(recent):,} requests {scope}, newest first.")
    st.dataframe(recent[COLUMNS], hide_index=True)
    labels = {f"{r.request_id} ({r.engine_id})": (r.request_id, r.engine_id) for r in recent.itertuples()}
    chosen = st.selectbox("Request", list(labels), key="request_chosen")
    request_id, engine_id = labels[chosen]
    row = recent[(recent["request_id"] == request_id) & (recent["engine_id"] == engine_id)].iloc[0]
    detail(client, row)


def describe(filters: Filters, span: Span | None, search: str, reason: str | None = None) -> str:
    """What the table holds, as words: ``in the last 15 minutes, limited by swa_window, ...``."""
    parts = [f"in {span.label()}" if span is not None else f"in the last {filters.window}"]
    if filters.form is not None:
        parts.append(f"limited by {filters.form}")
    if reason is not None:
        parts.append(f"stopped for {reason}")
    if search:
        parts.append(f"with {search!r} in the id")
    return ", ".join(parts)


def detail(client: object, row: pd.Series) -> None:
    """One request: its plan, timings and every form's usable length against L*."""
    st.subheader(f"Request {row['request_id']}")
    columns = st.columns(6)
    columns[0].metric("Prompt tokens", f"{int(row['prompt_tokens']):,}")
    columns[1].metric("Resume point L*", f"{int(row['resume_tokens']):,}")
    columns[2].metric("Admission", str(row["admission"]))
    predicted = float(row["predicted_seconds"])
    if predicted > 0:
        columns[3].metric("Predicted", f"{predicted:.3f} s")
    else:  # 0: the admission priced no plan (a cold prefill, or an engine that does not predict)
        columns[3].metric("Predicted", "none", help="The admission made no prediction for this request (no plan was priced).")
    columns[4].metric("Actual", f"{row['actual_seconds']:.3f} s")
    columns[5].metric("TTFT", f"{row['ttft_seconds']:.3f} s")
    st.caption(limit_caption(row))
    try:
        forms = query(client, "request_lookups", request_id=row["request_id"], engine_id=row["engine_id"])  # type: ignore[arg-type]
    except AgentError as exc:
        st.error(str(exc))
        return
    if forms.empty:
        st.info("No cache lookups were stored for this request.")
        return
    st.altair_chart(form_bars(forms, int(row["resume_tokens"])), width="stretch")
    st.dataframe(
        forms[["form", "outcome", "reason", "tier", "hash_hit_tokens", "usable_tokens", "recoverable_tokens", "replayed_tokens", "recovery_seconds"]],
        hide_index=True,
    )


def limit_caption(row: pd.Series) -> str:
    """What set the request's resume point: the limiting form and its reason, and the forms tied
    with it when ``limiting_forms`` names more than one (in the engine's order)."""
    limiting = row["limiting_form"] if isinstance(row["limiting_form"], str) else None
    if limiting is None:
        return "No form limited the resume point."
    tied = row.get("limiting_forms")  # an array of names; None or NaN: no value
    forms = [] if tied is None or isinstance(tied, float) else [str(f) for f in tied]
    ties = f"; tied: {', '.join(forms)}" if len(forms) > 1 else ""
    return f"Limited by {limiting} ({row['limiting_reason']}{ties})."


def form_bars(forms: pd.DataFrame, resume_tokens: int) -> alt.LayerChart:
    """Per form: the hash hit (light) and the usable length (dark) as bars, L* as a rule."""
    base = alt.Chart(forms).encode(y=alt.Y("form:N", sort=None, title=None))
    hash_hit = base.mark_bar(color="#c6dbef").encode(x=alt.X("hash_hit_tokens:Q", title="tokens"))
    usable = base.mark_bar(color="#2171b5", height=10).encode(
        x="usable_tokens:Q", tooltip=["form", "outcome", "reason", "usable_tokens", "hash_hit_tokens"]
    )
    resume = alt.Chart(pd.DataFrame({"L*": [resume_tokens]})).mark_rule(color="#d62728", strokeWidth=2).encode(x="L*:Q")
    return alt.LayerChart(layer=[hash_hit, usable, resume])
