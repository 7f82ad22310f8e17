"""The Alerts page (issue 8, item 4, on issue 7's API) against a real agent: firing and pending
alerts with their runbook links, silences created and expired through the page, the history with
and without deliveries; the sidebar's filters in the URL; an agent without a rule scheduler."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from streamlit.testing.v1 import AppTest

from alerts.alert_store import alert_row, insert_alert_rows
from tests.dashboard.agent_fixture import RunningAgent, render_page, running_agent

NOW = time.time()
ACTIVE = [
    {
        "alertname": "RecoverableHitRateDrop", "state": "firing",
        "labels": {"engine": "e1", "model": "m1", "severity": "page"},
        "annotations": {"summary": "Recoverable hit rate on e1 (m1) fell to 40%", "runbook_url": "https://runbooks.example/drop"},
        "value": 0.4, "active_at": NOW - 300, "firing_since": NOW - 180,
    },
    {
        "alertname": "EngineSilent", "state": "pending", "labels": {"engine": "e2", "severity": "ticket"},
        "annotations": {"summary": "Engine e2 sent no events for 5 minutes"}, "value": 200.0, "active_at": NOW - 60,
        "firing_since": None,
    },
]  # fmt: skip


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[RunningAgent]:
    with running_agent(tmp_path) as running:
        running.app.state.active_alerts = lambda: ACTIVE
        rows = [
            alert_row(at=NOW - 180, alert="RecoverableHitRateDrop", fingerprint="f1", state="firing", value=0.4,
                      labels={"engine": "e1", "model": "m1", "severity": "page"}, summary="fell to 40%", description=""),
            alert_row(at=NOW - 179, alert="RecoverableHitRateDrop", fingerprint="f1", state="firing", value=0.4,
                      labels={"engine": "e1", "model": "m1", "severity": "page"}, summary="fell to 40%", description="",
                      event="delivery_failed", receiver="oncall/webhook[0]", error="HTTP 500"),
            alert_row(at=NOW - 3600, alert="EngineSilent", fingerprint="f2", state="resolved", value=400.0,
                      labels={"engine": "e2", "severity": "ticket"}, summary="e2 silent", description=""),
        ]  # fmt: skip
        with running.store.transaction() as cur:
            insert_alert_rows(cur, rows)
        for seq, engine in enumerate(("e1", "e2")):  # both engines served requests lately
            body = {"schema_version": 1, "engine_id": engine, "seq": seq, "sent_at": NOW, "events": [request(engine)]}
            assert httpx.post(f"{running.url}/v1/events", json=body, timeout=10).json()["status"] == "stored"
        yield running


def request(engine: str) -> dict[str, object]:
    return {
        "kind": "request", "ts": NOW - 30, "engine_id": engine, "request_id": f"r-{engine}", "model": "m1",
        "prompt_tokens": 100, "output_tokens": 1, "hash_hit_tokens": 50, "resume_tokens": 50,
        "recoverable_tokens": 50, "replayed_tokens": 0, "recomputed_tokens": 50, "admission": "exact",
        "ttft_seconds": 0.1, "e2e_seconds": 0.2,
    }  # fmt: skip


def page(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch, **query: str) -> AppTest:
    return render_page("alerts_page", agent.url, monkeypatch, **query)


def ok(at: AppTest) -> None:
    assert not at.exception, [e.message for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def test_firing_pending_history_and_filters(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = page(agent, monkeypatch)
    ok(at)
    assert at.title[0].value == "Alerts"
    assert [s.value for s in at.subheader] == ["Firing and pending", "Rules", "Silences", "History"]
    assert at.metric[0].label == "Firing" and at.metric[0].value == "1"
    active = at.dataframe[0].value
    assert active[["state", "alert", "labels", "value"]].values.tolist() == [
        ["firing", "RecoverableHitRateDrop", "engine=e1, model=m1, severity=page", 0.4],
        ["pending", "EngineSilent", "engine=e2, severity=ticket", 200.0],
    ]
    assert active["runbook"].iloc[0] == "https://runbooks.example/drop" and active["runbook"].isna().iloc[1]
    history = at.dataframe[1].value  # no silences yet: the history is the second table
    assert history[["alert", "state"]].values.tolist() == [["RecoverableHitRateDrop", "firing"], ["EngineSilent", "resolved"]]
    at.toggle(key="alerts_deliveries").set_value(True).run()
    ok(at)
    deliveries = at.dataframe[1].value
    assert deliveries[["event", "receiver", "error"]].values.tolist()[0] == ["delivery_failed", "oncall/webhook[0]", "HTTP 500"]
    assert len(deliveries) == 3
    # the engine filter narrows both tables
    at.sidebar.selectbox(key="engine").set_value("e2").run()
    ok(at)
    # (the URL follows through Streamlit's query-param binding: the browser test checks it)
    assert at.dataframe[0].value["alert"].tolist() == ["EngineSilent"]
    assert at.dataframe[1].value["alert"].tolist() == ["EngineSilent"]


def test_a_shared_url_sets_the_filters(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = page(agent, monkeypatch, window="1 hour", engine="e1", model="m9")
    ok(at)
    assert at.sidebar.selectbox(key="window").value == "1 hour"
    assert at.sidebar.selectbox(key="engine").value == "e1"
    assert at.sidebar.selectbox(key="engine").options == ["(all)", "e1", "e2"]
    assert at.sidebar.selectbox(key="model").value == "m9"  # not seen in the window, still selectable
    assert at.dataframe[0].value["alert"].tolist() == ["RecoverableHitRateDrop"]


def test_silences_are_created_and_expired_through_the_page(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = page(agent, monkeypatch)
    at.text_area[0].input('engine="e1"\nalertname=~"Recoverable.*"')
    at.text_input[0].input("2h")
    at.text_input[1].input("pool resize")
    at.button[0].click().run()  # the form's submit button
    ok(at)
    assert at.success[0].value.startswith("Silence ")
    (silence,) = httpx.get(f"{agent.url}/v1/silences", timeout=10).json()["silences"]
    assert silence["matchers"] == ['engine="e1"', 'alertname=~"Recoverable.*"'] and silence["comment"] == "pool resize"
    assert silence["ends_at"] - silence["starts_at"] == pytest.approx(7200)
    at.run()
    assert at.dataframe[1].value[["state", "matchers", "comment"]].values.tolist() == [
        ["active", 'engine="e1" alertname=~"Recoverable.*"', "pool resize"]
    ]
    at.selectbox(key="expire_silence").set_value(silence["id"])
    next(b for b in at.button if b.label == "Expire").click().run()
    ok(at)
    assert httpx.get(f"{agent.url}/v1/silences", timeout=10).json()["silences"][0]["state"] == "expired"
    # a bad matcher is refused with the agent's reason, and nothing is stored
    at.text_area[0].input("engine")
    at.text_input[1].input("typo")
    next(b for b in at.button if b.label == "Create silence").click().run()
    assert at.error[0].value.startswith("The silence was not created:") and "is not a matcher" in at.error[0].value
    assert len(httpx.get(f"{agent.url}/v1/silences", timeout=10).json()["silences"]) == 1


def test_an_agent_without_a_rule_scheduler_is_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with running_agent(tmp_path) as bare:
        at = page(bare, monkeypatch)
    assert not at.exception
    assert at.error[0].value.endswith("no rule scheduler runs in this process")
    assert at.caption[-1].value == "No alerts yet."


def test_missed_evaluations_are_shown(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = page(agent, monkeypatch)
    ok(at)
    assert "Missed rule evaluations: unknown" in at.caption[0].value  # this agent has no rule scheduler
    agent.app.state.missed_evaluations = lambda: [
        {"group": "kvscope-cache", "reason": "misfire", "count": 0, "last_due_at": None},
        {"group": "kvscope-cache", "reason": "overrun", "count": 3, "last_due_at": 1_800_000_000.0},
    ]
    at = page(agent, monkeypatch)
    ok(at)
    assert at.warning[0].value.startswith("3 rule evaluation(s) were due and did not run")
    missed = at.dataframe[1].value  # after the firing and pending table
    assert missed.values.tolist() == [["kvscope-cache", "overrun", 3, "2027-01-15 08:00:00"]]
    agent.app.state.missed_evaluations = lambda: [{"group": "kvscope-cache", "reason": "overrun", "count": 0, "last_due_at": None}]
    assert "No rule evaluation was missed" in " ".join(c.value for c in page(agent, monkeypatch).caption)


def test_rules_without_data_say_so_with_their_volume(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = page(agent, monkeypatch)
    ok(at)
    assert any(c.value.startswith("Rule evaluations: unknown") for c in at.caption)  # no rule scheduler
    detail = "4,120 prompt tokens in the 5m window and 0 in its baseline; needs 10,000 in each"
    agent.app.state.rule_health = lambda: [
        {"alert": "RecoverableHitRateDrop", "kind": "recoverable_hit_rate_drop", "evaluated_at": 1_800_000_060.0, "series": 1,
         "no_data": [{"labels": {"engine": "e1", "model": "m1"}, "detail": detail, "since": 1_800_000_000.0}]},
        {"alert": "EngineSilent", "kind": "engine_silent", "evaluated_at": 1_800_000_060.0, "series": 1, "no_data": []},
        {"alert": "IngestStalled", "kind": "ingest_stalled", "evaluated_at": None, "series": 0, "no_data": []},
    ]  # fmt: skip
    at = page(agent, monkeypatch)
    ok(at)
    assert any(w.value.startswith("1 rule(s) lack the volume to judge some series") for w in at.warning)
    (rules,) = [d.value for d in at.dataframe if "detail" in d.value.columns]
    assert rules[["state", "alert", "labels"]].values.tolist() == [
        ["no data", "RecoverableHitRateDrop", "engine=e1, model=m1"], ["ok", "EngineSilent", ""], ["not evaluated yet", "IngestStalled", ""],
    ]  # fmt: skip
    assert rules["detail"].iloc[0] == f"{detail} (since 2027-01-15 08:00:00)"
