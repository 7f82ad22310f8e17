"""``benchmarks/cache_lookup.py`` on a short prompt: its object's shape, and that the lookup it
times did real work (the timings themselves are a benchmark's business, never asserted here)."""

from __future__ import annotations

import json

import pytest

from benchmarks.cache_lookup import main


def test_cache_lookup_prints_one_object_whose_lookups_resume(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--prompt-tokens", "1024", "--repeats", "3", "--device", "cpu"]) in (0, None)
    doc = json.loads(capsys.readouterr().out)
    assert doc["benchmark"] == "cache_lookup" and doc["repeats"] == 3
    follow_up, diverging = doc["follow_up"], doc["diverging_follow_up"]
    assert follow_up["hash_hit_tokens"] == follow_up["resume_tokens"] == 1024
    assert {f["outcome"] for f in follow_up["forms"].values()} == {"hit"}
    assert 0 < diverging["resume_tokens"] < 1024
    calls = follow_up["fixed_point_resume_at_most_calls"]
    assert set(calls) == set(follow_up["forms"]) and all(n >= 1 for n in calls.values())
    assert doc["lookup_us_median"] > 0
