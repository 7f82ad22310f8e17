"""The Capacity page: what each form's pools hold, and the GPUs.

* bytes and blocks per form and tier over time (``capacity_timeseries``: the engines' stats
  snapshots, each engine's mean over a bucket, summed over engines), and now
  (``capacity_latest``: each engine's latest snapshot, summed over the engines that sent one in
  the last :data:`RECENT_ENGINE_SECONDS`, so engines that stopped long ago do not add up) — used, cached (reusable) and
  total blocks, and how full each pool is;
* GPU memory and utilisation over time (``gpu_timeseries``, the agent's NVML sampler); without a
  GPU the page says so;
* a what-if: more device memory per form (MiB) → the recoverable hit rate the window's recorded
  requests would have had (``capacity_whatif``), beside what was recorded; and per form, how many
  of its losses more memory would have saved and how much it took (``form_ghosts``). It reads the
  ghost resume points the engine records for every lookup that lost tokens to evictions (from its
  pools' eviction history: LRU stack distances beyond each pool) for more memory, and the spare
  memory it records for every lookup that resumed (how many blocks would be evicted before what it
  read) for less.
"""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.agent_status import agent_status_badge
from dashboard.client import AgentError
from dashboard.common import (
    FORMS,
    Filters,
    current_client,
    query,
    sidebar_filters,
    time_tooltip,
    time_x,
    utc_times,
)

MiB = 1024 * 1024
RECENT_ENGINE_SECONDS = 300
"""An engine without a stats snapshot this recent is left out of the totals "now"."""


def render() -> None:
    """The page body (called by ``st.navigation``)."""
    st.title("Capacity")
    client = current_client()
    agent_status_badge(client)
    filters = sidebar_filters(client)
    try:
        pools = query(client, "capacity_timeseries", **filters.params())
        now = query(
            client, "capacity_latest", since_seconds=filters.since_seconds, engine_id=filters.engine, model=filters.model, recent_seconds=RECENT_ENGINE_SECONDS
        )
        gpus = query(client, "gpu_timeseries", since_seconds=filters.since_seconds, bucket_seconds=filters.bucket_seconds)
    except AgentError as exc:
        st.error(str(exc))
        return
    if filters.form is not None:
        pools = pools[pools["form"] == filters.form]
        now = now[now["form"] == filters.form]
    pools_panel(pools, now)
    gpu_panel(gpus)
    whatif_panel(client, filters)


def latest(now: pd.DataFrame) -> pd.DataFrame:
    """Each engine's latest snapshot summed per form and tier, with how full each pool is."""
    last = now.copy()
    last["used_MiB"] = last["used_bytes"] / MiB
    last["fill"] = last["used_blocks"] / last["total_blocks"].where(last["total_blocks"] > 0)
    return last[["form", "tier", "used_MiB", "used_blocks", "cached_blocks", "free_blocks", "total_blocks", "fill"]].reset_index(drop=True)


def pools_panel(pools: pd.DataFrame, now: pd.DataFrame) -> None:
    st.subheader("Pools per form and tier")
    if pools.empty:
        st.info("No engine stats in this window yet (engines send them every few seconds while serving).")
        return
    st.dataframe(latest(now), hide_index=True, column_config={"fill": st.column_config.ProgressColumn("fill", min_value=0.0, max_value=1.0)})
    series = utc_times(pools.assign(pool=pools["form"] + "/" + pools["tier"], used_MiB=pools["used_bytes"] / MiB))
    st.altair_chart(
        alt.Chart(series).mark_line(point=True).encode(
            x=time_x(), y=alt.Y("used_MiB:Q", title="MiB used"), color="pool:N", tooltip=[time_tooltip(), "pool:N", "used_MiB:Q"]
        ),
        width="stretch",
    )
    st.altair_chart(
        alt.Chart(series).mark_line(point=True).encode(
            x=time_x(), y=alt.Y("cached_blocks:Q", title="blocks cached (reusable)"), color="pool:N"
        ),
        width="stretch",
    )


def gpu_panel(gpus: pd.DataFrame) -> None:
    st.subheader("GPUs")
    if gpus.empty:
        st.info("No GPU samples: the agent found no NVIDIA GPU (or its sampler is off), so there is nothing to show.")
        return
    gpus = utc_times(gpus.assign(gpu=gpus["gpu_index"].astype(str) + " " + gpus["name"], memory_used_GiB=gpus["memory_used_bytes"] / 1024**3))
    columns = st.columns(2)
    columns[0].altair_chart(
        alt.Chart(gpus).mark_line(point=True).encode(x=time_x(), y=alt.Y("memory_used_GiB:Q", title="GiB used"), color="gpu:N"),
        width="stretch",
    )
    columns[1].altair_chart(
        alt.Chart(gpus.dropna(subset=["utilization_ratio"])).mark_line(point=True).encode(
            x=time_x(), y=alt.Y("utilization_ratio:Q", title="utilisation", axis=alt.Axis(format="%")), color="gpu:N"
        ),
        width="stretch",
    )


def whatif_panel(client: object, filters: Filters) -> None:
    st.subheader("What if a form had more memory")
    try:
        ghosts = query(client, "form_ghosts", since_seconds=filters.since_seconds, engine_id=filters.engine, model=filters.model)  # type: ignore[arg-type]
    except AgentError as exc:
        st.error(str(exc))
        return
    if ghosts.empty:
        st.info("No cache lookups in this window yet: nothing to replay.")
        return
    st.caption(
        "More (or, negative, less) device memory per form, in MiB; the window's recorded requests are "
        "replayed against it. With more, a lookup that lost tokens to evictions resumes where it would "
        "have with enough memory; with less, a lookup that needed what the cut would have evicted "
        "resumes nowhere. A request resumes at the minimum over its forms. An estimate: see docs/agent.md."
    )
    columns = st.columns(3)
    extra = {f: columns[i % 3].number_input(f, value=0.0, step=16.0, key=f"whatif_{f}") for i, f in enumerate(FORMS)}
    try:
        rows = query(
            client,  # type: ignore[arg-type]
            "capacity_whatif",
            since_seconds=filters.since_seconds, engine_id=filters.engine, model=filters.model,
            **{f"extra_mib_{f}": mib for f, mib in extra.items() if mib != 0},
        )  # fmt: skip
    except AgentError as exc:
        st.error(str(exc))
        return
    row = rows.iloc[0]
    if not row["requests"]:
        st.info("No requests in this window yet: nothing to replay.")
        return
    metrics = st.columns(3)
    metrics[0].metric("Recorded recoverable hit rate", _pct(row["recorded_rate"]))
    metrics[1].metric(
        "With this memory", _pct(row["what_if_rate"]),
        delta=f"{(row['what_if_rate'] - row['replay_rate']) * 100:+.1f} pp" if pd.notna(row["what_if_rate"]) else None,
    )  # fmt: skip
    metrics[2].metric("Model with no extra memory", _pct(row["replay_rate"]), help="how close the replay comes to what the engine did")
    st.caption(f"{int(row['requests']):,} requests, {int(row['prompt_tokens']):,} prompt tokens.")
    table = ghosts.copy()
    table["saved_share"] = table["saved_by_memory"] / table["lost_lookups"].where(table["lost_lookups"] > 0)
    st.dataframe(
        table[["form", "lost_lookups", "saved_by_memory", "saved_share", "ghost_mib_p50", "ghost_mib_p90", "ghost_mib_max", "ghost_gain_tokens"]],
        hide_index=True,
        column_config={"saved_share": st.column_config.ProgressColumn("saved by memory", min_value=0.0, max_value=1.0)},
    )


def _pct(ratio: object) -> str:
    return "n/a" if ratio is None or pd.isna(ratio) else f"{float(ratio):.1%}"  # type: ignore[arg-type]
