"""The dashboard's entry script: ``streamlit run dashboard/app.py -- --agent URL``.

The agent URL comes from ``--agent`` (script arguments after ``--``), else ``KVSCOPE_AGENT_URL``,
else ``http://127.0.0.1:9400``; a bearer token from ``KVSCOPE_TOKEN``. Pages are declared with
``st.navigation``; the sidebar's filters (time range, engine, model, form) carry across pages and
live in the URL (:mod:`dashboard.common`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

try:
    import dashboard  # noqa: F401 — installed, or the source root is on sys.path
except ImportError:  # run by path from a source checkout: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import streamlit as st

from dashboard import alerts_page, capacity_page, forms_page, overview, requests_page, sql_page
from dashboard.client import client_from
from dashboard.common import CLIENT_KEY


def main() -> None:
    st.set_page_config(page_title="kvscope", layout="wide")
    try:
        st.session_state[CLIENT_KEY] = client_from(sys.argv[1:], os.environ)
    except ValueError as exc:
        st.error(f"Cannot use the agent URL: {exc}")
        st.stop()
    page = st.navigation(
        [
            st.Page(overview.render, title="Overview", url_path="overview", default=True),
            st.Page(forms_page.render, title="Forms", url_path="forms"),
            st.Page(requests_page.render, title="Requests", url_path="requests"),
            st.Page(alerts_page.render, title="Alerts", url_path="alerts"),
            st.Page(sql_page.render, title="SQL", url_path="sql"),
            st.Page(capacity_page.render, title="Capacity", url_path="capacity"),
        ]
    )
    page.run()


main()
