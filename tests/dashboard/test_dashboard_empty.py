"""Every dashboard page against an empty store and against no agent at all: the page explains
(an info, a caption or one error naming the agent), never a stack trace."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from tests.dashboard.agent_fixture import running_agent

PAGES = ("overview", "forms_page", "requests_page", "alerts_page", "sql_page", "capacity_page")


def render(module: str) -> AppTest:
    return AppTest.from_string(f"from dashboard import {module}\n{module}.render()\n", default_timeout=30).run()


@pytest.mark.parametrize("module", PAGES)
def test_an_empty_store_is_explained(module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSCOPE_TOKEN", raising=False)
    with running_agent(tmp_path) as agent:
        monkeypatch.setenv("KVSCOPE_AGENT_URL", agent.url)
        at = render(module)
    assert not at.exception, [e.message for e in at.exception]
    explained = [e.value for e in (*at.info, *at.caption, *at.success)]
    errors = [e.value for e in at.error]
    if module == "alerts_page":  # this test agent runs no rule scheduler: said once, the rest explains itself
        assert errors == ["agent at " + agent.url + ": HTTP 503: no rule scheduler runs in this process"]
    else:
        assert errors == []
    assert explained, f"{module} shows nothing to say it is empty"


@pytest.mark.parametrize("module", PAGES)
def test_no_agent_is_one_clear_error(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("KVSCOPE_AGENT_URL", dead)
    monkeypatch.delenv("KVSCOPE_TOKEN", raising=False)
    at = render(module)
    assert not at.exception, [e.message for e in at.exception]
    assert at.error and all(f"agent unreachable at {dead}" in e.value for e in at.error)
