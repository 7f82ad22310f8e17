"""The pure evaluator against golden time series of (now, data) steps."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import pytest

from alerts.evaluator import (
    AlertState,
    AlertStatus,
    Measurement,
    Notification,
    evaluate,
    fingerprint,
)
from alerts.rules import RecoverableHitRateRule

RULE = RecoverableHitRateRule(threshold=0.5, window_seconds=60, min_prompt_tokens=1000)
KEY = ("e1", "m1")
LABELS = {"engine": "e1", "model": "m1", "severity": "page"}
FP = fingerprint("RecoverableHitRateLow", LABELS)
T0 = 1_700_000_000.0


def m(recoverable: int, prompt: int) -> Measurement:
    return Measurement(recoverable_tokens=recoverable, prompt_tokens=prompt)


@dataclass(frozen=True)
class Step:
    """One evaluation: the window's measurement (None: series absent), the expected status of
    the alert afterwards (None: no state), and the expected notification status, if any."""

    measurement: Measurement | None
    status: AlertStatus | None
    notified: AlertStatus | None


F, R = AlertStatus.FIRING, AlertStatus.RESOLVED

GOLDEN = [
    Step(m(900, 1000), None, None),  # 90%: fine, no state
    Step(m(800, 2000), F, F),  # 40% < 50%: fires once
    Step(m(600, 2000), F, None),  # 30%: still firing, no duplicate page
    Step(m(0, 999), F, None),  # below min volume: no data, stays firing (not 0%)
    Step(None, F, None),  # absent: no data, stays firing
    Step(m(499, 1000), F, None),  # 49.9%: still below
    Step(m(500, 1000), R, R),  # exactly the threshold: resolves once
    Step(m(990, 1000), R, None),  # stays resolved, no notification
    Step(m(0, 500), R, None),  # 0 recoverable but no volume: no data, not 0%
    Step(m(100, 1000), F, F),  # fires again: a new transition, a new notification
]


def test_golden_series() -> None:
    state: dict[str, AlertState] = {}
    sent: list[Notification] = []
    for i, step in enumerate(GOLDEN):
        now = T0 + 60 * i
        data = {RULE.name: {KEY: step.measurement} if step.measurement else {}}
        previous, snapshot = state, dict(state)
        state, notifications = evaluate([RULE], data, now, previous)
        assert previous == snapshot, "evaluate must not modify previous_state"
        current = state.get(FP)
        assert (current.status if current else None) == step.status, f"step {i}"
        assert [n.status for n in notifications] == ([step.notified] if step.notified else []), (
            f"step {i}"
        )
        sent.extend(notifications)
    assert [(n.status, n.at, n.value) for n in sent] == [
        (F, T0 + 60, 0.4),
        (R, T0 + 360, 0.5),
        (F, T0 + 540, 0.1),
    ]
    first = sent[0]
    assert first.alert == "RecoverableHitRateLow"
    assert first.fingerprint == FP
    assert dict(first.labels) == LABELS
    assert first.summary == "Recoverable hit rate 40.0% (fires below 50%) on engine e1 model m1"
    assert first.description.startswith(
        "Over the last 60 s, 800 of 2000 prompt tokens were served from cache without "
        "recomputation (40.0%); the alert fires below 50%."
    )
    assert state[FP] == AlertState(
        alert="RecoverableHitRateLow",
        fingerprint=FP,
        labels=LABELS,
        status=F,
        since=T0 + 540,
        value=0.1,
    )


def test_firing_state_tracks_last_value_without_notifying() -> None:
    state, _ = evaluate([RULE], {RULE.name: {KEY: m(400, 1000)}}, T0, {})
    state, notifications = evaluate([RULE], {RULE.name: {KEY: m(300, 1000)}}, T0 + 60, state)
    assert notifications == []
    assert (state[FP].since, state[FP].value) == (T0, 0.3)


def test_series_are_independent_and_ordered() -> None:
    data = {
        RULE.name: {
            ("e2", "m1"): m(100, 1000),
            ("e1", "m1"): m(200, 1000),
            ("e3", "m1"): m(900, 1000),
        }
    }
    state, notifications = evaluate([RULE], data, T0, {})
    assert [(n.labels["engine"], n.value) for n in notifications] == [("e1", 0.2), ("e2", 0.1)]
    assert len(state) == 2
    assert len({n.fingerprint for n in notifications}) == 2


def test_state_of_other_rules_is_carried_over() -> None:
    other = AlertState(alert="Other", fingerprint="abc", labels={}, status=F, since=T0, value=None)
    state, notifications = evaluate([RULE], {}, T0, {"abc": other})
    assert state == {"abc": other}
    assert notifications == []


def test_fingerprint_is_stable_and_label_order_free() -> None:
    expected = hashlib.sha256(
        json.dumps(
            ["RecoverableHitRateLow", [["engine", "e1"], ["model", "m1"], ["severity", "page"]]],
            separators=(",", ":"),
        ).encode()
    ).hexdigest()
    assert expected == FP
    reordered = {"severity": "page", "model": "m1", "engine": "e1"}
    assert fingerprint("RecoverableHitRateLow", reordered) == FP
    assert fingerprint("RecoverableHitRateLow", {**LABELS, "engine": "e2"}) != FP
    assert fingerprint("OtherRule", LABELS) != FP


def test_measurement_validation() -> None:
    with pytest.raises(ValueError, match="recoverable_tokens <= prompt_tokens"):
        Measurement(recoverable_tokens=5, prompt_tokens=4)
    assert Measurement(recoverable_tokens=0, prompt_tokens=0).ratio is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"threshold": 0.0}, "threshold must be a ratio in (0, 1], got 0.0"),
        ({"window_seconds": 0}, "window_seconds must be >= 1, got 0"),
        ({"min_prompt_tokens": 0}, "min_prompt_tokens must be >= 1, got 0"),
        ({"severity": "urgent"}, "severity must be one of"),
        ({"summary": "{engine.__class__}"}, "unknown placeholder {engine.__class__}"),
        ({"description": "{nope}"}, "unknown placeholder {nope}"),
        ({"name": ""}, "name must be a non-empty identifier"),
    ],
)
def test_rule_validation(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        RecoverableHitRateRule(**changes)  # type: ignore[arg-type]
    assert message in str(info.value)
