"""Golden time series for each built-in rule kind (issue 7 acceptance), run through
``kvscope alerts test``'s harness (:mod:`alerts.golden`): real ingest into a scratch store, the
rollup, the rule scheduler, the shipped default rule file. Each file under ``golden/`` says what
it shows and lists exactly the notifications it must produce."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from alerts.golden import GoldenError, expand, load_series, parse_series, run_golden
from alerts.rulefile import DEFAULT_RULES_PATH, load_rule_file

GOLDEN = Path(__file__).with_name("golden")
FILES = sorted(GOLDEN.glob("*.yaml"))


def test_every_built_in_kind_has_a_golden_series() -> None:
    alerts = {e.alert for f in FILES for e in (load_series(f).expected or ())}
    kinds = {r.kind for r in load_rule_file(DEFAULT_RULES_PATH).rules if r.alert in alerts}
    assert kinds == {r.kind for r in load_rule_file(DEFAULT_RULES_PATH).rules}
    names = {f.stem for f in FILES}
    assert {"drop_step", "drop_slow_drift", "drop_flapping", "drop_data_gap", "engine_restart", "agent_restart_pending"} <= names


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_golden_series(path: Path) -> None:
    spec = load_series(path)
    assert spec.expected is not None, f"{path.name} must list its expected notifications"
    result = run_golden(load_rule_file(DEFAULT_RULES_PATH), spec)
    assert result.mismatches == []
    assert len(result.notifications) == len(spec.expected)


def test_a_restart_while_pending_changes_nothing() -> None:
    rules = load_rule_file(DEFAULT_RULES_PATH)
    with_restart = run_golden(rules, load_series(GOLDEN / "agent_restart_pending.yaml"))
    without = run_golden(rules, load_series(GOLDEN / "drop_step.yaml"))
    assert [(n.at, n.alert, n.status) for n in with_restart.notifications] == [(n.at, n.alert, n.status) for n in without.notifications]


def test_a_wrong_expectation_is_reported() -> None:
    spec = parse_series(
        {
            "duration": "30m",
            "series": [{"requests": {"engine": "e1", "model": "m1"}, "prompt_tokens": "100x29", "recoverable_tokens": "90x29"}],
            "expected": [{"at": "10m", "alert": "RecoverableHitRateDrop", "status": "firing"}],
        }
    )
    result = run_golden(load_rule_file(DEFAULT_RULES_PATH), spec)
    assert result.notifications == []
    assert result.mismatches == ["expected firing RecoverableHitRateDrop at 10m {} did not happen"]


def test_expanding_notation() -> None:
    assert expand("1x2 _x2 1+1x3 2-1x2 _ 7") == [1, 1, 1, None, None, 1, 2, 3, 4, 2, 1, 0, None, 7]
    assert expand("-1.5e-3 1e3+1e2x1") == [-0.0015, 1000, 1100]
    assert expand(5) == [5.0]
    for bad in ("", "1xx2", "1x", "1+2", "abc", "1+x3", "nan", "inf"):
        with pytest.raises(ValueError):
            expand(bad)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"series": []}, "missing field 'duration'"),
        ({"duration": "1h", "series": [], "extra": 1}, "unknown field 'extra'"),
        ({"duration": "1h", "series": [{"requests": {"engine": "e1"}, "prompt_tokens": "1", "recoverable_tokens": "1"}]}, "series[0]: field requests: needs exactly the labels engine, model"),
        ({"duration": "1h", "series": [{"requests": {"engine": "e1", "model": "m"}, "prompt_tokens": "1x3", "recoverable_tokens": "1"}]}, "different lengths"),
        ({"duration": "1h", "series": [{"requests": {"engine": "e1", "model": "m"}, "prompt_tokens": "-1", "recoverable_tokens": "1"}]}, "values must be >= 0"),
        ({"duration": "1h", "series": [{"lookups": {"engine": "e"}, "requests": {}}]}, "needs exactly one of requests, lookups"),
        ({"duration": "1h", "series": [], "expected": [{"at": "1m", "alert": "A", "status": "pending"}]}, "field status: firing or resolved"),
        ({"duration": "1h", "lag": "90s", "series": []}, "field lag: must be whole seconds"),
        ({"duration": "soon", "series": []}, "field duration: 'soon' is not a duration"),
        ({"duration": "1h", "series": [{"requests": {"engine": "e", "model": "m"}, "prompt_tokens": "1.5", "recoverable_tokens": "1"}]}, "whole numbers"),
        ({"duration": "1h", "series": [{"lookups": dict.fromkeys(("engine", "model", "form", "tier", "outcome", "reason"), "x"), "count": "1e9"}]}, "at most 100000 lookups per step"),
        ({"duration": "1h", "series": [{"requests": {"engine": "e", "model": "m"}, "prompt_tokens": "1x99999999999", "recoverable_tokens": "1"}]}, "more than 1000000 values"),
        ({"duration": "1h", "agent_restarts": ["2h"], "series": []}, "agent_restarts[0]: must be within the duration"),
        ({"duration": "1h", "series": [], "expected": [{"at": "1m", "alert": "A", "status": "firing", "labels": {"engine": [1]}}]}, "expected a mapping of label names to strings"),
    ],
)
def test_bad_series_files_name_the_field(document: dict[str, object], message: str) -> None:
    with pytest.raises(GoldenError) as info:
        parse_series(document, source="s.yaml")
    assert message in str(info.value) and str(info.value).startswith("s.yaml")


def test_expectations_at_one_time_match_in_any_order_and_runs_are_bounded() -> None:
    spec = load_series(GOLDEN / "engine_silent.yaml")
    assert spec.expected is not None
    swapped = (*spec.expected[:2], spec.expected[3], spec.expected[2], *spec.expected[4:])
    assert run_golden(load_rule_file(DEFAULT_RULES_PATH), replace(spec, expected=swapped)).mismatches == []
    long = parse_series({"duration": "60d", "interval": "1m", "series": []})  # 2 groups × 86400
    with pytest.raises(GoldenError, match="evaluations over the rule groups' intervals"):
        run_golden(load_rule_file(DEFAULT_RULES_PATH), long)


def test_events_the_agent_would_refuse_are_reported() -> None:
    spec = parse_series(
        {"duration": "5m", "series": [{"requests": {"engine": "e1", "model": "m1"}, "prompt_tokens": "10x4", "recoverable_tokens": "20x4"}]}
    )
    with pytest.raises(GoldenError, match="break the event contract"):
        run_golden(load_rule_file(DEFAULT_RULES_PATH), spec)


def test_the_cli_prints_the_notifications_and_fails_on_a_mismatch(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "kvscope", "alerts", "test", str(DEFAULT_RULES_PATH), "--series"]
    ok = subprocess.run([*command, str(GOLDEN / "invalidation_spike.yaml")], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == [
        '    1h4m  firing    FormInvalidationSpike{engine="e1",form="swa_window",reason="swa_evicted",severity="ticket"}  value=0.41',
        '   1h22m  resolved  FormInvalidationSpike{engine="e1",form="swa_window",reason="swa_evicted",severity="ticket"}  value=0.41',
    ]
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text((GOLDEN / "invalidation_spike.yaml").read_text().replace("at: 64m", "at: 63m"))
    failed = subprocess.run([*command, str(wrong)], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    assert "FAILED: expected firing FormInvalidationSpike at 1h3m" in failed.stderr
    assert "FAILED: unexpected notification:     1h4m  firing    FormInvalidationSpike" in failed.stderr
    bad = subprocess.run([*command, str(tmp_path / "missing.yaml")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "cannot read series file" in bad.stderr


def test_an_unanchored_baseline_would_resolve_inside_the_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The anchored baseline is what keeps drop_long_outage firing: with the baseline trailing
    every evaluation (no anchors), the outage fills it and the alert resolves at 152m, while the
    rate is still 0.4."""
    import alerts.rule_scheduler

    monkeypatch.setattr(alerts.rule_scheduler, "activation_anchors", lambda states, alert: {})
    result = run_golden(load_rule_file(DEFAULT_RULES_PATH), load_series(GOLDEN / "drop_long_outage.yaml"))
    assert [(n.status.value, n.at - result.notifications[0].at) for n in result.notifications] == [("firing", 0.0), ("resolved", 57 * 60.0)]
