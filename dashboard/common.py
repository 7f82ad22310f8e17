"""What every dashboard page shares: the agent client, cached named queries, and the filters
(time range, engine, model, form) in the sidebar.

The client's query timeout follows the agent's own limits, which its ``/readyz`` publishes
(:func:`agent.client.query_timeout_for`): read once per agent and session by
:func:`current_client`, and again by every ``/readyz`` call of :mod:`dashboard.agent_status`
(:func:`remember_limits`), so an agent allowing an hour per query is waited for an hour.

The filters live in the URL's query string (``?window=1+hour&engine=e1``), so a view can be
shared, and in the session, so they carry across pages and the links between them; an engine or
model named in a shared URL that the agent has not seen in the window stays selectable.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import altair as alt
import pandas as pd
import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

from dashboard.client import AgentClient, AgentError, client_from, query_frame, query_timeout_for
from dashboard.palette import color

CLIENT_KEY = "kvscope_agent_client"
QUERY_TIMEOUT_KEY = "kvscope_agent_query_timeout"
"""Session state: agent URL → the query timeout (seconds) derived from that agent's ``/readyz``
limits, or ``None`` when it was asked and named none (the client's default stays)."""
LIMITS_PROBE_TIMEOUT_SECONDS = 2.0
"""The timeout of :func:`current_client`'s one ``/readyz`` call, seconds."""
PAGE_MARK = "page"
"""Where the session's last filters note the page they were rendered on."""
LAST_FILTERS_KEY = "kvscope_last_filters"
"""The filters of the session's last page: the defaults of the next page's filter widgets, so a
link that changes page keeps them even when they came from the URL (Streamlit keeps only values a
user set across a page change)."""
CACHE_TTL_SECONDS = 4
REFRESH_SECONDS = 5
WINDOWS: dict[str, tuple[int, int]] = {
    "5 minutes": (300, 10),
    "15 minutes": (900, 15),
    "1 hour": (3600, 60),
    "6 hours": (6 * 3600, 300),
    "24 hours": (86400, 900),
    "7 days": (7 * 86400, 3600),
}
"""Time range label → (since_seconds, bucket_seconds)."""
DEFAULT_WINDOW = "15 minutes"
ALL = "(all)"
FORMS = ("full_kv", "swa_window", "compressed_kv", "uncompressed_tail", "indexer_state", "linear_state")


@dataclass(frozen=True, slots=True)
class Filters:
    window: str
    engine: str | None
    model: str | None
    form: str | None

    @property
    def since_seconds(self) -> int:
        return WINDOWS[self.window][0]

    @property
    def bucket_seconds(self) -> int:
        return WINDOWS[self.window][1]

    def params(self) -> dict[str, object]:
        """The named-query parameters of the window, engine and model (None: no filter)."""
        return {
            "since_seconds": self.since_seconds,
            "bucket_seconds": self.bucket_seconds,
            "engine_id": self.engine,
            "model": self.model,
        }


def current_client() -> AgentClient:
    """The client the entry script stored in the session (or one from argv/env), its query
    timeout derived from the agent's published limits: on the session's first use of an agent
    its ``/readyz`` is read once (timeout :data:`LIMITS_PROBE_TIMEOUT_SECONDS`; no answer or no
    limits: the client's default stays, until a later ``/readyz`` names them)."""
    client = st.session_state.get(CLIENT_KEY)
    if not isinstance(client, AgentClient):
        client = client_from(sys.argv[1:], os.environ)
        st.session_state[CLIENT_KEY] = client
    learned: dict[str, float | None] = st.session_state.setdefault(QUERY_TIMEOUT_KEY, {})
    if client.base_url not in learned:
        probe = dataclasses.replace(client, timeout_seconds=min(client.timeout_seconds, LIMITS_PROBE_TIMEOUT_SECONDS))
        try:
            remember_limits(client, probe.readyz())
        except AgentError:
            learned[client.base_url] = None
    timeout = learned.get(client.base_url)
    return client if timeout is None else dataclasses.replace(client, query_timeout_seconds=timeout)


def remember_limits(client: AgentClient, readiness: Mapping[str, Any]) -> None:
    """Note the query timeout that ``readiness`` (a ``/readyz`` body of ``client``'s agent)
    implies (:func:`agent.client.query_timeout_for`), for :func:`current_client`; a body
    without limits leaves a noted one as it is."""
    learned: dict[str, float | None] = st.session_state.setdefault(QUERY_TIMEOUT_KEY, {})
    derived = query_timeout_for(readiness)
    if derived is not None:
        learned[client.base_url] = derived
    else:
        learned.setdefault(client.base_url, None)


@st.cache_data(ttl=CACHE_TTL_SECONDS, show_spinner=False)
def cached_query(base_url: str, token: str | None, query_timeout_seconds: float, name: str, params: tuple[tuple[str, object], ...]) -> pd.DataFrame:
    """A named query's rows, cached per (agent, query, parameters) for a few seconds. Errors are
    not cached."""
    return query_frame(AgentClient(base_url=base_url, token=token, query_timeout_seconds=query_timeout_seconds), name, **dict(params))


def query(client: AgentClient, name: str, **params: object) -> pd.DataFrame:
    """A named query through the cache (``None`` parameters are left out).

    Raises:
        AgentError: the agent is unreachable or refused the query.
    """
    return cached_query(client.base_url, client.token, client.query_timeout_seconds, name, tuple(sorted((k, v) for k, v in params.items() if v is not None)))


def sidebar_filters(client: AgentClient) -> Filters:
    """Render the shared filters in the sidebar and return them. Each is kept in the URL's query
    string (``?window=1+hour&engine=e1``: a view can be shared; a default value is left out) and
    in the session, so it carries across pages and links; an engine or model a URL names that the
    agent has not seen in the window stays selectable."""
    bar = st.sidebar
    bar.header("Filters")
    last: dict[str, str] = st.session_state.setdefault(LAST_FILTERS_KEY, {})
    page = _page_id()
    opened = last.get(PAGE_MARK) != page  # this page's first run since another page ran
    window = _synced(bar, "Time range", "window", list(WINDOWS), DEFAULT_WINDOW, last, opened)
    try:
        seen = query(client, "engines", since_seconds=WINDOWS[window][0])
    except AgentError:
        seen = pd.DataFrame({"engine_id": [], "model": []})
    engine = _choice(bar, "Engine", "engine", sorted(set(seen["engine_id"])), last, opened)
    model = _choice(bar, "Model", "model", sorted(set(seen["model"])), last, opened)
    form = _choice(bar, "Form", "form", list(FORMS), last, opened)
    last[PAGE_MARK] = page
    return Filters(window=window, engine=engine, model=model, form=form)


def _page_id() -> str:
    ctx = get_script_run_ctx()
    return ctx.page_script_hash if ctx is not None else ""


def _choice(bar: object, label: str, key: str, options: list[str], last: dict[str, str], opened: bool) -> str | None:
    for wanted in (st.session_state.get(key), st.query_params.get(key), last.get(key)):
        if wanted and wanted != ALL and wanted not in options:
            options = [*options, wanted]  # named by a URL (or chosen earlier), not seen in this window
    value = _synced(bar, label, key, [ALL, *options], ALL, last, opened)
    return None if value == ALL else value


def _synced(bar: object, label: str, key: str, options: list[str], default: str, last: dict[str, str], opened: bool) -> str:
    """A sidebar select box whose value, when the page opens, comes from the URL (a shared link,
    or a link from another page), else from the session's last page, else is ``default``; on
    later runs it is what the user chose. The value is written back to the URL (left out when it
    is the default) and remembered for the next page: Streamlit forgets a page's widgets when
    another page runs, hence the session's own copy."""
    from_url, current = st.query_params.get(key), st.session_state.get(key)
    candidates = (from_url, last.get(key)) if opened else (current, from_url, last.get(key))
    wanted = next((c for c in candidates if c in options), default)
    if key in st.session_state and current != wanted:
        del st.session_state[key]  # a value left from another page must not override the URL's
    value = str(bar.selectbox(label, options, index=options.index(wanted), key=key))  # type: ignore[attr-defined]
    if value == default:
        st.query_params.pop(key, None)
    elif st.query_params.get(key) != value:
        st.query_params[key] = value
    last[key] = value
    return value


def requests_link(
    filters: Filters, label: str, *, start: float | None = None, end: float | None = None, form: str | None = None, reason: str | None = None
) -> None:
    """A link to the Requests page showing the requests behind a chart: those in ``[start, end)``
    (unix seconds; one bucket) and/or limited by ``form`` (for ``reason``), with the current
    engine and model (not the sidebar's form: a chart of all requests links to all of its
    requests)."""
    from dashboard.pages import page

    params = {"window": filters.window, "engine": filters.engine, "model": filters.model, "form": form or ALL, "reason": reason}
    if start is not None and end is not None:
        params.update(start=f"{start:.6f}".rstrip("0").rstrip("."), end=f"{end:.6f}".rstrip("0").rstrip("."))
    st.page_link(page("requests"), label=label, icon=":material/manage_search:", query_params={k: v for k, v in params.items() if v is not None})


def unix_seconds(bucket: pd.Timestamp) -> float:
    """A bucket label from the agent (naive UTC) as unix seconds."""
    return float((bucket - pd.Timestamp(0)).total_seconds())


TIME_LABELS = "utcFormat(datum.value, utchours(datum.value) == 0 && utcminutes(datum.value) == 0 ? '%m-%d' : '%H:%M')"
"""Time tick labels on a 24-hour clock (``19:48``, never ``07:48`` or ``08 PM``), the date at
midnight: Vega's default multi-format uses a 12-hour clock."""


def time_x(field: str = "bucket") -> alt.X:
    """The time axis of every chart: UTC, as the agent stores and the tables show (Vega-Lite
    would otherwise draw the browser's local time), labelled on a 24-hour clock (:data:`TIME_LABELS`)."""
    return alt.X(f"{field}:T", title="UTC", scale=alt.Scale(type="utc"), axis=alt.Axis(labelExpr=TIME_LABELS))


def utc_times(frame: pd.DataFrame, field: str = "bucket") -> pd.DataFrame:
    """``frame`` with its time column ``field`` (naive UTC, as the agent stores it) marked UTC:
    the data of a chart drawn with :func:`time_x`. Streamlit hands a chart a naive time as the
    browser's wall clock, so on a utc axis a browser off UTC drew it shifted by its offset
    (19:50 UTC at 00:50 in New York); a zoned time is drawn where it is."""
    times = pd.to_datetime(frame[field])
    return frame.assign(**{field: times if times.dt.tz is not None else times.dt.tz_localize("UTC")})


def time_tooltip(field: str = "bucket") -> alt.Tooltip:
    return alt.Tooltip(f"{field}:T", title="UTC", format="%Y-%m-%d %H:%M:%S", formatType="utc")


def stacked_bars(wide: pd.DataFrame, series: str, value: str, *, kind: str) -> alt.Chart:
    """Bars per time bucket (the index of ``wide``), one stacked segment per column, each column
    in its fixed colour (:func:`dashboard.palette.color` of ``kind``: ``outcome``, ``series``)."""
    x = wide.index.name or "index"
    long = wide.reset_index().melt(id_vars=x, var_name=series, value_name=value)
    return (
        alt.Chart(utc_times(long, x))
        .mark_bar()
        .encode(x=time_x(x), y=alt.Y(f"{value}:Q", stack=True), color=color(series, kind, wide.columns), tooltip=[time_tooltip(x), f"{series}:N", f"{value}:Q"])
    )


def with_gaps(long: pd.DataFrame, x: str, series: str | None, value: str, bucket_seconds: float) -> pd.DataFrame:
    """``long`` (one row per bucket and series) with a ``segment`` column that starts a new line
    wherever a bucket has no value or the next bucket with one is more than a bucket away: a line
    chart encoding ``detail="segment:N"`` is broken there instead of drawn across minutes with no
    data (Vega-Lite joins the points either side of a gap). Rows without a value are left out."""
    frame = long.dropna(subset=[value]).sort_values([c for c in (series, x) if c is not None])
    step = pd.Timedelta(seconds=bucket_seconds * 1.5)
    key = frame[series] if series is not None else pd.Series(0, index=frame.index)
    jump = frame.groupby(key)[x].diff().gt(step) | ~key.eq(key.shift())
    return frame.assign(segment=jump.cumsum().astype(int))
