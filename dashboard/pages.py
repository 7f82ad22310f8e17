"""The dashboard's pages, declared once: the entry script hands them to ``st.navigation`` and
pages link to each other through them (``st.page_link(page("requests"), query_params=...)``).

A page built twice from the same arguments is the same page to Streamlit (its identity is its
URL path), so :func:`page` may be called from any page's script run.
"""

from __future__ import annotations

from collections.abc import Callable

import streamlit as st
from streamlit.navigation.page import StreamlitPage

TITLES = {
    "overview": "Overview",
    "forms": "Forms",
    "requests": "Requests",
    "alerts": "Alerts",
    "sql": "SQL",
    "capacity": "Capacity",
}
"""URL path → title, in the navigation's order (the first is the default page)."""


def _render(url_path: str) -> Callable[[], None]:
    from dashboard import alerts_page, capacity_page, forms_page, overview, requests_page, sql_page

    modules = {
        "overview": overview,
        "forms": forms_page,
        "requests": requests_page,
        "alerts": alerts_page,
        "sql": sql_page,
        "capacity": capacity_page,
    }
    render: Callable[[], None] = modules[url_path].render
    return render


def page(url_path: str) -> StreamlitPage:
    """The page at ``url_path`` (a key of :data:`TITLES`).

    Raises:
        KeyError: no such page.
    """
    title = TITLES[url_path]
    return st.Page(_render(url_path), title=title, url_path=url_path, default=url_path == next(iter(TITLES)))


def all_pages() -> list[StreamlitPage]:
    """Every page, in the navigation's order."""
    return [page(p) for p in TITLES]
