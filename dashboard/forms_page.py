"""The Forms page: one form's story — the sidebar's form, else the one chosen here, which opens on
the form that lost most tokens in the window (``tokens_lost``: :func:`dashboard.losses.most_lost`).

* the reasons it lost tokens as the limiting form, ranked by tokens lost (``tokens_lost``; ties
  counted for every tied form, their part named) with readable labels, as a Pareto chart (bars,
  and the cumulative share); the reason a link or an alert named (``?reason=``) is marked, with a
  link to the requests it limited;

From the ``cache_minute`` rollup (``form_timeseries``, whole minutes) and ``limiting_forms``:

* outcomes over time (hit, recovered, replayed, invalidated, miss) — lookups per bucket, each
  outcome in its colour on every page (:mod:`dashboard.palette`), with the lookups not reused per
  reason below it;
* recovery latency p50 / p95 / p99 over time, estimated from the cumulative latency buckets as
  Prometheus's ``histogram_quantile`` does (:func:`alerts.rule_eval.histogram_quantile`), and the
  same buckets as a heatmap (recoveries per latency band per time bucket);
* the tier split (device / host / disk): lookups and recoverable tokens;
* how often this form set the resume point L* (its share of requests, per bucket);
* tensor-parallel rank disagreements (``rank_disagreements``): for this form, which rank held
  it back (``tp_disagree``), how often and how many tokens it cost — shown only when some did;
* for ``indexer_state``, the indexer's sync delay per layer group (:mod:`dashboard.sync_delay_panel`).
"""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from agent.ingest import RECOVERING_OUTCOMES, RECOVERY_BUCKETS
from agent.migrations import bucket_column
from alerts.rule_eval import histogram_quantile
from dashboard.agent_status import agent_status_badge
from dashboard.client import AgentError
from dashboard.common import (
    FORMS,
    Filters,
    current_client,
    query,
    requests_link,
    sidebar_filters,
    stacked_bars,
    time_tooltip,
    time_x,
    utc_times,
    with_gaps,
)
from dashboard.losses import most_lost, reason_ranking
from dashboard.palette import color, reason_label
from dashboard.sync_delay_panel import sync_delay_panel

LE_COLUMNS = [bucket_column(b) for b in RECOVERY_BUCKETS]
QUANTILES = (0.5, 0.95, 0.99)


def render() -> None:
    """The page body (called by ``st.navigation``)."""
    st.title("Forms")
    client = current_client()
    agent_status_badge(client)
    filters = sidebar_filters(client)
    window = {k: v for k, v in filters.params().items() if k != "bucket_seconds"}
    try:
        lost = query(client, "tokens_lost", **window)
    except AgentError as exc:
        st.error(str(exc))
        return
    top = most_lost(lost)
    if filters.form:
        form = filters.form
        st.caption(f"Form {form} (set in the sidebar).")
    else:
        default = FORMS.index(top.form) if top is not None and top.form in FORMS else 0
        form = st.selectbox("Form", list(FORMS), index=default, key="forms_form")
        if top is not None:
            st.caption(f"Opened on {top.form}: it lost most tokens in this window ({top.form_tokens:,}).")
    params = {**filters.params(), "bucket_seconds": max(filters.bucket_seconds, 60)}
    try:
        rows = query(client, "form_timeseries", form=form, **params)
        limiting = query(client, "limiting_forms", **filters.params())
        ranks = query(client, "rank_disagreements", **window)
    except AgentError as exc:
        st.error(str(exc))
        return
    reasons_panel(lost, form, st.query_params.get("reason"), filters)
    if rows.empty:
        st.info(f"No {form} lookups in this window yet (the rollup folds them every few seconds).")
        return
    outcomes_panel(rows)
    latency_panel(rows, max(filters.bucket_seconds, 60))
    tiers_panel(rows)
    limiting_panel(limiting, form, filters.bucket_seconds)
    ranks_panel(ranks, form)
    sync_delay_panel(client, filters, form=form)
    requests_link(filters, f"The requests {form} limited in this window", form=form)


def outcomes_panel(rows: pd.DataFrame) -> None:
    st.subheader("Outcomes over time")
    wide = rows.groupby(["bucket", "outcome"])["lookups"].sum().unstack(fill_value=0)
    st.altair_chart(stacked_bars(wide, "outcome", "lookups", kind="outcome"), width="stretch")
    not_reused = pareto(rows)
    if not not_reused.empty:
        st.caption("Lookups not reused, per reason (a lookup per layer group and rank):")
        st.dataframe(not_reused.assign(reason=not_reused["reason"].map(reason_label)), hide_index=True)


NOT_REUSED = ("invalidated",)


def pareto(rows: pd.DataFrame) -> pd.DataFrame:
    """Lookups per reason the form was invalidated (a hash hit it could not reuse; misses are cold
    prompts, not the form's fault, and recoveries are reuse at a cost, on the latency panel), most
    first, with each reason's share and the cumulative share."""
    missed = rows[rows["outcome"].isin(NOT_REUSED)]
    table = missed.groupby("reason", as_index=False)["lookups"].sum().sort_values(["lookups", "reason"], ascending=[False, True])
    total = table["lookups"].sum()
    table["share"] = table["lookups"] / total if total else 0.0
    table["cumulative_share"] = table["share"].cumsum()
    return table.reset_index(drop=True)


def reasons_panel(lost: pd.DataFrame, form: str, marked: str | None, filters: Filters) -> None:
    """Why ``form`` lost tokens as the limiting form, most tokens first; ``marked`` (a link's or
    an alert's reason) is named above the chart and linked to its requests."""
    st.subheader("Why it lost tokens")
    table = reason_ranking(lost, form)
    if table.empty:
        st.success(f"{form} limited no request that lost a hash-hit token in this window.")
        return
    shown: str = marked if marked is not None and marked in set(table["reason"]) else str(table["reason"].iloc[0])
    row = table[table["reason"] == shown].iloc[0]
    tied = f", {int(row['tied_requests'])} of them tied with another form" if int(row["tied_requests"]) else ""
    st.markdown(f"**{form} — {reason_label(shown)}**: {int(row['tokens_lost']):,} tokens lost over {int(row['requests'])} requests{tied}.")
    if marked and marked != shown:
        st.caption(f"{form} lost no tokens for {reason_label(marked)} in this window.")
    order = table["label"].tolist()
    bars = (
        alt.Chart(table)
        .mark_bar()
        .encode(
            y=alt.Y("label:N", sort=order, title=None, axis=alt.Axis(labelLimit=400)),
            x=alt.X("tokens_lost:Q", title="tokens lost"),
            color=alt.condition(alt.datum.reason == shown, alt.value("#d62728"), alt.value("#1f77b4")),
            tooltip=["label:N", "tokens_lost:Q", "requests:Q", "tied_requests:Q"],
        )
    )
    line = (
        alt.Chart(table)
        .mark_line(point=True, color="#7f7f7f")
        .encode(y=alt.Y("label:N", sort=order), x=alt.X("cumulative_share:Q", axis=alt.Axis(format="%"), scale=alt.Scale(domain=[0, 1]), title="cumulative share"))
    )
    st.altair_chart(alt.LayerChart(layer=[bars, line]).resolve_scale(x="independent"), width="stretch")
    st.dataframe(table, hide_index=True)
    requests_link(filters, f"The requests {form} limited for {reason_label(shown)}", form=form, reason=shown)


def latency_quantiles(rows: pd.DataFrame) -> pd.DataFrame:
    """Per bucket: recoveries and the p50/p95/p99 recovery seconds (NaN without recoveries)."""
    recovering = rows[rows["outcome"].isin(RECOVERING_OUTCOMES)]
    per_bucket = recovering.groupby("bucket")[["lookups", *LE_COLUMNS]].sum()
    out = []
    for bucket, r in per_bucket.iterrows():
        cumulative = [int(r[c]) for c in LE_COLUMNS] + [int(r["lookups"])]
        out.append(
            {
                "bucket": bucket,
                "recoveries": int(r["lookups"]),
                **{f"p{round(q * 100)}": histogram_quantile(q, RECOVERY_BUCKETS, cumulative) for q in QUANTILES},
            }
        )
    return pd.DataFrame(out, columns=["bucket", "recoveries", *(f"p{round(q * 100)}" for q in QUANTILES)])


def latency_heatmap(rows: pd.DataFrame) -> pd.DataFrame:
    """Per bucket and latency band (``≤ bound``, and ``> last bound``): recoveries in it."""
    recovering = rows[rows["outcome"].isin(RECOVERING_OUTCOMES)]
    per_bucket = recovering.groupby("bucket")[["lookups", *LE_COLUMNS]].sum()
    cells = []
    for bucket, r in per_bucket.iterrows():
        below = 0
        for bound, column in zip(RECOVERY_BUCKETS, LE_COLUMNS, strict=True):
            cells.append({"bucket": bucket, "band": f"≤ {bound:g} s", "recoveries": int(r[column]) - below})
            below = int(r[column])
        cells.append({"bucket": bucket, "band": f"> {RECOVERY_BUCKETS[-1]:g} s", "recoveries": int(r["lookups"]) - below})
    return pd.DataFrame(cells, columns=["bucket", "band", "recoveries"])


def latency_panel(rows: pd.DataFrame, bucket_seconds: float) -> None:
    st.subheader("Recovery latency")
    quantiles = latency_quantiles(rows)
    if quantiles.empty:
        st.caption("No recoveries (swap-ins or replays) of this form in the window.")
        return
    long = quantiles.melt(id_vars=["bucket"], value_vars=["p50", "p95", "p99"], var_name="quantile", value_name="seconds")
    long = with_gaps(long, "bucket", "quantile", "seconds", bucket_seconds)
    st.altair_chart(
        alt.Chart(utc_times(long)).mark_line(point=True).encode(x=time_x(), y="seconds:Q", color=color("quantile", "series", ["p50", "p95", "p99"]), detail="segment:N"),
        width="stretch",
    )
    bands = [f"≤ {b:g} s" for b in RECOVERY_BUCKETS] + [f"> {RECOVERY_BUCKETS[-1]:g} s"]
    st.altair_chart(
        alt.Chart(utc_times(latency_heatmap(rows)))
        .mark_rect()
        .encode(
            x=time_x(),
            y=alt.Y("band:O", sort=bands[::-1], title="recovery latency"),
            color=alt.Color("recoveries:Q"),
            tooltip=[time_tooltip(), "band:O", "recoveries:Q"],
        ),
        width="stretch",
    )


def tiers_panel(rows: pd.DataFrame) -> None:
    st.subheader("Tier split")
    tiers = rows.groupby("tier", as_index=False)[["lookups", "recoverable_tokens"]].sum()
    tiers["share_of_lookups"] = tiers["lookups"] / tiers["lookups"].sum()
    st.dataframe(tiers, hide_index=True)


def limiting_panel(limiting: pd.DataFrame, form: str, bucket_seconds: float) -> None:
    st.subheader(f"How often {form} set L*")
    if limiting.empty:
        st.caption("No requests in this window.")
        return
    totals = limiting.groupby("bucket")["requests"].sum()
    mine = limiting[limiting["limiting_form"] == form].groupby("bucket")["requests"].sum()
    share = with_gaps((mine.reindex(totals.index, fill_value=0) / totals).rename("share").reset_index(), "bucket", None, "share", bucket_seconds)
    overall = float(mine.sum() / totals.sum())
    st.metric("Share of requests it limited", f"{overall:.1%}")
    st.caption("A request whose forms tied counts once here, under the form named first; the reasons above count it for each.")
    st.altair_chart(
        alt.Chart(utc_times(share)).mark_line(point=True).encode(x=time_x(), y=alt.Y("share:Q", axis=alt.Axis(format="%")), detail="segment:N"),
        width="stretch",
    )


def ranks_panel(ranks: pd.DataFrame, form: str) -> None:
    """Which tensor-parallel rank held ``form`` back (nothing when no rank did)."""
    mine = ranks[ranks["form"] == form] if not ranks.empty else ranks
    if mine.empty:
        return
    st.subheader("Tensor-parallel rank disagreements")
    st.caption(
        f"Lookups where another rank's shard of {form} could not serve the point rank 0's could "
        "(reason tp_disagree); the rank named held every rank back to its point."
    )
    st.dataframe(mine[["tp_rank", "lookups", "tokens_lost", "requests", "last_seen"]], hide_index=True)
