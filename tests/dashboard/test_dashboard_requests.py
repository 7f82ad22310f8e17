"""The Requests page (issue 8, item 3) against a real agent holding a limiting-form case: the
table, the search, one request's forms against its hash hit and L*, its plan and timings; and an
empty store."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from tests.dashboard.agent_fixture import RunningAgent, running_agent

PAGE = "from dashboard import requests_page\nrequests_page.render()\n"
NOW = time.time()


def request(rid: str, ts: float, prompt: int, hash_hit: int, resume: int, **extra: object) -> dict[str, object]:
    return {
        "kind": "request", "ts": ts, "engine_id": "e1", "request_id": rid, "model": "m1", "prompt_tokens": prompt,
        "output_tokens": 4, "hash_hit_tokens": hash_hit, "resume_tokens": resume, "recoverable_tokens": resume,
        "replayed_tokens": 0, "recomputed_tokens": prompt - resume, "admission": "exact", "ttft_seconds": 0.25,
        "e2e_seconds": 0.5, **extra,
    }  # fmt: skip


def lookup(rid: str, form: str, hash_hit: int, usable: int, outcome: str = "hit", reason: str = "none", group: int = 0) -> dict[str, object]:
    return {
        "kind": "cache_lookup", "ts": NOW - 10, "engine_id": "e1", "request_id": rid, "model": "m1", "form": form,
        "tier": "device", "outcome": outcome, "reason": reason, "hash_hit_tokens": hash_hit, "usable_tokens": usable,
        "recoverable_tokens": usable, "layer_group": group,
    }  # fmt: skip


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[RunningAgent]:
    """r-swa: 2048 prompt tokens, 1024 hash-hit; full_kv usable 1024, swa_window only 512 (its
    window was evicted: it limits L* to 512), linear_state 896 in one layer group and 640 in the
    other (the form counts its minimum, 640). r-cold: nothing cached."""
    global NOW
    NOW = time.time()  # per test: a module-level clock would age past the page's window in a long run
    with running_agent(tmp_path) as running:
        events = [
            lookup("r-swa", "full_kv", 1024, 1024),
            lookup("r-swa", "swa_window", 1024, 512, "invalidated", "swa_evicted"),
            lookup("r-swa", "linear_state", 1024, 896, group=0),
            lookup("r-swa", "linear_state", 1024, 640, "invalidated", "linear_checkpoint_missing", group=1),
            request("r-swa", NOW - 9, 2048, 1024, 512, limiting_form="swa_window", limiting_reason="swa_evicted",
                    admission="exact", predicted_seconds=0.2, actual_seconds=0.3),
            request("r-cold", NOW - 5, 1000, 0, 0),
        ]  # fmt: skip
        body = {"schema_version": 1, "engine_id": "e1", "seq": 0, "sent_at": NOW, "events": events}
        response = httpx.post(f"{running.url}/v1/events", json=body, timeout=10)
        assert response.json()["status"] == "stored", response.text
        yield running


def page(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch, **url: str) -> AppTest:
    monkeypatch.setenv("KVSCOPE_AGENT_URL", agent.url)
    monkeypatch.delenv("KVSCOPE_TOKEN", raising=False)
    at = AppTest.from_string(PAGE, default_timeout=30)
    for key, value in url.items():
        at.query_params[key] = value
    return at.run()


def test_table_search_and_one_requests_forms_against_l_star(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = page(agent, monkeypatch)
    assert not at.exception and not at.error, [e.value for e in at.error]
    table = at.dataframe[0].value
    assert table[["request_id", "resume_tokens", "limiting_form"]].fillna("-").values.tolist() == [
        ["r-cold", 0, "-"],
        ["r-swa", 512, "swa_window"],
    ]
    at.text_input(key="request_search").input("swa").run()
    assert at.dataframe[0].value["request_id"].tolist() == ["r-swa"]
    assert at.selectbox(key="request_chosen").value == "r-swa (e1)"
    metrics = {m.label: m.value for m in at.metric}
    assert metrics == {
        "Prompt tokens": "2,048", "Resume point L*": "512", "Admission": "exact",
        "Predicted": "0.200 s", "Actual": "0.300 s", "TTFT": "0.250 s",
    }  # fmt: skip
    assert at.caption[-1].value == "Limited by swa_window (swa_evicted)."
    forms = at.dataframe[1].value
    assert forms[["form", "outcome", "reason", "usable_tokens", "hash_hit_tokens"]].values.tolist() == [
        ["swa_window", "invalidated", "swa_evicted", 512, 1024],
        ["linear_state", "invalidated", "linear_checkpoint_missing", 640, 1024],  # its shorter layer group
        ["full_kv", "hit", "none", 1024, 1024],
    ]
    (chart,) = at.get("vega_lite_chart")
    spec = json.loads(chart.proto.spec)
    assert [layer["mark"]["type"] if isinstance(layer["mark"], dict) else layer["mark"] for layer in spec["layer"]] == ["bar", "bar", "rule"]
    datasets = [pa.ipc.open_stream(d.data.data).read_all().to_pydict() for d in chart.proto.datasets]
    assert {"L*": [512]} in datasets  # the resume point's rule
    bars = next(d for d in datasets if "usable_tokens" in d)
    assert dict(zip(bars["form"], bars["usable_tokens"], strict=True)) == {"swa_window": 512, "linear_state": 640, "full_kv": 1024}


def test_a_request_without_lookups_and_an_empty_store(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    at = page(agent, monkeypatch)
    at.selectbox(key="request_chosen").set_value("r-cold (e1)").run()
    assert at.caption[-1].value == "No form limited the resume point."
    assert at.info[0].value == "No cache lookups were stored for this request."
    at.text_input(key="request_search").input("nothing-like-this").run()
    assert at.info[0].value == "No requests in the last 15 minutes, with 'nothing-like-this' in the id."
    with running_agent(tmp_path / "empty") as empty:
        bare = page(empty, monkeypatch)
    assert not bare.exception and bare.info[0].value == "No requests in the last 15 minutes."


def test_the_agent_filters_by_bucket_limiting_form_and_search(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opened from a drop (?start=&end=: one bucket) the table holds that bucket's requests; the
    sidebar's form keeps the requests it limited; the search is the agent's, case-insensitive."""
    # r-swa is at NOW - 9, r-cold at NOW - 5: a bucket [NOW - 10, NOW - 6) holds only r-swa
    at = page(agent, monkeypatch, start=str(NOW - 10), end=str(NOW - 6))
    assert not at.exception and not at.warning
    assert at.dataframe[0].value["request_id"].tolist() == ["r-swa"]
    assert at.caption[0].value.startswith("The latest 1 requests in ") and at.caption[0].value.endswith(" UTC, newest first.")
    at.button(key="request_clear_span").click().run()  # back to the sidebar's time range
    assert at.dataframe[0].value["request_id"].tolist() == ["r-cold", "r-swa"]
    assert "start" not in at.query_params
    at.sidebar.selectbox(key="form").set_value("swa_window").run()
    assert at.dataframe[0].value["request_id"].tolist() == ["r-swa"]
    assert at.caption[0].value == "The latest 1 requests in the last 15 minutes, limited by swa_window, newest first."
    at.sidebar.selectbox(key="form").set_value("linear_state").run()
    assert at.info[0].value == "No requests in the last 15 minutes, limited by linear_state."
    at.sidebar.selectbox(key="form").set_value("(all)").run()
    at.text_input(key="request_search").input("R-CO").run()
    assert at.dataframe[0].value["request_id"].tolist() == ["r-cold"]
    # the agent did the filtering: the same call straight to it
    rows = httpx.get(f"{agent.url}/v1/query/recent_requests", params={"search": "R-SW", "limiting_form": "swa_window"}, timeout=10).json()["rows"]
    assert len(rows) == 1


def test_a_malformed_span_in_the_url_is_reported_and_ignored(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = page(agent, monkeypatch, start="yesterday", end="1")
    assert not at.exception
    assert "Ignored the URL's time span" in at.warning[0].value and "unix seconds" in at.warning[0].value
    assert at.dataframe[0].value["request_id"].tolist() == ["r-cold", "r-swa"]
    at = page(agent, monkeypatch, start=str(NOW), end=str(NOW - 60))
    assert "start must be before end" in at.warning[0].value


def test_a_tie_of_limiting_forms_is_named_in_the_caption(
    agent: RunningAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """r-tie: full_kv and swa_window both stop at L* (limiting_forms holds both, swa_window is the
    one named); r-one: limiting_forms holds only its limiting form, which is no tie."""
    events = [
        request("r-tie", NOW - 8, 2048, 1024, 512, limiting_form="swa_window", limiting_reason="swa_evicted",
                limiting_forms=["full_kv", "swa_window"]),
        request("r-one", NOW - 7, 2048, 1024, 512, limiting_form="full_kv", limiting_reason="tier_incomplete",
                limiting_forms=["full_kv"]),
    ]  # fmt: skip
    body = {"schema_version": 1, "engine_id": "e1", "seq": 1, "sent_at": NOW, "events": events}
    assert httpx.post(f"{agent.url}/v1/events", json=body, timeout=10).json()["status"] == "stored"
    at = page(agent, monkeypatch)
    at.selectbox(key="request_chosen").set_value("r-tie (e1)").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.caption[-1].value == "Limited by swa_window (swa_evicted; tied: full_kv, swa_window)."
    at.selectbox(key="request_chosen").set_value("r-one (e1)").run()
    assert at.caption[-1].value == "Limited by full_kv (tier_incomplete)."
    # r-swa was stored without limiting_forms
    at.selectbox(key="request_chosen").set_value("r-swa (e1)").run()
    assert at.caption[-1].value == "Limited by swa_window (swa_evicted)."
