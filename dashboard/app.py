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

from dashboard.client import client_from
from dashboard.common import CLIENT_KEY
from dashboard.pages import all_pages


def main() -> None:
    st.set_page_config(page_title="kvscope", layout="wide")
    try:
        st.session_state[CLIENT_KEY] = client_from(sys.argv[1:], os.environ)
    except ValueError as exc:
        st.error(f"Cannot use the agent URL: {exc}")
        st.stop()
    page = st.navigation(all_pages())
    page.run()


main()
