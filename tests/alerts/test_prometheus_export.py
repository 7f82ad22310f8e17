"""``kvscope alerts export-prometheus``: the built-in kinds as Prometheus alerting rules over the
agent's metrics, accepted by ``promtool check rules`` (Debian's ``prometheus`` package)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from alerts.prometheus_export import duration, export_prometheus
from alerts.rulefile import DEFAULT_RULES_PATH, load_rule_file, parse_rule_file
from kvscope.cli import main

PROMTOOL = shutil.which("promtool")


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (0.5, "500ms"), (300, "5m"), (5400, "1h30m"), (86400 + 1, "1d1s")])
def test_durations(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_the_default_rules_export_one_rule_per_alert_and_burn_window() -> None:
    exported = yaml.safe_load(export_prometheus(load_rule_file(DEFAULT_RULES_PATH)))
    rules = [r for g in exported["groups"] for r in g["rules"]]
    assert [(r["alert"], r["labels"].get("window")) for r in rules] == [
        ("RecoverableHitRateDrop", None),
        ("RecoverableHitRateSLO", "1h/5m"),
        ("RecoverableHitRateSLO", "6h/30m"),
        ("RecoverableHitRateSLO", "3d/6h"),
        ("FormInvalidationSpike", None),
        ("TensorParallelRankDisagreement", None),
        ("IndexerSyncDelay", None),
        ("RecoveryLatencyHigh", None),
        ("IngestStalled", None),
        ("EngineSilent", None),
    ]
    ranks = next(r for r in rules if r["alert"] == "TensorParallelRankDisagreement")
    assert ranks["expr"] == "sum by (engine, form, tp_rank) (increase(kvscope_tp_disagreements_total[5m])) >= 10"
    sync = next(r for r in rules if r["alert"] == "IndexerSyncDelay")
    assert sync["expr"] == (
        "sum by (engine, model, layer_group) (increase(kvscope_indexer_sync_delay_tokens_count[5m]))"
        '\n- sum by (engine, model, layer_group) (increase(kvscope_indexer_sync_delay_tokens_bucket{le="0.0"}[5m])) > 0'
    )  # the lookups above the threshold (0 tokens): the series kvscope's largest delay fires for
    drop = rules[0]
    assert (drop["for"], drop["keep_firing_for"], drop["labels"]) == ("2m", "5m", {"severity": "page"})
    assert "offset 5m" in drop["expr"] and "< (" in drop["expr"] and ") * 0.7" in drop["expr"]
    slo = rules[1]
    assert slo["expr"].startswith("(1 - (") and ") / 0.5 > 1.8" in slo["expr"]  # the short window's burn rate first
    assert "increase(kvscope_prompt_tokens_total[55m] offset 5m)) >= 10000" in slo["expr"]  # history before the short window
    assert rules[3]["labels"] == {"severity": "ticket", "window": "3d/6h"}
    latency = next(r for r in rules if r["alert"] == "RecoveryLatencyHigh")
    assert "histogram_quantile(0.95" in latency["expr"] and "> 0.5" in latency["expr"]


def test_expr_rules_are_left_out_and_named() -> None:
    rules = parse_rule_file(
        {"groups": [{"name": "g", "rules": [{"alert": "Custom", "expr": "SELECT 1.0 AS value", "labels": {"severity": "info"}}]}]}
    )
    text = export_prometheus(rules)
    assert "# Left out (SQL expr rules have no PromQL equivalent): Custom" in text
    assert yaml.safe_load(text) == {"groups": []}


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not found: install Debian's `prometheus` package (`make test` does it as root)")
def test_promtool_accepts_the_export(tmp_path: Path) -> None:
    out = tmp_path / "kvscope.rules.yml"
    with pytest.raises(SystemExit) as exit_info:
        main(["alerts", "export-prometheus", str(DEFAULT_RULES_PATH), "-o", str(out)])
    assert exit_info.value.code == 0
    assert PROMTOOL is not None
    checked = subprocess.run([PROMTOOL, "check", "rules", str(out)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 10 rules found" in checked.stdout
