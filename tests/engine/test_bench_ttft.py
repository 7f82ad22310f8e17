"""``kvscope bench ttft --json``: the object's shape, and that each plan really ran (the timings
themselves are a benchmark's business, never asserted here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.cli import main


def test_bench_ttft_prints_one_object_with_every_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "held_out.txt"
    text.write_bytes(("To be, or not to be, that is the question:\n" * 60).encode())
    argv = ["bench", "ttft", "--model", "kvscope_hybrid-tiny", "--prefix-tokens", "256", "512"]
    with pytest.raises(SystemExit) as done:
        main([*argv, "--suffix-tokens", "32", "--text", str(text), "--json"])
    assert done.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "kvscope_hybrid-tiny" and doc["device"] == "cpu" and doc["suffix_tokens"] == 32
    rows = {(r["prefix_tokens"], r["plan"]): r for r in doc["results"]}
    assert set(rows) == {(p, plan) for p in (256, 512) for plan in ("cold", "exact", "disk", "replay_5", "replay_10")}
    for (_, plan), r in rows.items():
        assert r["ttft_seconds"] > 0 and r["speedup"] > 0
        if plan == "cold":
            assert r["speedup"] == 1.0 and r["kl"] is None and r["top1_agreement"] is None
        elif plan == "disk":  # a restore from disk (or the recompute the admission priced cheaper) is exact
            assert r["kl"] < 1e-6 and r["top1_agreement"] == 1.0
            assert (r["admission"] == "swap_in") == (r["bytes_moved"] > 0), r
        elif plan.startswith("replay"):
            assert r["replayed_tokens"] > 0  # the replay really ran
            assert r["kl"] >= 0 and 0 <= r["top1_agreement"] <= 1
    assert rows[(512, "replay_10")]["replayed_tokens"] > rows[(512, "replay_5")]["replayed_tokens"]


def test_bench_ttft_times_only_the_plans_asked_for_besides_cold_and_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "held_out.txt"
    text.write_bytes(("To be, or not to be, that is the question:\n" * 30).encode())
    argv = ["bench", "ttft", "--model", "kvscope_hybrid-tiny", "--prefix-tokens", "256", "--suffix-tokens", "32"]
    with pytest.raises(SystemExit) as done:
        main([*argv, "--text", str(text), "--plans", "exact", "--json"])
    assert done.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["plan"] for r in doc["results"]] == ["cold", "exact"]
    with pytest.raises(SystemExit) as done:
        main([*argv, "--text", str(text), "--plans", "warm"])
    assert done.value.code == 2 and "invalid choice: 'warm'" in capsys.readouterr().err


def test_bench_ttft_without_its_text_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "ttft", "--model", "kvscope_hybrid-tiny", "--text", str(tmp_path / "missing.txt")])
    assert done.value.code == 2
    assert "no such text file" in capsys.readouterr().err
