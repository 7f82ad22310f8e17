"""What every dashboard page shares: the agent client, cached named queries, and the filters
(time range, engine, model, form) in the sidebar.

The filters live in the URL's query string (``?window=1+hour&engine=e1``), so a view can be
shared, and in the session (Streamlit's ``bind="query-params"`` and ``persist_state="session"``),
so they carry across pages; an engine or model named in a shared URL that the agent has not seen
in the window stays selectable.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import pandas as pd
import streamlit as st

from dashboard.client import AgentClient, AgentError, client_from, query_frame

CLIENT_KEY = "kvscope_agent_client"
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
    """The client the entry script stored in the session (or one from argv/env)."""
    client = st.session_state.get(CLIENT_KEY)
    if not isinstance(client, AgentClient):
        client = client_from(sys.argv[1:], os.environ)
        st.session_state[CLIENT_KEY] = client
    return client


@st.cache_data(ttl=CACHE_TTL_SECONDS, show_spinner=False)
def cached_query(base_url: str, token: str | None, name: str, params: tuple[tuple[str, object], ...]) -> pd.DataFrame:
    """A named query's rows, cached per (agent, query, parameters) for a few seconds. Errors are
    not cached."""
    return query_frame(AgentClient(base_url=base_url, token=token), name, **dict(params))


def query(client: AgentClient, name: str, **params: object) -> pd.DataFrame:
    """A named query through the cache (``None`` parameters are left out).

    Raises:
        AgentError: the agent is unreachable or refused the query.
    """
    return cached_query(client.base_url, client.token, name, tuple(sorted((k, v) for k, v in params.items() if v is not None)))


def sidebar_filters(client: AgentClient) -> Filters:
    """Render the shared filters in the sidebar and return them. Each is bound to its query
    parameter (``?window=1+hour&engine=e1``: a view can be shared) and kept for the whole session,
    so it carries across pages; an engine or model a shared URL names that the agent has not seen
    in the window stays selectable."""
    bar = st.sidebar
    bar.header("Filters")
    window = bar.selectbox(
        "Time range", list(WINDOWS), index=list(WINDOWS).index(DEFAULT_WINDOW), key="window", bind="query-params", persist_state="session"
    )
    try:
        seen = query(client, "engines", since_seconds=WINDOWS[window][0])
    except AgentError:
        seen = pd.DataFrame({"engine_id": [], "model": []})
    engine = _choice(bar, "Engine", "engine", sorted(set(seen["engine_id"])))
    model = _choice(bar, "Model", "model", sorted(set(seen["model"])))
    form = _choice(bar, "Form", "form", list(FORMS))
    return Filters(window=window, engine=engine, model=model, form=form)


def _choice(bar: object, label: str, key: str, options: list[str]) -> str | None:
    wanted = st.session_state.get(key) or st.query_params.get(key)
    if wanted and wanted != ALL and wanted not in options:
        options = [*options, wanted]  # named by a shared URL (or chosen earlier), not seen in this window
    value = bar.selectbox(label, [ALL, *options], key=key, bind="query-params", persist_state="session")  # type: ignore[attr-defined]
    return None if value in (None, ALL) else str(value)
