"""``kvscope up --drill`` sized to the machine (:mod:`kvscope.drill`): the plan derived from a
calibration, its rule file loading as a real one, the watch's reading of the agent's transitions
and its verdicts, and a calibration of the tiny model on the bundled trace."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from alerts.rule_kinds import HitRateDrop
from alerts.rulefile import load_rule_file
from engine.cache import CacheConfig
from engine.trace.formats import load_trace
from engine.trace.replay import ReplayConfig
from kvscope.data import bundled_trace
from kvscope.drill import Calibration, DrillPlan, DrillWatch, calibrate


def test_a_fast_machine_gets_the_smallest_window_paced_by_the_arrivals() -> None:
    # 0.05 s per request, twice that when slowed, is faster than the 1 s longest arrival wait:
    # the window holds 5 requests at 1 s each, raised to the 10 s minimum
    plan = DrillPlan.derive(Calibration(requests=15, compute_seconds=0.75, prompt_tokens_per_request=2000.0), max_wait_seconds=1.0)
    assert (plan.window_seconds, plan.baseline_seconds, plan.interval_seconds, plan.for_seconds) == (10, 30, 1, 2)
    assert plan.min_prompt_tokens == 4000
    assert (plan.squeeze.start_seconds, plan.squeeze.duration_seconds) == (40, 3 * 10 + 2 + 2)


def test_a_slow_machine_gets_windows_that_still_hold_five_requests() -> None:
    # 3 s per request, 6 s slowed: 30 s windows (5 requests), every 3 s, for 6 s
    plan = DrillPlan.derive(Calibration(requests=5, compute_seconds=15.0, prompt_tokens_per_request=2500.0), max_wait_seconds=1.0)
    assert (plan.window_seconds, plan.baseline_seconds, plan.interval_seconds, plan.for_seconds) == (30, 90, 3, 6)
    assert plan.min_prompt_tokens == 5000
    assert (plan.squeeze.start_seconds, plan.squeeze.duration_seconds) == (120, 90 + 6 + 6)
    # a window at the slowed pace holds 5 requests, so about 2.5 times the floor's volume
    assert plan.window_seconds / (2 * 3.0) * 2500 >= 2.5 * plan.min_prompt_tokens


def test_a_long_arrival_wait_widens_the_window() -> None:
    plan = DrillPlan.derive(Calibration(requests=10, compute_seconds=1.0, prompt_tokens_per_request=1000.0), max_wait_seconds=4.0)
    assert plan.window_seconds == 20


def test_a_machine_too_slow_for_any_drill_is_told_so() -> None:
    with pytest.raises(ValueError, match="a drill window would need 1000 s"):
        DrillPlan.derive(Calibration(requests=3, compute_seconds=300.0, prompt_tokens_per_request=1000.0), max_wait_seconds=1.0)


def test_the_plans_rule_file_loads_as_a_rule_file(tmp_path: Path) -> None:
    plan = DrillPlan.derive(Calibration(requests=5, compute_seconds=15.0, prompt_tokens_per_request=2500.0), max_wait_seconds=1.0)
    path = tmp_path / "drill_rules.yaml"
    path.write_text(plan.rule_file_text())
    rules = load_rule_file(path)
    (group,) = rules.groups
    assert group.interval_seconds == 3.0
    (rule,) = group.rules
    assert rule.alert == "RecoverableHitRateDrop" and rule.kind == "recoverable_hit_rate_drop" and dict(rule.labels) == {"severity": "page"}
    assert rule.for_seconds == 6.0
    assert isinstance(rule.settings, HitRateDrop)
    assert (rule.settings.window, rule.settings.baseline_window, rule.settings.min_prompt_tokens) == (30.0, 90.0, 5000)
    assert path.read_text().startswith("# Written by kvscope up --drill for this machine's rate: 3.00 s per request")


class FakeAgent:
    """Answers the watch's ``POST /v1/sql`` with the transitions given."""

    def __init__(self, rows: list[list[Any]]) -> None:
        self.rows = rows
        self.queries: list[str] = []

    def sql(self, sql: str, fmt: str = "json") -> Any:
        self.queries.append(sql)
        rows = self.rows

        class Answer:
            def json(self) -> dict[str, Any]:
                return {"rows": rows}

        return Answer()


def watch_with(rows: list[list[Any]]) -> tuple[DrillWatch, FakeAgent]:
    plan = DrillPlan.derive(Calibration(requests=15, compute_seconds=0.75, prompt_tokens_per_request=2000.0), max_wait_seconds=1.0)
    agent = FakeAgent(rows)
    return DrillWatch(plan=plan, client=agent, stop=threading.Event()), agent  # type: ignore[arg-type]


def test_the_watch_times_the_page_from_the_squeeze_and_the_resolve_from_the_release() -> None:
    # an earlier resolve (before any firing) is not the drill's
    watch, agent = watch_with([["resolved", 1005.0], ["firing", 1017.5], ["resolved", 1060.0], ["firing", 1070.0]])
    watch.poll()
    assert agent.queries == []  # nothing asked before the squeeze began
    watch.on_squeeze(True, 1000.0)
    watch.on_squeeze(False, 1034.0)
    watch.poll()
    assert "event = 'transition'" in agent.queries[0] and "epoch(ts) >= 999.000" in agent.queries[0]
    assert (watch.fired_at, watch.resolved_at) == (1017.5, 1060.0)
    assert watch.verdict() is None
    doc = watch.to_json()
    assert (doc["detection_seconds"], doc["resolve_seconds"], doc["failure"]) == (17.5, 26.0, None)
    assert doc["plan"]["window_seconds"] == 10


@pytest.mark.parametrize(
    ("rows", "squeeze", "failure"),
    [
        ([], None, "the replay ended before the squeeze began"),
        ([], (1000.0, 1034.0), "no page: the alert never fired"),
        ([["firing", 1040.0], ["resolved", 1080.0]], (1000.0, 1034.0), "the alert fired only after the pool was released"),
        ([["firing", 1020.0]], (1000.0, 1034.0), "the alert paged but never resolved"),
    ],
)
def test_the_watch_says_why_a_drill_failed(rows: list[list[Any]], squeeze: tuple[float, float] | None, failure: str) -> None:
    watch, _ = watch_with(rows)
    if squeeze is not None:
        watch.on_squeeze(True, squeeze[0])
        watch.on_squeeze(False, squeeze[1])
    watch.poll()
    verdict = watch.verdict()
    assert verdict is not None and verdict.startswith(failure), verdict
    assert watch.to_json()["failure"] == verdict


def test_calibrating_the_tiny_model_on_the_bundled_trace() -> None:
    requests = load_trace(bundled_trace())
    calibration = calibrate(model="kvscope_hybrid-tiny", cache=CacheConfig(), config=ReplayConfig(), requests=requests, max_requests=4)
    assert calibration.requests == 3  # the first one pays the warm-up and is left out
    assert 0 < calibration.seconds_per_request < 20
    assert calibration.prompt_tokens_per_request > 100
