"""The dashboard's pages, declared once: the entry script hands them to ``st.navigation`` and
pages link to each other through them (``st.page_link(page("requests"), query_params=...)``).

Every page has its own URL (``/overview``, ``/forms``, ...). The root URL ``/`` is a hidden page
that switches to ``/overview`` with the same query string, so a bookmark of either works (a
default page is served at ``/`` only, and ``/overview`` would otherwise be "Page not found").

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
"""URL path → title, in the navigation's order."""

ROOT = "home"
"""The unique name of the hidden default page served at ``/`` (:func:`_to_overview`)."""


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
    return st.Page(_render(url_path), title=title, url_path=url_path)


def _to_overview() -> None:
    """The root URL: on to the Overview, keeping the query string (the filters of a shared link)."""
    st.switch_page(page("overview"), query_params=st.query_params.to_dict())


def all_pages() -> list[StreamlitPage]:
    """Every page, in the navigation's order, and the hidden root page (the default)."""
    root = st.Page(_to_overview, title=TITLES["overview"], url_path=ROOT, default=True, visibility="hidden")
    return [*(page(p) for p in TITLES), root]
