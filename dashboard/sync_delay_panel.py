"""The Forms page's indexer sync-delay panel (issue 23): how far the CSA indexer's state trailed
the main compressed KV boundary where lookups met it, per time bucket and layer group, from the
``indexer_sync_delay`` named query.

Only ``indexer_state`` lookups carry the delay, so the panel shows only for that form. A healthy
engine reports 0 everywhere: the panel then says "in sync" and draws nothing. Otherwise: the
share of lookups that met a trailing index, the max and p95 delay in tokens per bucket (one line
per layer group), and the seconds since that state last matched.
"""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.client import AgentClient, AgentError
from dashboard.common import Filters, query, time_tooltip, time_x, utc_times

FORM = "indexer_state"


def sync_delay_panel(client: AgentClient, filters: Filters, *, form: str | None = None) -> None:
    """Render the panel for ``form`` (default: the sidebar's; nothing for another form than
    ``indexer_state``) over ``filters``' window, engine and model. A failing query is shown as
    an error in the panel (never raised)."""
    if (form or filters.form) not in (None, FORM):
        return
    st.subheader("Indexer sync delay")
    try:
        rows = query(client, "indexer_sync_delay", **filters.params())
    except AgentError as exc:
        st.error(str(exc))
        return
    if rows.empty:
        st.caption("No indexer_state lookups in this window (the model has no CSA indexer, or no traffic).")
        return
    lookups, trailing = int(rows["lookups"].sum()), int(rows["trailing_lookups"].sum())
    if trailing == 0:
        st.success(f"In sync: none of {lookups} indexer_state lookups found the indexer behind the compressed KV boundary.")
        return
    st.caption(
        "Tokens the indexer's keys trailed the main compressed KV boundary where lookups met them, "
        "and seconds since they last matched (0 in a healthy engine; the lag_index fault, or a stale "
        "slot replaced late, makes it non-zero)."
    )
    st.metric("Lookups that met a trailing index", f"{trailing / lookups:.1%}", help=f"{trailing} of {lookups}")
    for unit, title in (("tokens", "delay (tokens)"), ("seconds", "seconds since in sync")):
        st.altair_chart(delay_chart(rows, unit, title), width="stretch")


def delay_chart(rows: pd.DataFrame, unit: str, title: str) -> alt.Chart:
    """Lines of the max and p95 delay in ``unit`` (``tokens`` or ``seconds``) per bucket, one
    colour per statistic, one line per layer group."""
    long = rows.melt(
        id_vars=["bucket", "layer_group"],
        value_vars=[f"max_delay_{unit}", f"p95_delay_{unit}"],
        var_name="statistic",
        value_name=unit,
    )
    long["statistic"] = long["statistic"].str.removesuffix(f"_delay_{unit}")
    long["layer_group"] = long["layer_group"].astype(str)
    return (
        alt.Chart(utc_times(long))
        .mark_line(point=True)
        .encode(
            x=time_x(),
            y=alt.Y(f"{unit}:Q", title=title),
            color=alt.Color("statistic:N"),
            detail="layer_group:N",
            tooltip=[time_tooltip(), "layer_group:N", "statistic:N", f"{unit}:Q"],
        )
    )
