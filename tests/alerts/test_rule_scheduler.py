"""Rule files on a schedule against a real store (issue 7, item 3): persisted state, a restart
while pending, removed rules, failing queries, the background job."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from agent.ingest import ingest_batch
from agent.store import Store, to_timestamp
from alerts.alert_store import load_rule_state
from alerts.rule_eval import Status
from alerts.rule_scheduler import RuleScheduler
from alerts.rulefile import parse_rule_file
from engine.events import decode_batch

T = 1_800_000_000.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store.open(tmp_path / "k.duckdb")
    yield opened
    opened.close()


def rules(*extra: dict[str, Any], interval: str | None = None) -> Any:
    drop = {
        "alert": "Drop", "kind": "recoverable_hit_rate_drop", "min_prompt_tokens": 1000, "for": "2m",
        "labels": {"severity": "page"}, "annotations": {"summary": "{{ $labels.engine }} at {{ $value }}"},
    }  # fmt: skip
    group: dict[str, Any] = {"name": "g", "rules": [drop, *extra]}
    if interval:
        group["interval"] = interval
    return parse_rule_file({"groups": [group]})


SEQ = iter(range(1000))


def requests(store: Store, *items: tuple[float, int, int], received: float = T) -> None:
    events = [
        {
            "kind": "request", "ts": ts, "engine_id": "e1", "request_id": f"r{ts}", "model": "m1",
            "prompt_tokens": prompt, "output_tokens": 1, "hash_hit_tokens": rec, "resume_tokens": max(rec - 1, 0),
            "recoverable_tokens": rec, "replayed_tokens": 0, "recomputed_tokens": prompt - rec,
            "admission": "exact", "ttft_seconds": 0.1, "e2e_seconds": 0.2,
        }
        for ts, prompt, rec in items
    ]
    body = msgspec.json.encode({"schema_version": 1, "engine_id": "e1", "seq": next(SEQ), "sent_at": T, "events": events})
    assert ingest_batch(store, decode_batch(body), received_at=to_timestamp(received)).status == "stored"


def scheduler(store: Store, tmp_path: Path, rule_file: Any) -> RuleScheduler:
    return RuleScheduler(store=store, rules=rule_file, log_path=tmp_path / "alerts.log", registry=CollectorRegistry())


def test_a_restart_while_pending_keeps_the_pending_time(store: Store, tmp_path: Path) -> None:
    # a drop from 0.9 to 0.3, lasting: pending at T, firing at T + 120 even across a restart
    requests(store, *((T - 600 - 60 * i, 1000, 900) for i in range(10)), *((T - 10 - 60 * i, 1000, 300) for i in range(5)))
    first = scheduler(store, tmp_path, rules())
    first.restore(T)
    assert first.run_group(first.rules.groups[0], T) == []
    [(fp, pending)] = load_rule_state(store).items()
    assert (pending.status, pending.active_since) == (Status.PENDING, T)
    requests(store, (T + 50, 1000, 300), (T + 110, 1000, 300))
    second = scheduler(store, tmp_path, rules())  # the agent restarted
    assert second.restore(T + 60) == []
    assert second.run_group(second.rules.groups[0], T + 60) == []
    notes = second.run_group(second.rules.groups[0], T + 120)
    assert [(n.status, n.annotations["summary"]) for n in notes] == [(Status.FIRING, "e1 at 0.3")]
    assert load_rule_state(store)[fp].status == Status.FIRING
    with store.cursor() as cur:
        assert cur.execute("SELECT alert, state, summary FROM alerts").fetchall() == [("Drop", "firing", "e1 at 0.3")]
    lines = [json.loads(line) for line in (tmp_path / "alerts.log").read_text().splitlines()]
    assert [(line["alert"], line["status"], line["labels"]["engine"]) for line in lines] == [("Drop", "firing", "e1")]


def test_a_removed_rule_resolves_at_restore(store: Store, tmp_path: Path) -> None:
    requests(store, *((T - 600 - 60 * i, 1000, 900) for i in range(10)), *((T - 10 - 60 * i, 1000, 300) for i in range(5)))
    first = scheduler(store, tmp_path, rules())
    first.restore(T)
    first.run_group(first.rules.groups[0], T)
    first.run_group(first.rules.groups[0], T + 120)
    assert [st.status for st in load_rule_state(store).values()] == [Status.FIRING]
    silent = {"alert": "Quiet", "kind": "engine_silent", "labels": {"severity": "ticket"}}
    edited = parse_rule_file({"groups": [{"name": "g", "rules": [silent]}]})
    notes = scheduler(store, tmp_path, edited).restore(T + 180)
    assert [(n.alert, n.status) for n in notes] == [("Drop", Status.RESOLVED)]
    assert load_rule_state(store) == {}


def test_a_failing_query_skips_only_its_rule(store: Store, tmp_path: Path) -> None:
    broken = {"alert": "Broken", "expr": "SELECT 'x' AS engine", "labels": {"severity": "info"}}
    silent = {"alert": "Quiet", "kind": "ingest_stalled", "silent_for": "1m", "labels": {"severity": "page"}}
    requests(store, (T - 10, 1000, 900))
    sched = scheduler(store, tmp_path, rules(broken, silent))
    sched.restore(T)
    notes = sched.run_group(sched.rules.groups[0], T + 3600)
    assert [(n.alert, n.status) for n in notes] == [("Quiet", Status.FIRING)]
    assert sched.failures.labels(alert="Broken")._value.get() == 1.0


def test_the_background_job_runs_each_group(store: Store, tmp_path: Path) -> None:
    silent = {"alert": "Quiet", "kind": "ingest_stalled", "silent_for": "1m", "labels": {"severity": "page"}}
    now = time.time()
    requests(store, (now - 3600, 1000, 900), received=now - 3600)  # nothing for an hour
    sched = scheduler(store, tmp_path, parse_rule_file({"groups": [{"name": "fast", "interval": "200ms", "rules": [silent]}]}))
    sched.start()
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "alerts.log").exists():
            assert time.monotonic() < deadline, "the rule group never ran"
            time.sleep(0.05)
    finally:
        sched.shutdown()
    [line] = [json.loads(x) for x in (tmp_path / "alerts.log").read_text().splitlines()]
    assert (line["alert"], line["status"]) == ("Quiet", "firing")
    sched.start()  # a second start of the same scheduler is refused ...
    try:
        with pytest.raises(RuntimeError, match="already started"):
            sched.start()
    finally:
        sched.shutdown()


def test_each_evaluation_pushes_its_group_and_routes_every_alert(store: Store, tmp_path: Path) -> None:
    """After a group's evaluation its firing alerts go to the Alertmanager (every evaluation,
    leased for 4 intervals) and through the routing tree (once, then per repeat_interval); the
    ``kvscope_alerts`` gauge counts pending and firing alerts."""
    import httpx

    from alerts.notifier import Notifier
    from alerts.notify_config import parse_notify_config

    posts: list[tuple[str, Any]] = []

    def receive(request: httpx.Request) -> httpx.Response:
        posts.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200)

    notify = parse_notify_config(
        {
            "route": {"receiver": "hook", "group_wait": "0s", "group_interval": "1m", "repeat_interval": "1h"},
            "receivers": [{"name": "hook", "webhook_configs": [{"url": "http://hook.test/x"}]}],
            "alertmanagers": [{"url": "http://am.test"}],
        },
        source="n.yaml",
        data_dir=tmp_path,
    )
    registry = CollectorRegistry()
    notifier = Notifier(
        store=store, config=notify, registry=registry, external_url="http://agent",
        client=httpx.Client(transport=httpx.MockTransport(receive)),
    )  # fmt: skip
    drop = rules(interval="1m")
    sched = RuleScheduler(store=store, rules=drop, log_path=tmp_path / "alerts.log", registry=registry, notifier=notifier)
    requests(store, *((T - 600 - 60 * i, 1000, 900) for i in range(10)), *((T - 10 - 60 * i, 1000, 300) for i in range(5)))
    sched.restore(T)
    sched.run_group(drop.groups[0], T)
    assert posts == [] and registry.get_sample_value("kvscope_alerts", {"alertname": "Drop", "alertstate": "pending"}) == 1
    assert sched.active_alerts() == [
        {
            "alertname": "Drop", "state": "pending", "labels": {"engine": "e1", "model": "m1", "severity": "page"},
            "annotations": {"summary": "e1 at 0.3"}, "value": 0.3, "active_at": T, "firing_since": None,
        }
    ]  # fmt: skip
    requests(store, (T + 50, 1000, 300), (T + 110, 1000, 300))
    [fired] = sched.run_group(drop.groups[0], T + 120)
    assert fired.status == Status.FIRING
    assert [path for path, _ in posts] == ["/api/v2/alerts", "/x"]
    am_alert = posts[0][1][0]
    assert am_alert["labels"] == {"alertname": "Drop", "engine": "e1", "model": "m1", "severity": "page"}
    assert am_alert["annotations"] == {"summary": "e1 at 0.3"} and am_alert["endsAt"] == "2027-01-15T08:11:00Z"  # 4 × 1m + 5m
    assert posts[1][1]["alerts"][0]["fingerprint"] == fired.fingerprint
    sched.run_group(drop.groups[0], T + 180)
    assert [path for path, _ in posts] == ["/api/v2/alerts", "/x", "/api/v2/alerts"]  # re-pushed, not re-paged
    assert registry.get_sample_value("kvscope_alerts", {"alertname": "Drop", "alertstate": "firing"}) == 1


# -- regressions from the review --------------------------------------------------------------------
def test_bad_values_truncation_and_store_errors_skip_only_their_rule(store: Store, tmp_path: Path) -> None:
    silent = {"alert": "Quiet", "kind": "ingest_stalled", "silent_for": "1m", "labels": {"severity": "page"}}
    text = {"alert": "Text", "expr": "SELECT 'x' AS engine, 'high' AS value", "labels": {"severity": "info"}}
    many = {"alert": "Many", "expr": "SELECT i::VARCHAR AS engine, 1.0 AS value FROM range(3) t(i)", "labels": {"severity": "info"}}
    nan = {"alert": "Nan", "expr": "SELECT 'x' AS engine, 'nan'::DOUBLE AS value", "labels": {"severity": "info"}}
    requests(store, (T - 10, 1000, 900))
    sched = RuleScheduler(
        store=store, rules=rules(text, many, nan, silent), log_path=tmp_path / "alerts.log", registry=CollectorRegistry(), row_limit=2
    )
    sched.restore(T)
    with store.transaction() as cur:  # a store error for the drop rule's table
        cur.execute("ALTER TABLE requests RENAME TO requests_gone")
    notes = sched.run_group(sched.rules.groups[0], T + 3600)
    assert [(n.alert, n.status) for n in notes] == [("Quiet", Status.FIRING)]  # Nan: no data
    assert {a: sched.failures.labels(alert=a)._value.get() for a in ("Drop", "Text", "Many", "Nan")} == {
        "Drop": 1.0, "Text": 1.0, "Many": 1.0, "Nan": 0.0,
    }  # fmt: skip


def test_a_rule_whose_labels_changed_resolves_its_old_alert(store: Store, tmp_path: Path) -> None:
    requests(store, *((T - 600 - 60 * i, 1000, 900) for i in range(10)), *((T - 10 - 60 * i, 1000, 300) for i in range(5)))
    first = scheduler(store, tmp_path, rules())
    first.restore(T)
    first.run_group(first.rules.groups[0], T)
    first.run_group(first.rules.groups[0], T + 120)
    edited = rules()
    object.__setattr__(edited.groups[0].rules[0], "labels", {"severity": "ticket"})
    notes = scheduler(store, tmp_path, edited).restore(T + 180)
    assert [(n.status, n.labels["severity"]) for n in notes] == [(Status.RESOLVED, "page")]
    assert load_rule_state(store) == {}


def test_a_retired_engine_resolves_its_silence(store: Store, tmp_path: Path) -> None:
    silent = {"alert": "EngineGone", "kind": "engine_silent", "silent_for": "5m", "lookback": "1h", "labels": {"severity": "ticket"}}
    requests(store, (T - 10, 1000, 900), received=T)
    sched = scheduler(store, tmp_path, parse_rule_file({"groups": [{"name": "g", "rules": [silent]}]}))
    sched.restore(T)
    assert [n.status for n in sched.run_group(sched.rules.groups[0], T + 600)] == [Status.FIRING]
    assert [n.status for n in sched.run_group(sched.rules.groups[0], T + 7200)] == [Status.RESOLVED]
