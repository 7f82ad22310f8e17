"""The SQL page: ad-hoc read-only SQL over the cache logs, through the agent's ``POST /v1/sql``
sandbox (one SELECT, no files, a read-only transaction, a row cap and a time limit).

The schema (the ``schema`` named query) is shown beside the editor; saved examples fill the
editor; a result shows as a table and, when it has a numeric column, as a chart of one column
against another; it downloads as CSV. A refused or failing query shows the agent's reason.
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import streamlit as st

from dashboard.agent_status import agent_status_badge
from dashboard.client import AgentClient, AgentError
from dashboard.common import current_client, query

EXAMPLES: dict[str, str] = {
    "Recoverable hit rate per engine, last hour": """SELECT engine_id, model,
       sum(recoverable_tokens) / sum(prompt_tokens) AS recoverable_hit_rate,
       sum(hash_hit_tokens) / sum(prompt_tokens) AS raw_hit_rate,
       count(*) AS requests
FROM requests
WHERE ts >= (now() AT TIME ZONE 'UTC') - INTERVAL 1 HOUR
GROUP BY ALL ORDER BY requests DESC""",
    "Why forms were not reusable (top reasons)": """SELECT form, reason, count(*) AS lookups
FROM cache_lookups
WHERE outcome <> 'hit'
GROUP BY ALL ORDER BY lookups DESC LIMIT 20""",
    "Which form limited the resume point": """SELECT coalesce(limiting_form, 'none') AS limiting_form, limiting_reason, count(*) AS requests
FROM requests GROUP BY ALL ORDER BY requests DESC""",
    "Resume points set by a tie of forms": """SELECT limiting_form, limiting_forms, limiting_reason, count(*) AS requests
FROM requests WHERE len(limiting_forms) > 1
GROUP BY ALL ORDER BY requests DESC""",
    "Recoverable tokens per minute": """SELECT time_bucket(INTERVAL 1 MINUTE, ts) AS minute,
       sum(recoverable_tokens) AS recoverable_tokens, sum(prompt_tokens) AS prompt_tokens
FROM requests GROUP BY ALL ORDER BY minute""",
    "Recovery latency per form and tier (p50, p95)": """SELECT form, tier, count(*) AS recoveries,
       quantile_cont(recovery_seconds, 0.5) AS p50_seconds, quantile_cont(recovery_seconds, 0.95) AS p95_seconds
FROM cache_lookups WHERE outcome IN ('recovered', 'replayed')
GROUP BY ALL ORDER BY p95_seconds DESC""",
    "Alert history": """SELECT ts, alert, state, event, receiver, value, summary
FROM alerts ORDER BY ts DESC LIMIT 100""",
    "Losses more memory would have saved (MiB needed)": """SELECT form, reason, count(*) AS lost_lookups, count(ghost_bytes) AS saved_by_memory,
       quantile_cont(ghost_bytes, 0.9) / 2^20 AS mib_for_90_percent
FROM cache_lookups WHERE outcome = 'invalidated'
GROUP BY ALL ORDER BY lost_lookups DESC""",
}
EDITOR_KEY = "sql_text"
RESULT_KEY = "sql_result"


def render() -> None:
    """The page body (called by ``st.navigation``)."""
    st.title("SQL")
    st.caption(
        "Read-only SQL over the agent's DuckDB store: one SELECT at a time, no file access, "
        "rows capped and a time limit. Tables and columns are listed on the right."
    )
    client = current_client()
    agent_status_badge(client)
    if EDITOR_KEY not in st.session_state:
        st.session_state[EDITOR_KEY] = next(iter(EXAMPLES.values()))
    editor, schema = st.columns([3, 1])
    with schema:
        schema_panel(client)
    with editor:
        st.selectbox("Examples", list(EXAMPLES), key="sql_example", on_change=_use_example)
        st.text_area("Query", key=EDITOR_KEY, height=180)
        if st.button("Run", type="primary"):
            st.session_state[RESULT_KEY] = run(client, st.session_state[EDITOR_KEY])
    outcome = st.session_state.get(RESULT_KEY)
    if isinstance(outcome, str):
        st.error(outcome)
    elif isinstance(outcome, tuple):
        show(*outcome)


def _use_example() -> None:
    st.session_state[EDITOR_KEY] = EXAMPLES[st.session_state["sql_example"]]
    st.session_state.pop(RESULT_KEY, None)


def run(client: AgentClient, sql: str) -> tuple[pd.DataFrame, bool] | str:
    """The result (and whether rows were cut at the cap), or the reason it failed."""
    try:
        response = client.sql(sql, fmt="arrow")
        table = pa.ipc.open_stream(response.content).read_all()
    except AgentError as exc:
        return f"The query failed: {exc}"
    except pa.ArrowInvalid as exc:
        return f"The agent sent an unreadable answer: {exc}"
    return table.rename_columns(unique_names(table.column_names)).to_pandas(), response.headers.get("x-kvscope-truncated") == "true"


def unique_names(names: list[str]) -> list[str]:
    """Column names made unique for display (a join can repeat one: ``ts``, ``ts_1``, ...)."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append(name if n == 0 else f"{name}_{n}")
    return out


def show(frame: pd.DataFrame, truncated: bool) -> None:
    st.subheader("Result")
    st.caption(f"{len(frame):,} rows" + (" (cut at the agent's row limit)" if truncated else ""))
    st.dataframe(frame, hide_index=True)
    st.download_button("Download CSV", frame.to_csv(index=False).encode(), file_name="kvscope-query.csv", mime="text/csv")
    numeric = [c for c in frame.columns if pd.api.types.is_numeric_dtype(frame[c]) and not pd.api.types.is_bool_dtype(frame[c])]
    if frame.empty or not numeric or len(frame.columns) < 2:
        return
    x = st.selectbox("Chart: x", list(frame.columns), key="sql_chart_x")
    ys = [c for c in numeric if c != x]
    if not ys:
        return
    y = st.selectbox("Chart: y", ys, key="sql_chart_y")
    chart = frame[[x, y]].dropna().set_index(x)
    if pd.api.types.is_datetime64_any_dtype(frame[x]) or pd.api.types.is_numeric_dtype(frame[x]):
        st.line_chart(chart)
    else:
        st.bar_chart(chart)


def schema_panel(client: AgentClient) -> None:
    st.markdown("**Schema**")
    try:
        columns = query(client, "schema")
    except AgentError as exc:
        st.error(str(exc))
        return
    for table, group in columns.groupby("table_name", sort=True):
        with st.expander(str(table)):
            st.markdown("\n".join(f"- `{c}` {t.lower()}" for c, t in zip(group["column_name"], group["data_type"], strict=True)))
