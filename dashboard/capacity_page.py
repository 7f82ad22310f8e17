"""The Capacity page: what each form's pools hold, and the GPUs.

* bytes and blocks per form and tier over time (``capacity_timeseries``: the engines' stats
  snapshots, each engine's mean over a bucket, summed over engines), and now
  (``capacity_latest``: each engine's latest snapshot, summed) — used, cached (reusable) and
  total blocks, and how full each pool is;
* GPU memory and utilisation over time (``gpu_timeseries``, the agent's NVML sampler); without a
  GPU the page says so.
"""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.client import AgentError
from dashboard.common import current_client, query, sidebar_filters

MiB = 1024 * 1024


def render() -> None:
    """The page body (called by ``st.navigation``)."""
    st.title("Capacity")
    client = current_client()
    filters = sidebar_filters(client)
    try:
        pools = query(client, "capacity_timeseries", **filters.params())
        now = query(client, "capacity_latest", since_seconds=filters.since_seconds, engine_id=filters.engine, model=filters.model)
        gpus = query(client, "gpu_timeseries", since_seconds=filters.since_seconds, bucket_seconds=filters.bucket_seconds)
    except AgentError as exc:
        st.error(str(exc))
        return
    if filters.form is not None:
        pools = pools[pools["form"] == filters.form]
        now = now[now["form"] == filters.form]
    pools_panel(pools, now)
    gpu_panel(gpus)


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
    series = pools.assign(pool=pools["form"] + "/" + pools["tier"], used_MiB=pools["used_bytes"] / MiB)
    st.altair_chart(
        alt.Chart(series).mark_line(point=True).encode(
            x=alt.X("bucket:T", title=None), y=alt.Y("used_MiB:Q", title="MiB used"), color="pool:N", tooltip=["bucket:T", "pool:N", "used_MiB:Q"]
        ),
        width="stretch",
    )
    st.altair_chart(
        alt.Chart(series).mark_line(point=True).encode(
            x=alt.X("bucket:T", title=None), y=alt.Y("cached_blocks:Q", title="blocks cached (reusable)"), color="pool:N"
        ),
        width="stretch",
    )


def gpu_panel(gpus: pd.DataFrame) -> None:
    st.subheader("GPUs")
    if gpus.empty:
        st.info("No GPU samples: the agent found no NVIDIA GPU (or its sampler is off), so there is nothing to show.")
        return
    gpus = gpus.assign(gpu=gpus["gpu_index"].astype(str) + " " + gpus["name"], memory_used_GiB=gpus["memory_used_bytes"] / 1024**3)
    columns = st.columns(2)
    columns[0].altair_chart(
        alt.Chart(gpus).mark_line(point=True).encode(x=alt.X("bucket:T", title=None), y=alt.Y("memory_used_GiB:Q", title="GiB used"), color="gpu:N"),
        width="stretch",
    )
    columns[1].altair_chart(
        alt.Chart(gpus.dropna(subset=["utilization_ratio"])).mark_line(point=True).encode(
            x=alt.X("bucket:T", title=None), y=alt.Y("utilization_ratio:Q", title="utilisation", axis=alt.Axis(format="%")), color="gpu:N"
        ),
        width="stretch",
    )
