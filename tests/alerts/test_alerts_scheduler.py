"""The minute job against a real store: windows, persistence, log receiver, gauge, restart."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from agent.ingest import ingest_batch
from agent.metrics import AgentMetrics
from agent.store import Store, utc_now
from alerts.evaluator import AlertStatus, fingerprint
from alerts.rules import RecoverableHitRateRule
from alerts.scheduler import AlertScheduler, load_state
from engine.events import decode_batch

T = 1_700_000_040.0  # a minute boundary
RULE = RecoverableHitRateRule(threshold=0.5, window_seconds=60, min_prompt_tokens=1000)
FP = fingerprint(RULE.name, {"engine": "e1", "model": "m1", "severity": "page"})


def add_requests(store: Store, seq: int, *requests: tuple[float, int, int]) -> None:
    """Store requests of engine e1 / model m1 given as (ts, prompt_tokens, recoverable_tokens)."""
    events = [
        {
            "kind": "request",
            "ts": ts,
            "engine_id": "e1",
            "request_id": f"r{seq}-{i}",
            "model": "m1",
            "prompt_tokens": prompt,
            "output_tokens": 1,
            "hash_hit_tokens": recoverable,
            "resume_tokens": recoverable,
            "recoverable_tokens": recoverable,
            "replayed_tokens": 0,
            "recomputed_tokens": prompt - recoverable,
            "admission": "exact",
            "ttft_seconds": 0.1,
            "e2e_seconds": 0.2,
        }
        for i, (ts, prompt, recoverable) in enumerate(requests)
    ]
    body = msgspec.json.encode(
        {"schema_version": 1, "engine_id": "e1", "seq": seq, "sent_at": T, "events": events}
    )
    assert ingest_batch(store, decode_batch(body), received_at=utc_now()).status == "stored"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store.open(tmp_path / "kvscope.duckdb")
    yield opened
    opened.close()


def scheduler(store: Store, tmp_path: Path, metrics: AgentMetrics | None = None) -> AlertScheduler:
    return AlertScheduler(
        store=store,
        rules=(RULE,),
        log_path=tmp_path / "alerts.log",
        metrics=metrics,
        ingest_lag_seconds=5,
        clock=lambda: T,
    )


def log_lines(tmp_path: Path) -> list[dict[str, object]]:
    path = tmp_path / "alerts.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def alert_rows(store: Store) -> list[tuple[object, ...]]:
    with store.cursor() as cur:
        return cur.execute(
            "SELECT ts, alert, fingerprint, state, value, labels FROM alerts ORDER BY ts"
        ).fetchall()


def naive(unix_seconds: float) -> datetime:
    return datetime.fromtimestamp(unix_seconds, UTC).replace(tzinfo=None)


def test_window_fire_persist_log_gauge_then_resolve(store: Store, tmp_path: Path) -> None:
    metrics = AgentMetrics()
    job = scheduler(store, tmp_path, metrics)
    # Window at T is [T-65, T-5): the requests at T-66 and T-5 are outside it.
    add_requests(
        store, 1, (T - 66, 5000, 4000), (T - 65, 1000, 300), (T - 6, 1000, 300), (T - 5, 5000, 4000)
    )
    notes = job.run_once()  # the clock says T
    assert [(n.status, n.value, n.at) for n in notes] == [(AlertStatus.FIRING, 0.3, T)]
    labels = '{"engine": "e1", "model": "m1", "severity": "page"}'
    assert alert_rows(store) == [(naive(T), "RecoverableHitRateLow", FP, "firing", 0.3, labels)]
    assert log_lines(tmp_path) == [
        {
            "at": T,
            "alert": "RecoverableHitRateLow",
            "fingerprint": FP,
            "status": "firing",
            "labels": {"engine": "e1", "model": "m1", "severity": "page"},
            "value": 0.3,
            "summary": "Recoverable hit rate 30.0% (fires below 50%) on engine e1 model m1",
            "description": notes[0].description,
        }
    ]
    gauge = {"engine": "e1", "model": "m1"}
    assert metrics.registry.get_sample_value("kvscope_recoverable_hit_ratio", gauge) == 0.3

    # Next minute: the window [T-5, T+55) holds the 4000/5000 request at T-5: resolves once.
    assert [(n.status, n.value) for n in job.run_once(T + 60)] == [(AlertStatus.RESOLVED, 0.8)]
    assert metrics.registry.get_sample_value("kvscope_recoverable_hit_ratio", gauge) == 0.8
    # A minute without data: no notification, and the gauge series disappears.
    assert job.run_once(T + 120) == []
    assert metrics.registry.get_sample_value("kvscope_recoverable_hit_ratio", gauge) is None
    assert [row[3] for row in alert_rows(store)] == ["firing", "resolved"]
    assert [line["status"] for line in log_lines(tmp_path)] == ["firing", "resolved"]


def test_restart_restores_state_without_repaging(tmp_path: Path) -> None:
    path = tmp_path / "kvscope.duckdb"
    with Store.open(path) as store:
        add_requests(store, 1, (T - 30, 2000, 400))
        first = scheduler(store, tmp_path)
        assert [n.status for n in first.run_once()] == [AlertStatus.FIRING]

    with Store.open(path) as store:  # a restarted agent
        restored = load_state(store)
        assert restored[FP].status == AlertStatus.FIRING
        assert restored[FP].since == T
        assert restored[FP].labels == {"engine": "e1", "model": "m1", "severity": "page"}
        second = scheduler(store, tmp_path)
        second.restore()
        assert second.state == restored
        add_requests(store, 2, (T + 30, 2000, 200))
        assert second.run_once(T + 60) == []  # still low: no second page
        add_requests(store, 3, (T + 90, 2000, 1800))
        assert [n.status for n in second.run_once(T + 120)] == [AlertStatus.RESOLVED]
        assert [line["status"] for line in log_lines(tmp_path)] == ["firing", "resolved"]


def test_scheduled_job_runs_on_an_interval(store: Store, tmp_path: Path) -> None:
    add_requests(store, 1, (T - 30, 2000, 400))
    ran = threading.Event()
    job = AlertScheduler(
        store=store,
        rules=(RULE,),
        log_path=tmp_path / "alerts.log",
        interval_seconds=0.05,
        clock=lambda: (ran.set(), T)[1],
    )
    job.start()
    try:
        assert ran.wait(timeout=10.0), "the job never ran"
    finally:
        job.shutdown()
    job.shutdown()  # idempotent
    # Every run saw the same clock and data: exactly one page however often it ran.
    assert [line["status"] for line in log_lines(tmp_path)] == ["firing"]
    assert [row[3] for row in alert_rows(store)] == ["firing"]


def test_triggers() -> None:
    with Store.open(":memory:") as store:
        minute = AlertScheduler(
            store=store, rules=(RULE,), log_path=Path("unused.log"), ingest_lag_seconds=7
        )
        trigger = minute.trigger
        assert isinstance(trigger, CronTrigger)
        now = datetime(2024, 1, 1, 0, 0, 8, tzinfo=UTC)
        assert trigger.get_next_fire_time(None, now) == datetime(2024, 1, 1, 0, 1, 7, tzinfo=UTC)
        fast = AlertScheduler(
            store=store, rules=(RULE,), log_path=Path("unused.log"), interval_seconds=2
        )
        assert isinstance(fast.trigger, IntervalTrigger)
        with pytest.raises(ValueError, match="ingest_lag_seconds must be in"):
            AlertScheduler(store=store, rules=(RULE,), log_path=Path("x"), ingest_lag_seconds=60)
        with pytest.raises(ValueError, match="rule names must be unique"):
            AlertScheduler(store=store, rules=(RULE, RULE), log_path=Path("x"))
