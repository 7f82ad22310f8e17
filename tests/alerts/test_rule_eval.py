"""Golden time series for the rule-file evaluator (issue 7, item 2): every built-in kind, with
pending/``for``/``keep_firing_for``, hysteresis, no data, restarts."""

from __future__ import annotations

import pytest

from alerts.rule_eval import (
    BurnInput,
    DropInput,
    LatencyInput,
    ShareInput,
    SilenceInput,
    Status,
    Tokens,
    evaluate,
    histogram_quantile,
)
from alerts.rulefile import Rule, parse_rule_file

ENGINE = (("engine", "e1"), ("model", "m1"))
MIN = 60.0


def rule(**fields: object) -> Rule:
    base: dict[str, object] = {"alert": "A", "labels": {"severity": "page"}, "annotations": {"summary": "{{ $labels.engine }} {{ $value }}"}}
    base.update(fields)
    return parse_rule_file({"groups": [{"name": "g", "rules": [base]}]}).rules[0]


def run(r: Rule, series: list[object], *, key: tuple[tuple[str, str], ...] = ENGINE) -> list[tuple[float, str]]:
    """Evaluate ``r`` once a minute over ``series`` (one input per minute); the notifications as
    (minute, status)."""
    state: dict = {}
    out: list[tuple[float, str]] = []
    for minute, value in enumerate(series):
        state, notes = evaluate([r], {r.alert: {key: value}}, minute * MIN, state)  # type: ignore[dict-item]
        out.extend((n.at / MIN, n.status.value) for n in notes)
    return out


def drop(current: float, baseline: float = 0.8, prompt: int = 20_000) -> DropInput:
    return DropInput(Tokens(round(current * prompt), prompt), Tokens(round(baseline * prompt), prompt))


DROP = {"kind": "recoverable_hit_rate_drop", "for": "2m", "keep_firing_for": "3m"}


def test_step_drop_fires_once_after_for_and_resolves_after_keep_firing_for() -> None:
    series = [drop(0.8)] * 5 + [drop(0.4)] * 10 + [drop(0.79)] * 10
    assert run(rule(**DROP), series) == [(7.0, "firing"), (18.0, "resolved")]


def test_slow_drift_fires_once_it_crosses_both_thresholds() -> None:
    # 0.80 → 0.50, one point a minute against a fixed baseline of 0.8: relative drop 0.3 and
    # absolute 0.1 are both reached at 0.56 (minute 24), firing 2 minutes later
    series = [drop(0.80 - 0.01 * m) for m in range(31)]
    assert run(rule(**DROP), series) == [(26.0, "firing")]


def test_a_flapping_series_pages_once() -> None:
    # around the fire threshold (0.56): 0.50 / 0.62 alternating; the clear thresholds
    # (0.15 relative → 0.68) keep it firing instead of resolving and re-paging
    series = [drop(0.8)] * 3 + [drop(0.50), drop(0.50), drop(0.50), drop(0.62)] * 6
    assert run(rule(**{**DROP, "keep_firing_for": "0"}), series) == [(5.0, "firing")]
    # a series that dips and fully recovers every other minute stays pending-then-inactive:
    # "for" never elapses, nothing pages
    assert run(rule(**DROP), [drop(0.8)] * 3 + [drop(0.50), drop(0.75)] * 8) == []


def test_a_data_gap_is_no_data_not_a_page() -> None:
    quiet = drop(0.0, prompt=100)  # below min_prompt_tokens: no data, even at 0 %
    assert run(rule(**DROP), [drop(0.8)] * 3 + [quiet] * 10 + [drop(0.8)] * 3) == []
    # a gap resets pending; a firing alert stays firing through a gap (silence is not recovery)
    series = [drop(0.4)] * 3 + [quiet] * 3 + [drop(0.79)] * 4
    assert run(rule(**DROP), series) == [(2.0, "firing"), (9.0, "resolved")]
    assert run(rule(**DROP), [drop(0.4), quiet, drop(0.4), quiet, drop(0.4)]) == []


def test_a_firing_alert_without_data_for_an_hour_resolves() -> None:
    """An engine restarted under a new id leaves its old series without data for good: its
    firing alert resolves once the series has had no data for an hour, not before."""
    r = rule(**DROP)
    state, notes = evaluate([r], {"A": {ENGINE: drop(0.4)}}, 0.0, {})
    state, notes = evaluate([r], {"A": {ENGINE: drop(0.4)}}, 120.0, state)
    assert [n.status for n in notes] == [Status.FIRING]
    for t in range(180, 120 + 3600, 60):
        state, notes = evaluate([r], {"A": {}}, float(t), state)
        assert notes == [], t
    state, notes = evaluate([r], {"A": {}}, 120.0 + 3600, state)
    assert [(n.status, n.value) for n in notes] == [(Status.RESOLVED, 0.4)]


def test_an_engine_restart_that_zeroes_its_sums_is_no_data() -> None:
    restarted = DropInput(Tokens(0, 0), Tokens(16_000, 20_000))
    assert run(rule(**DROP), [drop(0.8)] * 3 + [restarted] * 3 + [drop(0.8)] * 3) == []


def test_a_restart_while_pending_keeps_the_pending_time() -> None:
    r = rule(**DROP)
    state, notes = evaluate([r], {"A": {ENGINE: drop(0.4)}}, 0.0, {})
    assert notes == [] and next(iter(state.values())).status == Status.PENDING
    reloaded = dict(state)  # what the scheduler persists and restores
    state, notes = evaluate([r], {"A": {ENGINE: drop(0.4)}}, 60.0, reloaded)
    assert notes == []
    state, notes = evaluate([r], {"A": {ENGINE: drop(0.4)}}, 120.0, state)
    assert [n.status for n in notes] == [Status.FIRING]
    assert notes[0].annotations == {"summary": "e1 0.4"}
    assert notes[0].labels == {"engine": "e1", "model": "m1", "severity": "page"}


def test_burn_rate_windows_are_separate_alerts_with_their_severity() -> None:
    r = rule(kind="recoverable_hit_rate_below", objective=0.95, min_prompt_tokens=100)
    healthy = Tokens(980, 1000)  # error 2 % = 0.4x the budget of 5 %
    burning = Tokens(500, 1000)  # error 50 % = 10x: above 6, below 14.4
    burning_long = Tokens(1000, 2000)  # the long window: the short one's 1000 tokens and 1000 before
    healthy_long = Tokens(1960, 2000)
    fast = BurnInput(((burning_long, burning), (burning_long, burning), (healthy_long, healthy)))
    state, notes = evaluate([r], {"A": {ENGINE: fast}}, 0.0, {})
    assert [(n.labels["window"], n.labels["severity"], n.value) for n in notes] == [("6h/30m", "page", pytest.approx(10.0))]
    calm = BurnInput(((healthy_long, healthy),) * 3)
    state, notes = evaluate([r], {"A": {ENGINE: calm}}, 60.0, state)
    assert [(n.labels["window"], n.status) for n in notes] == [("6h/30m", Status.RESOLVED)]
    state, notes = evaluate([r], {"A": {ENGINE: None}}, 120.0, state)
    assert notes == []
    on_fire = BurnInput(((Tokens(0, 2000), Tokens(0, 1000)),) * 3)  # 20x burns every window
    # a series younger than its short window (all of the long window's volume is in the short
    # one: a fresh engine's cold start) is no data, however bad it looks
    young = BurnInput(((Tokens(0, 1000), Tokens(0, 1000)),) * 3)
    assert evaluate([r], {"A": {ENGINE: young}}, 180.0, state)[1] == []
    state, notes = evaluate([r], {"A": {ENGINE: on_fire}}, 180.0, state)
    assert sorted(n.labels["window"] for n in notes) == ["1h/5m", "3d/6h", "6h/30m"]


def test_invalidation_spike_and_recovery_latency_and_silence() -> None:
    spike = rule(kind="form_invalidation_spike", min_lookups=10)
    key = (("engine", "e1"), ("form", "swa_window"), ("reason", "swa_evicted"))
    assert run(spike, [ShareInput(1, 100, 5, 500), ShareInput(40, 100, 5, 500), ShareInput(3, 5, 5, 500)], key=key) == [(1.0, "firing")]
    # a baseline without volume is no data, not a 0 % baseline: a steady share never fires
    assert run(spike, [ShareInput(30, 100, 0, 0), ShareInput(30, 100, 1, 1)], key=key) == []
    bounds = (0.1, 0.25, 0.5, 1.0)
    slow = LatencyInput(bounds, (10, 40, 60, 100, 100))  # p95 in the (0.5, 1] bucket: 0.875 s
    fast = LatencyInput(bounds, (95, 100, 100, 100, 100))
    latency = rule(kind="recovery_latency_high", min_recoveries=20)
    assert run(latency, [fast, slow, slow, LatencyInput(bounds, (1, 1, 1, 1, 1)), fast]) == [(1.0, "firing"), (4.0, "resolved")]
    silent = rule(kind="engine_silent", silent_for="5m", **{"for": "0"})
    assert run(silent, [SilenceInput(10), SilenceInput(400), SilenceInput(20)]) == [(1.0, "firing"), (2.0, "resolved")]


def test_histogram_quantile_matches_prometheus() -> None:
    # Prometheus: buckets le=0.1:10, 0.25:40, 0.5:60, 1:100, +Inf:100 → q=0.95 is 0.5 + 0.5*(95-60)/40
    assert histogram_quantile(0.95, (0.1, 0.25, 0.5, 1.0), (10, 40, 60, 100, 100)) == pytest.approx(0.9375)
    assert histogram_quantile(0.5, (0.1, 0.25), (0, 10, 10)) == pytest.approx(0.175)
    assert histogram_quantile(0.99, (0.1,), (5, 10)) == 0.1  # in +Inf: the highest finite bound


def test_expr_rule_series_fire_while_returned_and_resolve_when_gone() -> None:
    r = rule(expr="SELECT engine_id AS engine, 1.0 AS value FROM requests")
    state, notes = evaluate([r], {"A": {(("engine", "e1"),): 0.3}}, 0.0, {})
    assert [(n.status, n.value) for n in notes] == [(Status.FIRING, 0.3)]
    state, notes = evaluate([r], {"A": {}}, 60.0, state)
    assert [n.status for n in notes] == [Status.RESOLVED]


def test_wrong_input_for_the_kind_is_an_error() -> None:
    with pytest.raises(TypeError, match="does not fit kind"):
        evaluate([rule(**DROP)], {"A": {ENGINE: SilenceInput(1.0)}}, 0.0, {})


# -- regressions from the review -----------------------------------------------------------------
def test_rule_labels_win_over_series_labels_and_do_not_flap() -> None:
    r = rule(expr="SELECT 'db' AS team, 'info' AS severity, 1.0 AS value", labels={"severity": "page", "team": "db"})
    series = (("severity", "info"), ("team", "db"))
    state: dict = {}
    seen = []
    for minute in range(4):
        state, notes = evaluate([r], {"A": {series: 1.0}}, minute * MIN, state)
        seen += [(n.status, dict(n.labels)) for n in notes]
    assert seen == [(Status.FIRING, {"severity": "page", "team": "db"})]
    state, notes = evaluate([r], {"A": {}}, 5 * MIN, state)
    assert [(n.status, n.value) for n in notes] == [(Status.RESOLVED, 1.0)]  # the last value kept


def test_a_pending_series_that_disappears_starts_over() -> None:
    r = rule(**{**DROP, "for": "10m"})
    state, _ = evaluate([r], {"A": {ENGINE: drop(0.4)}}, 0.0, {})
    state, _ = evaluate([r], {"A": {}}, 60.0, state)  # the series is gone: pending dropped
    assert state == {}
    state, notes = evaluate([r], {"A": {ENGINE: drop(0.4)}}, 3600.0, state)
    assert notes == [] and next(iter(state.values())).active_since == 3600.0


def test_a_pending_alert_after_a_long_outage_starts_its_for_over() -> None:
    r = rule(**{**DROP, "for": "5m"})
    state, _ = evaluate([r], {"A": {ENGINE: drop(0.4)}}, 0.0, {})
    state, notes = evaluate([r], {"A": {ENGINE: drop(0.4)}}, 3 * 3600.0, state)
    assert notes == [] and next(iter(state.values())).status == Status.PENDING
    state, notes = evaluate([r], {"A": {ENGINE: drop(0.4)}}, 3 * 3600.0 + 300, state)
    assert [n.status for n in notes] == [Status.FIRING]


def test_hysteresis_applies_only_once_firing() -> None:
    # one sample past the fire threshold, then values inside the band: pending falls back
    series = [drop(0.8), drop(0.5)] + [drop(0.65)] * 6
    assert run(rule(**{**DROP, "for": "5m"}), series) == []


def test_state_is_pruned_and_removed_rules_resolve() -> None:
    r = rule(**{**DROP, "for": "0", "keep_firing_for": "0"})
    state, _ = evaluate([r], {"A": {ENGINE: drop(0.8)}}, 0.0, {})
    assert state == {}  # inactive series are not kept
    state, _ = evaluate([r], {"A": {ENGINE: drop(0.4)}}, 60.0, state)
    state, notes = evaluate([r], {"A": {ENGINE: drop(0.79)}}, 120.0, state)
    assert [n.status for n in notes] == [Status.RESOLVED] and len(state) == 1
    state, _ = evaluate([r], {"A": {ENGINE: drop(0.79)}}, 120.0 + 900, state)
    assert state == {}  # a resolved alert is kept 15 minutes
    state, _ = evaluate([r], {"A": {ENGINE: drop(0.4)}}, 2000.0, state)
    state, notes = evaluate([], {}, 2060.0, state)  # the rule was removed from the file
    assert [n.status for n in notes] == [Status.RESOLVED] and state == {}


def test_rank_disagreements_fire_at_the_minimum_and_resolve_once_they_stop() -> None:
    from alerts.rule_eval import CountInput

    r = rule(kind="tp_rank_disagreement", min_disagreements=10, **{"for": "2m", "keep_firing_for": "3m"})
    key = (("engine", "e1"), ("form", "linear_state"), ("tp_rank", "1"))
    series = [CountInput(3)] * 3 + [CountInput(12)] * 6 + [CountInput(0)] * 6
    assert run(r, series, key=key) == [(5.0, "firing"), (12.0, "resolved")]
    assert run(r, [CountInput(9)] * 10, key=key) == []  # one short of the minimum: never


def test_rank_disagreement_settings_are_checked() -> None:
    from alerts.rulefile import RuleFileError

    with pytest.raises(RuleFileError, match="min_disagreements must be >= 1"):
        rule(kind="tp_rank_disagreement", min_disagreements=0)
