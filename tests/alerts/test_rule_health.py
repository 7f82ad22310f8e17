"""A rule that cannot judge a series says so — "no data" with the volume it saw — in the agent's
log (once per change) and in the scheduler's snapshot (``GET /v1/alerts/rules``)."""

from __future__ import annotations

import logging

import pytest

from alerts.rule_eval import DropInput, LatencyInput, ShareInput, Tokens
from alerts.rule_health import NO_SERIES, RuleHealth, no_data_detail
from alerts.rulefile import DEFAULT_RULES_PATH, load_rule_file

RULES = {r.alert: r for r in load_rule_file(DEFAULT_RULES_PATH).rules}
KEY = (("engine", "e1"), ("model", "m1"))


def test_the_detail_names_the_volume_seen_and_needed() -> None:
    drop = RULES["RecoverableHitRateDrop"]
    assert no_data_detail(drop, DropInput(Tokens(3000, 4120), Tokens(0, 0))) == "4,120 prompt tokens in the 5m window and 0 in its baseline; needs 10,000 in each"
    assert no_data_detail(drop, DropInput(Tokens(9000, 10_000), Tokens(9000, 10_000))) is None
    spike = RULES["FormInvalidationSpike"]
    assert no_data_detail(spike, ShareInput(1, 40, 0, 500)) == "40 lookups of the form in the 5m window and 500 in its baseline; needs 100 in each"
    latency = RULES["RecoveryLatencyHigh"]
    assert no_data_detail(latency, LatencyInput((0.1,), (3, 5))) == "5 recoveries in the 5m window; needs 20"
    slo = RULES["RecoverableHitRateSLO"]
    from alerts.rule_eval import BurnInput

    enough = (Tokens(0, 100_000), Tokens(0, 20_000))
    detail = no_data_detail(slo, BurnInput((enough, enough, (Tokens(0, 20_000), Tokens(0, 20_000)))))
    assert detail == "prompt tokens 3d/6h: 20,000 in the short window, 0 before it in the long one; needs 10,000 in each"
    assert no_data_detail(RULES["EngineSilent"], None) is None  # silence is the signal: never no data


def test_entering_and_leaving_no_data_is_logged_once_and_served(caplog: pytest.LogCaptureFixture) -> None:
    health, drop = RuleHealth(), RULES["RecoverableHitRateDrop"]
    thin = {KEY: DropInput(Tokens(3000, 4120), Tokens(0, 0))}
    with caplog.at_level(logging.INFO, logger="alerts.rule_health"):
        health.observe(drop, thin, 100.0)
        health.observe(drop, thin, 160.0)  # still no data: not logged again
        [entry] = health.snapshot([drop])[0]["no_data"]
        assert entry == {"labels": {"engine": "e1", "model": "m1"}, "detail": "4,120 prompt tokens in the 5m window and 0 in its baseline; needs 10,000 in each", "since": 100.0}
        health.observe(drop, {KEY: DropInput(Tokens(9000, 20_000), Tokens(9000, 20_000))}, 220.0)
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert messages == [
        ("WARNING", "alert rule RecoverableHitRateDrop has no data for engine=e1, model=m1: 4,120 prompt tokens in the 5m window and 0 in its baseline; needs 10,000 in each"),
        ("INFO", "alert rule RecoverableHitRateDrop has data again for engine=e1, model=m1"),
    ]  # fmt: skip
    assert health.snapshot([drop]) == [{"alert": "RecoverableHitRateDrop", "kind": "recoverable_hit_rate_drop", "evaluated_at": 220.0, "series": 1, "no_data": []}]


def test_a_rule_without_any_series_has_one_no_data_entry() -> None:
    health, spike = RuleHealth(), RULES["FormInvalidationSpike"]
    assert health.snapshot([spike])[0]["evaluated_at"] is None
    health.observe(spike, {}, 50.0)
    assert health.snapshot([spike])[0]["no_data"] == [{"labels": {}, "detail": NO_SERIES, "since": 50.0}]
