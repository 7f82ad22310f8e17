"""The Requests page: recent requests, searchable, and one request's story.

* **Recent requests** (``recent_requests``, narrowed by the sidebar's engine and model and by a
  search over request ids): prompt tokens, hash hit, resume point L*, recoverable / replayed /
  recomputed tokens, the limiting form and reason, the admission, TTFT.
* **One request** (``request_lookups``): each form's usable length as a bar against the hash hit
  and the resume point L* the request used (the shortest usable form limits it), with its
  outcome, reason and tier; the plan chosen (admission), predicted vs actual seconds, and TTFT.
"""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.client import AgentError
from dashboard.common import current_client, query, sidebar_filters

LIMIT = 500
COLUMNS = [
    "ts", "engine_id", "request_id", "prompt_tokens", "hash_hit_tokens", "resume_tokens", "recoverable_tokens",
    "replayed_tokens", "recomputed_tokens", "limiting_form", "limiting_reason", "admission", "ttft_seconds",
]  # fmt: skip


def render() -> None:
    """The page body (called by ``st.navigation``)."""
    st.title("Requests")
    client = current_client()
    filters = sidebar_filters(client)
    try:
        recent = query(client, "recent_requests", limit=LIMIT, engine_id=filters.engine, model=filters.model)
    except AgentError as exc:
        st.error(str(exc))
        return
    search = st.text_input("Search request ids", key="request_search", placeholder="part of a request id")
    if search:
        recent = recent[recent["request_id"].str.contains(search, regex=False)]
    if recent.empty:
        st.info("No requests match." if search else "No requests stored yet.")
        return
    st.caption(f"The latest {len(recent):,} requests, newest first.")
    st.dataframe(recent[COLUMNS], hide_index=True)
    labels = {f"{r.request_id} ({r.engine_id})": (r.request_id, r.engine_id) for r in recent.itertuples()}
    chosen = st.selectbox("Request", list(labels), key="request_chosen")
    request_id, engine_id = labels[chosen]
    row = recent[(recent["request_id"] == request_id) & (recent["engine_id"] == engine_id)].iloc[0]
    detail(client, row)


def detail(client: object, row: pd.Series) -> None:
    """One request: its plan, timings and every form's usable length against L*."""
    st.subheader(f"Request {row['request_id']}")
    columns = st.columns(6)
    columns[0].metric("Prompt tokens", f"{int(row['prompt_tokens']):,}")
    columns[1].metric("Resume point L*", f"{int(row['resume_tokens']):,}")
    columns[2].metric("Admission", str(row["admission"]))
    columns[3].metric("Predicted", f"{row['predicted_seconds']:.3f} s")
    columns[4].metric("Actual", f"{row['actual_seconds']:.3f} s")
    columns[5].metric("TTFT", f"{row['ttft_seconds']:.3f} s")
    limiting = row["limiting_form"] if isinstance(row["limiting_form"], str) else None
    st.caption(
        f"Limited by {limiting} ({row['limiting_reason']})." if limiting else "No form limited the resume point."
    )
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


def form_bars(forms: pd.DataFrame, resume_tokens: int) -> alt.LayerChart:
    """Per form: the hash hit (light) and the usable length (dark) as bars, L* as a rule."""
    base = alt.Chart(forms).encode(y=alt.Y("form:N", sort=None, title=None))
    hash_hit = base.mark_bar(color="#c6dbef").encode(x=alt.X("hash_hit_tokens:Q", title="tokens"))
    usable = base.mark_bar(color="#2171b5", height=10).encode(
        x="usable_tokens:Q", tooltip=["form", "outcome", "reason", "usable_tokens", "hash_hit_tokens"]
    )
    resume = alt.Chart(pd.DataFrame({"L*": [resume_tokens]})).mark_rule(color="#d62728", strokeWidth=2).encode(x="L*:Q")
    return alt.LayerChart(layer=[hash_hit, usable, resume])
