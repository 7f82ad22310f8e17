"""``benchmarks/load.py`` on a small checkpoint: one JSON object whose two loaders held every
weight (the timings and memory figures are the benchmark's business, never asserted here)."""

from __future__ import annotations

import json

import pytest

from benchmarks.load import main


def test_load_benchmark_prints_both_loaders_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--hidden-size", "64", "--layers", "2", "--repeats", "1"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["benchmark"] == "load" and doc["checkpoint_bytes"] > 0
    assert doc["engine"]["elements"] == doc["plain"]["elements"] > 0
    for mode in ("engine", "plain"):
        assert doc[mode]["seconds_median"] > 0 and doc[mode]["peak_over_baseline_bytes"] > 0
    assert doc["engine_over_plain_seconds"] > 0 and doc["engine_over_plain_peak"] > 0
