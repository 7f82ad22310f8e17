"""The "stale since" badge on every page when the agent stops answering, and the agent's
``/readyz`` status (degraded, not ready) in the Overview's ingest health."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from agent.client import DEFAULT_QUERY_TIMEOUT_SECONDS, QUERY_TIMEOUT_MARGIN_SECONDS
from agent.readiness import DataDirProbe
from dashboard.agent_status import utc_text
from dashboard.common import QUERY_TIMEOUT_KEY
from dashboard.pages import TITLES
from tests.dashboard.agent_fixture import render_page, running_agent

MODULES = {
    "overview": "overview",
    "forms": "forms_page",
    "requests": "requests_page",
    "alerts": "alerts_page",
    "sql": "sql_page",
    "capacity": "capacity_page",
}


CURRENT_CLIENT_TIMEOUT = "import streamlit as st\nfrom dashboard.common import current_client\nst.text(str(current_client().query_timeout_seconds))\n"
"""A script showing the query timeout of the client :func:`dashboard.common.current_client` gives."""


def badges(at: AppTest) -> list[str]:
    return [m.value for m in at.markdown if m.value.startswith(":orange-badge[")]


def test_every_page_shows_stale_since_once_the_agent_stops_answering(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(MODULES) == set(TITLES)  # every page of the navigation
    with running_agent(tmp_path) as agent:
        before = time.time()
        pages = {name: render_page(module, agent.url, monkeypatch) for name, module in MODULES.items()}
        after = time.time()
        for name, at in pages.items():
            assert not at.exception, (name, [e.message for e in at.exception])
            assert badges(at) == [], name  # the agent answers: no badge
    answered = {utc_text(t, now=after) for t in range(int(before), int(after) + 1)}
    for name, at in pages.items():
        at.run()  # the agent is gone
        assert not at.exception, (name, [e.message for e in at.exception])
        (badge,) = badges(at)
        prefix, _, rest = badge.partition("Stale since ")
        assert prefix == ":orange-badge[:material/history: ", (name, badge)
        when, _, tail = rest.partition(": ")
        assert when in answered, (name, badge, answered)  # the time of the agent's last answer, UTC
        assert tail == "the agent stopped answering]", (name, badge)


def test_a_page_that_never_reached_the_agent_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    at = render_page("sql_page", dead, monkeypatch)
    assert badges(at) == [":orange-badge[:material/history: Stale: the agent has not answered since this page opened]"]


def test_overview_ingest_health_shows_degraded_and_not_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with running_agent(tmp_path / "data") as agent:
        at = render_page("overview", agent.url, monkeypatch)
        assert not at.warning and not at.error  # ready: nothing to say
        agent.app.state.health.degrade("wal_quarantined", "the WAL was moved to quarantine/wal-1", since=time.time())
        at.run()
        (warning,) = at.warning
        assert warning.value.startswith("Agent degraded: it stores and answers, but an operator must look.")
        assert "**wal_quarantined** (since " in warning.value and warning.value.endswith("UTC): the WAL was moved to quarantine/wal-1")
        agent.app.state.data_dir_probe = DataDirProbe(tmp_path / "gone", ttl_seconds=0)  # as if the directory went away
        at.run()
        assert not at.warning
        (error,) = at.error
        assert error.value.startswith("Agent not ready: it cannot store new batches.")
        assert f"- the data directory {tmp_path / 'gone'} cannot be written (ENOENT: No such file or directory)" in error.value
        assert "Also degraded:\n- **wal_quarantined**" in error.value
        assert badges(at) == []  # not ready is an answer: the page is not stale


def test_the_query_timeout_follows_the_agents_published_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent allowing 60 s per query (and 2 s in the queue) is waited for longer than that."""
    with running_agent(tmp_path, sql_timeout_seconds=60) as agent:
        at = render_page("sql_page", agent.url, monkeypatch)
        assert not at.exception, [e.message for e in at.exception]
        learned = at.session_state[QUERY_TIMEOUT_KEY]
    assert learned == {agent.url: 60 + 2 + QUERY_TIMEOUT_MARGIN_SECONDS}
    assert learned[agent.url] > 60 + 2
    at = AppTest.from_string(CURRENT_CLIENT_TIMEOUT, default_timeout=30)
    at.session_state[QUERY_TIMEOUT_KEY] = learned
    monkeypatch.setenv("KVSCOPE_AGENT_URL", agent.url)
    assert at.run().text[0].value == str(60 + 2 + QUERY_TIMEOUT_MARGIN_SECONDS)  # what current_client hands the pages


def test_an_agent_that_names_no_limits_keeps_the_default_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:  # nothing answers: no limits known
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("KVSCOPE_AGENT_URL", dead)
    at = AppTest.from_string(CURRENT_CLIENT_TIMEOUT, default_timeout=30).run()
    assert at.text[0].value == str(DEFAULT_QUERY_TIMEOUT_SECONDS)
    assert at.session_state[QUERY_TIMEOUT_KEY] == {dead: None}


def test_utc_text_adds_the_date_only_for_another_day() -> None:
    assert utc_text(3723.0, now=4000.0) == "01:02:03 UTC"
    assert utc_text(3723.0, now=2 * 86400.0) == "1970-01-01 01:02:03 UTC"
