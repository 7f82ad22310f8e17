"""Rule queries never pile up (issue 19): an ``expr`` query answered as timed out goes on in its
worker thread (DuckDB cannot stop one long function call at once), and while it runs its rule is
skipped — a rule failure, with the reason in the log — instead of starting a second query."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent import sql
from agent.deadline import StillRunning, run_in_worker
from agent.store import Store
from alerts import inputs
from alerts.rule_eval import Status
from alerts.rule_scheduler import RuleScheduler
from alerts.rulefile import parse_rule_file

T = 1_800_000_000.0
SLOW = {"alert": "Slow", "expr": "SELECT 'e1' AS engine, 1.0 AS value", "labels": {"severity": "page"}}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store.open(tmp_path / "k.duckdb")
    yield opened
    opened.close()


class StuckOnce:
    """``run_read_query`` whose first query outlives its 408 until :attr:`release` is set (as one
    long DuckDB function call does); later calls are the real query."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()
        self.ended = threading.Event()
        self.real = sql.run_read_query

    def __call__(self, store: Store, text: str, params: Any = None, *, on_done: Callable[[], None], **limits: Any) -> sql.ResultSet:
        self.calls += 1
        if self.calls > 1:
            return self.real(store, text, params, on_done=on_done, **limits)

        def done() -> None:
            on_done()
            self.ended.set()

        try:
            run_in_worker(lambda: self.release.wait(30), wait_seconds=0.01, on_done=done)
        except StillRunning:
            raise sql.SqlTimeout("query exceeded the time limit of 0.01 s") from None
        raise AssertionError("the stuck query ended before its limit")


def test_a_rule_whose_previous_query_still_runs_is_skipped(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stuck = StuckOnce()
    monkeypatch.setattr(inputs.sql, "run_read_query", stuck)
    rule_file = parse_rule_file({"groups": [{"name": "g", "interval": "1h", "rules": [SLOW]}]})
    sched = RuleScheduler(store=store, rules=rule_file, log_path=tmp_path / "alerts.log", registry=CollectorRegistry(), clock=lambda: T)
    sched.restore(T)
    group = rule_file.groups[0]
    failures = sched.failures.labels(alert="Slow")
    try:
        assert sched.run_group(group, T) == []  # 408: skipped, its query runs on
        assert failures._value.get() == 1.0 and stuck.calls == 1
        with caplog.at_level(logging.ERROR, logger="alerts.rule_scheduler"):
            assert sched.run_group(group, T + 60) == []
        assert stuck.calls == 1  # no second query while the first still runs
        assert failures._value.get() == 2.0
        assert "rule Slow: skipped: its previous query still runs" in caplog.text
    finally:
        stuck.release.set()
    deadline = time.monotonic() + 10
    while not stuck.ended.is_set():  # the worker's on_done frees the rule
        assert time.monotonic() < deadline, "the stuck query never ended"
        time.sleep(0.01)
    [note] = sched.run_group(group, T + 120)
    assert (note.alert, note.status, stuck.calls) == ("Slow", Status.FIRING, 2)
    assert failures._value.get() == 2.0
