"""The Forms page's indexer sync-delay panel (issue 23, item 4) against a real agent: "in sync"
for a healthy engine, the trailing share and the delay charts for one whose indexer lagged,
nothing for another form."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from streamlit.testing.v1 import AppTest

from tests.dashboard.agent_fixture import RunningAgent, running_agent

M0 = (int(time.time()) // 60 - 3) * 60


def lookup(engine: str, n: int, delay_tokens: int = 0) -> dict[str, object]:
    stale = {"outcome": "invalidated", "reason": "indexer_stale", "recoverable_tokens": 0} if delay_tokens else {}
    return {
        "kind": "cache_lookup", "ts": M0 + n, "engine_id": engine, "request_id": f"{engine}-{n}", "model": "m1",
        "form": "indexer_state", "tier": "device", "outcome": "hit", "reason": "none", "hash_hit_tokens": 64,
        "usable_tokens": 0, "recoverable_tokens": 0, "indexer_sync_delay_tokens": delay_tokens,
        "indexer_sync_delay_seconds": 12.0 if delay_tokens else 0.0, **stale,
    }  # fmt: skip


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningAgent]:
    """e1: 4 indexer_state lookups in sync; e2: 3 in sync and 1 trailing by 16 tokens."""
    with running_agent(Path(tmp_path_factory.mktemp("agent"))) as running:
        for seq, engine in enumerate(("e1", "e2")):
            events = [lookup(engine, i, 16 if engine == "e2" and i == 3 else 0) for i in range(4)]
            body = {"schema_version": 1, "engine_id": engine, "seq": seq, "sent_at": M0, "events": events}
            response = httpx.post(f"{running.url}/v1/events", json=body, timeout=10)
            assert response.json()["status"] == "stored", response.text
        yield running


def panel(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch, engine: str, form: str) -> AppTest:
    monkeypatch.setenv("KVSCOPE_AGENT_URL", agent.url)
    monkeypatch.delenv("KVSCOPE_TOKEN", raising=False)
    script = (
        "from dashboard.common import Filters, current_client\n"
        "from dashboard.sync_delay_panel import sync_delay_panel\n"
        f"sync_delay_panel(current_client(), Filters(window='1 hour', engine={engine!r}, model=None, form=None), form={form!r})\n"
    )
    return AppTest.from_string(script, default_timeout=30).run()


def test_in_sync_says_so(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = panel(agent, monkeypatch, "e1", "indexer_state")
    assert not at.exception and not at.error
    assert [s.value for s in at.subheader] == ["Indexer sync delay"]
    assert [s.value for s in at.success] == ["In sync: none of 4 indexer_state lookups found the indexer behind the compressed KV boundary."]
    assert not at.get("vega_lite_chart")


def test_a_trailing_index_is_charted(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = panel(agent, monkeypatch, "e2", "indexer_state")
    assert not at.exception and not at.error
    assert [(m.label, m.value) for m in at.metric] == [("Lookups that met a trailing index", "25.0%")]
    assert len(at.get("vega_lite_chart")) == 2 and not at.success


def test_another_form_shows_nothing(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = panel(agent, monkeypatch, "e2", "swa_window")
    assert not at.exception and not at.subheader and not at.get("vega_lite_chart")
