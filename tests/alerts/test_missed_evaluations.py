"""Rule-group evaluations due and not run (issue 19): APScheduler's misfire, overrun and
coalesced run times counted in ``kvscope_alert_evaluations_missed_total`` and answered by
``GET /v1/alerts/missed-evaluations``."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from apscheduler.events import (
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_MISSED,
    EVENT_JOB_SUBMITTED,
    JobExecutionEvent,
    JobSubmissionEvent,
)
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from agent.app import create_app
from agent.config import AgentConfig
from agent.metrics import AgentMetrics
from agent.store import Store
from alerts.missed_evaluations import MissedEvaluations
from alerts.rule_scheduler import RuleScheduler
from alerts.rulefile import RuleGroup, parse_rule_file

T0 = datetime(2027, 1, 15, 8, 0, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


def sample(registry: CollectorRegistry, group: str, reason: str) -> float | None:
    return registry.get_sample_value("kvscope_alert_evaluations_missed_total", {"group": group, "reason": reason})


def test_misfires_overruns_and_coalesced_run_times_are_counted() -> None:
    registry = CollectorRegistry()
    missed = MissedEvaluations(registry)
    missed.track("job-g", group="g", interval_seconds=60)
    assert [sample(registry, "g", r) for r in ("misfire", "overrun", "coalesced")] == [0.0, 0.0, 0.0]
    events = [
        JobSubmissionEvent(EVENT_JOB_SUBMITTED, "job-g", "default", [T0]),
        JobSubmissionEvent(EVENT_JOB_SUBMITTED, "job-g", "default", [T0 + MINUTE]),  # on time
        JobSubmissionEvent(EVENT_JOB_SUBMITTED, "job-g", "default", [T0 + 4 * MINUTE]),  # 2 coalesced after a stall
        JobSubmissionEvent(EVENT_JOB_MAX_INSTANCES, "job-g", "default", [T0 + 5 * MINUTE]),  # the last one still ran
        JobSubmissionEvent(EVENT_JOB_SUBMITTED, "job-g", "default", [T0 + 6 * MINUTE]),
        JobExecutionEvent(EVENT_JOB_MISSED, "job-g", "default", T0 + 6 * MINUTE),  # ... and too late to run
        JobSubmissionEvent(EVENT_JOB_MAX_INSTANCES, "other", "default", [T0]),  # not a tracked job
    ]
    for event in events:
        missed.on_event(event)
    assert [sample(registry, "g", r) for r in ("misfire", "overrun", "coalesced")] == [1.0, 1.0, 2.0]
    assert missed.counts() == [
        {"group": "g", "reason": "coalesced", "count": 2, "last_due_at": (T0 + 4 * MINUTE).timestamp()},
        {"group": "g", "reason": "misfire", "count": 1, "last_due_at": (T0 + 6 * MINUTE).timestamp()},
        {"group": "g", "reason": "overrun", "count": 1, "last_due_at": (T0 + 5 * MINUTE).timestamp()},
    ]
    with pytest.raises(ValueError, match="interval_seconds must be positive, got 0"):
        missed.track("job-h", group="h", interval_seconds=0)


def test_an_evaluation_slower_than_its_interval_is_counted_as_overrun(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The real scheduler: a group's evaluation blocks past its 100 ms interval, so the next run
    times find it still running (APScheduler's EVENT_JOB_MAX_INSTANCES)."""
    silent = {"alert": "Quiet", "kind": "ingest_stalled", "silent_for": "1m", "labels": {"severity": "page"}}
    rules = parse_rule_file({"groups": [{"name": "slow", "interval": "100ms", "rules": [silent]}]})
    registry = CollectorRegistry()
    release, entered = threading.Event(), threading.Event()
    with Store.open(tmp_path / "k.duckdb") as store:
        sched = RuleScheduler(store=store, rules=rules, log_path=tmp_path / "alerts.log", registry=registry)

        def stuck(group: RuleGroup, now: float | None = None) -> list[object]:
            entered.set()
            release.wait(30)
            return []

        sched.run_group = stuck  # type: ignore[method-assign]
        sched.start()
        try:
            deadline = time.monotonic() + 20
            while not sample(registry, "slow", "overrun"):
                assert time.monotonic() < deadline, "no overrun counted"
                time.sleep(0.02)
        finally:
            release.set()
            sched.shutdown()
    assert entered.is_set()
    [overrun] = [m for m in sched.missed.counts() if m["reason"] == "overrun"]
    assert overrun["group"] == "slow" and overrun["count"] >= 1
    assert "rule group slow:" in caplog.text and "(overrun;" in caplog.text


def test_the_api_answers_the_counts(tmp_path: Path) -> None:
    config = AgentConfig(data_dir=tmp_path / "data", decode_processes=0)
    with Store.open(config.db_path) as store, TestClient(create_app(config, store, metrics=AgentMetrics(), environ={})) as client:
        _answers(client)


def _answers(client: TestClient) -> None:
    assert client.get("/v1/alerts/missed-evaluations").status_code == 503  # no rule scheduler in this app
    registry = CollectorRegistry()
    missed = MissedEvaluations(registry)
    missed.track("job-g", group="g", interval_seconds=60)
    missed.on_event(JobSubmissionEvent(EVENT_JOB_MAX_INSTANCES, "job-g", "default", [T0]))
    client.app.state.missed_evaluations = missed.counts  # type: ignore[attr-defined]
    answer = client.get("/v1/alerts/missed-evaluations").json()["missed"]
    assert [(m["group"], m["reason"], m["count"]) for m in answer] == [("g", "coalesced", 0), ("g", "misfire", 0), ("g", "overrun", 1)]
