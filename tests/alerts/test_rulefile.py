"""Rule files (issue 7, item 1): Prometheus-shaped YAML, every built-in kind, strict loading
with the file, group, rule and field named; ``kvscope alerts check``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from alerts.notify_config import DEFAULT_NOTIFY_PATH as NOTIFY
from alerts.rulefile import (
    DEFAULT_BURN_WINDOWS,
    DEFAULT_RULES_PATH,
    KINDS,
    HitRateBelow,
    HitRateDrop,
    NamedQueryExpr,
    RuleFileError,
    SqlExpr,
    check_template,
    load_rule_file,
    parse_duration,
    parse_rule_file,
    render_template,
)
from kvscope.cli import main


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("0", 0.0), (0, 0.0), ("0s", 0.0), ("1h0m", 3600.0), ("90s", 90.0), ("5m", 300.0), ("1h30m", 5400.0), ("500ms", 0.5), ("1d", 86400.0), ("2w", 1209600.0), ("1y", 31536000.0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5", "5x", "m5", "1.5h", "5m1h", "-5m", 300])
def test_bad_durations(text: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_the_default_file_has_every_built_in_kind() -> None:
    rules = load_rule_file(DEFAULT_RULES_PATH)
    assert {rule.kind for rule in rules.rules} == set(KINDS)
    drop = next(r for r in rules.rules if r.alert == "RecoverableHitRateDrop")
    assert drop.settings == HitRateDrop(window=300.0, baseline_window=3600.0, min_prompt_tokens=10_000)
    assert (drop.for_seconds, drop.keep_firing_for_seconds, drop.severity) == (120.0, 300.0, "page")
    slo = next(r for r in rules.rules if r.alert == "RecoverableHitRateSLO")
    assert isinstance(slo.settings, HitRateBelow) and slo.settings.objective == 0.5
    # the SRE workbook's windows, with burn rates a 50% budget can reach
    assert [(w.long, w.short) for w in slo.settings.windows] == [(w.long, w.short) for w in DEFAULT_BURN_WINDOWS]
    assert [w.burn_rate for w in slo.settings.windows] == [1.8, 1.5, 1.2]
    assert [g.interval_seconds for g in rules.groups] == [None, None]


def rule_file(**rule: object) -> dict[str, object]:
    base: dict[str, object] = {"alert": "A", "labels": {"severity": "page"}}
    base.update(rule)
    return {"groups": [{"name": "g", "interval": "30s", "rules": [base]}]}


def test_expr_rules_named_query_and_sql() -> None:
    named = parse_rule_file(rule_file(expr={"query": "alerts_recent", "params": {"limit": 5}}))
    assert named.rules[0].expr == NamedQueryExpr("alerts_recent", {"limit": "5"})
    assert named.groups[0].interval_seconds == 30.0
    statement = "SELECT engine_id AS engine, 0.5 AS value FROM requests"
    assert parse_rule_file(rule_file(expr=statement)).rules[0].expr == SqlExpr(statement)


def test_burn_windows_and_settings_from_yaml() -> None:
    windows = [{"long": "1h", "short": "5m", "burn_rate": 14.4, "severity": "page"}]
    rules = parse_rule_file(rule_file(kind="recoverable_hit_rate_below", objective=0.95, windows=windows))
    settings = rules.rules[0].settings
    assert isinstance(settings, HitRateBelow)
    assert (settings.objective, settings.windows[0].long, settings.windows[0].short) == (0.95, 3600.0, 300.0)


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"kind": "recoverable_hit_rate_drop", "windw": "5m"}, "rule 'A': unknown field 'windw'"),
        ({"kind": "no_such_kind"}, "rule 'A': field kind: unknown kind 'no_such_kind'"),
        ({"kind": "engine_silent", "expr": "SELECT 1 AS value"}, "give exactly one of kind"),
        ({}, "give exactly one of kind"),
        ({"kind": "recoverable_hit_rate_drop", "window": "5"}, "field window: '5' is not a duration"),
        ({"kind": "recoverable_hit_rate_drop", "for": "2 minutes"}, "field for: '2 minutes' is not a duration"),
        ({"kind": "recoverable_hit_rate_drop", "clear_relative_drop": 0.5}, "clear thresholds must not exceed fire"),
        ({"kind": "recoverable_hit_rate_drop", "baseline": "lastweek"}, "baseline must be trailing or yesterday"),
        ({"kind": "recoverable_hit_rate_drop", "min_prompt_tokens": 1.5}, "field min_prompt_tokens: expected int"),
        ({"kind": "recoverable_hit_rate_below", "objective": 1.0}, "objective must be a ratio in (0, 1)"),
        ({"kind": "recoverable_hit_rate_below", "objective": 0.5}, "burn rate 14.4 can never be reached with objective 0.5"),
        ({"kind": "recoverable_hit_rate_below", "windows": [{"long": "1h", "short": "5m", "burn_rate": 2, "severity": "page"}] * 2}, "burn windows must differ"),
        ({"kind": "recoverable_hit_rate_below", "windows": [{"long": "1h", "short": "5m", "burn_rate": float("inf"), "severity": "page"}]}, "burn_rate must be a finite number"),
        ({"kind": "recovery_latency_high", "threshold": "30s"}, "threshold must be below the highest recovery-latency bucket"),
        ({"kind": ["engine_silent"]}, "field kind: unknown kind"),
        ({"kind": "engine_silent", 5: "x", "zz": 1}, "unknown field '5'"),
        ({"kind": "engine_silent", "silent_for": "1" + "0" * 400 + "y"}, "longer than 100 years"),
        ({"kind": "engine_silent", "silent_for": "\uff15m"}, "is not a duration"),
        ({"kind": "recoverable_hit_rate_below", "windows": [{"long": "5m", "short": "1h", "burn_rate": 2, "severity": "page"}]}, "need 0 < short < long"),
        ({"kind": "engine_silent", "silent_for": "2h"}, "need 0 < silent_for < lookback"),
        ({"expr": "COPY requests TO '/tmp/x.csv'"}, "field expr: only read statements"),
        ({"expr": "SELECT 1; SELECT 2"}, "field expr: exactly one statement"),
        ({"expr": {"query": "nope"}}, "field expr: unknown query 'nope'"),
        ({"expr": {"query": "totals"}}, "field expr: named query totals returns no value column"),
        ({"expr": {"query": "totals", "params": {"bogus": 1}}}, "field expr: parameter 'bogus': unknown parameter of query totals"),
        ({"kind": "engine_silent", "labels": {}}, "field labels.severity: required"),
        ({"kind": "engine_silent", "labels": {"severity": "urgent"}}, "field labels.severity: required"),
        ({"kind": "engine_silent", "labels": {"severity": "page", "bad-name": "x"}}, "'bad-name' is not a valid name"),
        ({"kind": "engine_silent", "annotations": {"summary": "{{ .Labels.engine }}"}}, "field annotations.summary: unsupported template"),
        ({"kind": "engine_silent", "annotations": {"summary": "{{ $value | toUpper }}"}}, "unknown template pipe 'toUpper'"),
        ({"kind": "engine_silent", "annotations": {"summary": 5}}, "field annotations.summary: expected a string"),
        ({"alert": "has space", "kind": "engine_silent"}, "rule 0: field alert: must be a name"),
    ],
)
def test_bad_rules_name_file_group_rule_and_field(tmp_path: Path, rule: dict[object, object], message: str) -> None:
    document = rule_file()
    document["groups"][0]["rules"][0].update(rule)  # type: ignore[index]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(RuleFileError) as info:
        load_rule_file(path)
    assert str(info.value).startswith(f"{path}: group 'g': ")
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"group": []}, "unknown field 'group'"),
        ({"groups": []}, "groups must be a non-empty list"),
        ({"groups": [{"name": "g", "rules": [], "extra": 1}]}, "group 0: unknown field 'extra'"),
        ({"groups": [{"name": "g", "interval": "soon", "rules": [{}]}]}, "group 'g': field interval: 'soon' is not a duration"),
        ({"groups": [{"name": "g", "rules": [{"alert": "A", "kind": "engine_silent", "labels": {"severity": "page"}}] * 2}]}, "alert names must be unique"),
        ({"groups": [{"name": "g", "rules": [{"alert": "A", "kind": "engine_silent", "labels": {"severity": "page"}}]}] * 2}, "group names must be unique"),
        ({"groups": [{"name": n, "rules": [{"alert": "A", "kind": "engine_silent", "labels": {"severity": "page"}}]} for n in ("g", "h")]}, "rule 'A': alert names must be unique in the file"),
    ],
)
def test_bad_files(document: dict[str, object], message: str) -> None:
    with pytest.raises(RuleFileError, match=r"^<rules>: ") as info:
        parse_rule_file(document)
    assert message in str(info.value)


def test_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(RuleFileError, match="cannot read rule file"):
        load_rule_file(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("groups: [\n")
    with pytest.raises(RuleFileError, match="invalid YAML"):
        load_rule_file(broken)


def test_templates_render_labels_and_value() -> None:
    text = "{{ $labels.engine }} at {{ $value | humanizePercentage }} ({{$value}}, {{ $labels.absent }})"
    check_template(text)
    assert render_template(text, {"engine": "e1"}, 0.4235) == "e1 at 42.35% (0.4235, )"
    # as Prometheus's template functions print them
    assert render_template("{{ $value | humanize }}", {}, 12345) == "12.35k"
    assert render_template("{{ $value | humanize }}", {}, 0.00042) == "420u"
    assert render_template("{{ $value | humanizeDuration }}", {}, 0.875) == "875ms"
    assert render_template("{{ $value | humanizeDuration }}", {}, 5400) == "1h 30m 0s"
    assert render_template("{{ $value | humanizeDuration }}", {}, 90061) == "1d 1h 1m 1s"
    assert render_template("{{ $value }}", {}, 123456789) == "1.23456789e+08"
    assert [render_template("{{ $value }}", {}, v) for v in (0.5, 123456.0, 1e-05, 0.0001, 2.0)] == ["0.5", "123456", "1e-05", "0.0001", "2"]
    assert render_template("{{ $value }}", {}, None) == "no data"
    with pytest.raises(ValueError, match="unbalanced"):
        check_template("{{ $value }")


def test_alerts_check_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(rule_file(kind="engine_silent", silent_for="5x")))
    with pytest.raises(SystemExit) as exit_info:
        main(["alerts", "check", str(DEFAULT_RULES_PATH), str(bad)])
    assert exit_info.value.code == 1
    out, err = capsys.readouterr()
    assert out == f"{DEFAULT_RULES_PATH}: SUCCESS: 2 groups, 8 rules found\n"
    assert err == f"FAILED: {bad}: group 'g': rule 'A': field silent_for: '5x' is not a duration (use units ms, s, m, h, d, w, y, e.g. 1h30m)\n"
    with pytest.raises(SystemExit) as exit_info:
        main(["alerts", "check", str(DEFAULT_RULES_PATH)])
    assert exit_info.value.code == 0
    # notification files are told apart by their keys; a rule file with a typo stays a rule file
    typo = tmp_path / "typo.yaml"
    typo.write_text("group: []\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["alerts", "check", str(NOTIFY), str(typo), str(tmp_path / "absent.yaml")])
    assert exit_info.value.code == 1
    out, err = capsys.readouterr()
    assert out == f"{NOTIFY}: SUCCESS: notification file, 1 receiver, 2 inhibit rules, 0 Alertmanagers\n"
    assert f"FAILED: {typo}: unknown field 'group'; known: groups" in err
    assert f"FAILED: {tmp_path / 'absent.yaml'}: cannot read: No such file or directory" in err


def test_agent_refuses_a_bad_rule_file_before_starting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(rule_file(kind="engine_silent", silent_for="5x")))
    config = tmp_path / "agent.yaml"
    config.write_text(f"data_dir: {tmp_path / 'data'}\nalert_rules_file: {bad}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["agent", "--config", str(config)])
    assert exit_info.value.code == 2
    assert f"kvscope agent: {bad}: group 'g': rule 'A': field silent_for" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_group_intervals_have_a_floor() -> None:
    group = {"name": "g", "interval": "10ms", "rules": [{"alert": "A", "kind": "engine_silent", "labels": {"severity": "page"}}]}
    with pytest.raises(RuleFileError, match="group 'g': field interval: must be at least 100ms"):
        parse_rule_file({"groups": [group]})
    assert parse_rule_file({"groups": [{**group, "interval": "100ms"}]}).groups[0].interval_seconds == 0.1
