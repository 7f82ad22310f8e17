"""The query side of rule-file evaluation (issue 7): :func:`alerts.inputs.collect_inputs` over a
real store, per kind, then the evaluator on what it collected."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agent.ingest import ingest_batch
from agent.rollups import fold_cache_minute
from agent.store import Store, to_timestamp
from alerts.inputs import ExprError, collect_inputs
from alerts.rule_eval import (
    BurnInput,
    DropInput,
    LatencyInput,
    ShareInput,
    SilenceInput,
    Status,
    Tokens,
    evaluate,
)
from alerts.rulefile import Rule, parse_rule_file
from engine.events import decode_batch

NOW = 1_800_000_000.0  # a minute boundary
END = NOW - 5  # the default ingest lag
E1M1 = (("engine", "e1"), ("model", "m1"))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store.open(tmp_path / "k.duckdb")
    yield opened
    opened.close()


def rule(**fields: object) -> Rule:
    base: dict[str, object] = {"alert": "A", "labels": {"severity": "page"}}
    base.update(fields)
    return parse_rule_file({"groups": [{"name": "g", "rules": [base]}]}).rules[0]


SEQ = iter(range(10_000))


def store_events(store: Store, events: list[dict[str, Any]], engine: str = "e1", received: float | None = None) -> None:
    body = msgspec.json.encode({"schema_version": 1, "engine_id": engine, "seq": next(SEQ), "sent_at": NOW, "events": events})
    at = to_timestamp(received if received is not None else NOW - 1)
    assert ingest_batch(store, decode_batch(body), received_at=at).status == "stored"


def request(ts: float, prompt: int, recoverable: int, engine: str = "e1") -> dict[str, Any]:
    return {
        "kind": "request", "ts": ts, "engine_id": engine, "request_id": f"r{ts}", "model": "m1",
        "prompt_tokens": prompt, "output_tokens": 1, "hash_hit_tokens": recoverable,
        "resume_tokens": max(recoverable - 1, 0), "recoverable_tokens": recoverable, "replayed_tokens": 0,
        "recomputed_tokens": prompt - recoverable, "admission": "exact", "ttft_seconds": 0.1, "e2e_seconds": 0.2,
    }  # fmt: skip


def lookup(ts: float, form: str, outcome: str, reason: str, recovery: float = 0.0, tier: str = "device") -> dict[str, Any]:
    return {
        "kind": "cache_lookup", "ts": ts, "engine_id": "e1", "request_id": f"q{ts}", "model": "m1",
        "form": form, "tier": tier, "outcome": outcome, "reason": reason, "hash_hit_tokens": 10,
        "usable_tokens": 10, "recoverable_tokens": 10, "recovery_seconds": recovery,
    }  # fmt: skip


def test_drop_windows_trailing_and_yesterday(store: Store) -> None:
    store_events(store, [
        request(END - 10, 1000, 400),  # in the 5 m window
        request(END - 299, 1000, 600),  # in the window (its first second)
        request(END - 301, 1000, 900),  # the trailing baseline
        request(END - 3900, 1000, 100),  # the trailing baseline's first second
        request(END - 3901, 1000, 0),  # before it
        request(END, 1000, 0),  # at the window's end: excluded
        request(END - 86400 - 100, 2000, 1800),  # yesterday, same window
    ])  # fmt: skip
    trailing = collect_inputs(store, [rule(kind="recoverable_hit_rate_drop")], now=NOW)
    assert trailing == {"A": {E1M1: DropInput(Tokens(1000, 2000), Tokens(1000, 2000))}}
    yesterday = collect_inputs(store, [rule(kind="recoverable_hit_rate_drop", baseline="yesterday")], now=NOW)
    assert yesterday == {"A": {E1M1: DropInput(Tokens(1000, 2000), Tokens(1800, 2000))}}


def test_burn_windows(store: Store) -> None:
    store_events(store, [request(END - 60, 1000, 100), request(END - 1000, 1000, 1000), request(END - 7200, 1000, 500)])
    data = collect_inputs(store, [rule(kind="recoverable_hit_rate_below", objective=0.95)], now=NOW)
    assert data == {"A": {E1M1: BurnInput((
        (Tokens(1100, 2000), Tokens(100, 1000)),  # 1h / 5m
        (Tokens(1600, 3000), Tokens(1100, 2000)),  # 6h / 30m
        (Tokens(1600, 3000), Tokens(1600, 3000)),  # 3d / 6h
    ))}}  # fmt: skip


def test_invalidation_shares_and_latency_buckets(store: Store) -> None:
    store_events(store, [
        lookup(END - 10, "swa_window", "invalidated", "swa_evicted"),
        lookup(END - 20, "swa_window", "invalidated", "swa_evicted"),
        lookup(END - 30, "swa_window", "hit", "none"),
        lookup(END - 1000, "swa_window", "hit", "none"),
        lookup(END - 1100, "swa_window", "invalidated", "swa_evicted"),
        lookup(END - 50, "full_kv", "recovered", "kv_evicted", recovery=0.3, tier="host"),
        lookup(END - 60, "full_kv", "recovered", "kv_evicted", recovery=2.0, tier="host"),
    ])  # fmt: skip
    spikes = collect_inputs(store, [rule(kind="form_invalidation_spike")], now=NOW)
    assert spikes == {"A": {(("engine", "e1"), ("form", "swa_window"), ("reason", "swa_evicted")): ShareInput(2, 3, 1, 2)}}
    fold_cache_minute(store)
    # the job runs at second 5 (the lag): the window ends on a minute boundary and takes the whole
    # minutes before it; a run a few ms late must not take the minute that just started
    latency = collect_inputs(store, [rule(kind="recovery_latency_high")], now=NOW + 5)
    assert collect_inputs(store, [rule(kind="recovery_latency_high")], now=NOW + 5.003) == latency
    [(key, value)] = latency["A"].items()
    assert key == (("engine", "e1"), ("form", "full_kv"), ("tier", "host"))
    assert isinstance(value, LatencyInput)
    # bounds 1 ms .. 10 s: 0.3 s counts from le=0.5 up, 2.0 s from le=2.5; total 2
    assert dict(zip(value.bounds, value.cumulative, strict=False))[0.25] == 0
    assert dict(zip(value.bounds, value.cumulative, strict=False))[0.5] == 1
    assert dict(zip(value.bounds, value.cumulative, strict=False))[2.5] == 2
    assert value.cumulative[-1] == 2


def test_silence_per_engine_and_overall(store: Store) -> None:
    store_events(store, [request(END - 400, 10, 0)], received=NOW - 400)
    store_events(store, [request(END - 30, 10, 0, engine="e2")], engine="e2", received=NOW - 30)
    silent = collect_inputs(store, [rule(kind="engine_silent")], now=NOW)
    assert silent == {"A": {(("engine", "e1"),): SilenceInput(400.0), (("engine", "e2"),): SilenceInput(30.0)}}
    stalled = collect_inputs(store, [rule(kind="ingest_stalled")], now=NOW)
    assert stalled == {"A": {(): SilenceInput(30.0)}}
    # a stall older than the lookback still counts (it is the signal); engines past it drop out
    assert collect_inputs(store, [rule(kind="ingest_stalled")], now=NOW + 7200) == {"A": {(): SilenceInput(7230.0)}}
    assert collect_inputs(store, [rule(kind="engine_silent")], now=NOW + 7200) == {
        "A": {(("engine", "e1"),): SilenceInput(7600.0, retired=True), (("engine", "e2"),): SilenceInput(7230.0, retired=True)}
    }


def test_expr_rules(store: Store) -> None:
    store_events(store, [request(END - 10, 1000, 400)])
    store_events(store, [request(END - 10, 3000, 400, engine="e2")], engine="e2")
    sql_rule = rule(expr="SELECT engine_id AS engine, sum(prompt_tokens) / 1000 AS value FROM requests GROUP BY 1")
    assert collect_inputs(store, [sql_rule], now=NOW) == {"A": {(("engine", "e1"),): 1.0, (("engine", "e2"),): 3.0}}
    no_value = rule(expr="SELECT engine_id FROM requests")
    with pytest.raises(ExprError, match="rule A: its query returns no value column"):
        collect_inputs(store, [no_value], now=NOW)
    failing = rule(expr="SELECT 1 / 0 AS value, 'x' AS engine FROM range(1) WHERE error('boom') IS NULL")
    with pytest.raises(ExprError, match="rule A: its query failed"):
        collect_inputs(store, [failing], now=NOW)


def test_collected_then_evaluated_fires_once(store: Store) -> None:
    drop = rule(kind="recoverable_hit_rate_drop", min_prompt_tokens=1000, annotations={"summary": "{{ $labels.engine }} at {{ $value | humanizePercentage }}"})
    store_events(store, [request(END - 10, 1000, 300), request(END - 600, 1000, 900)])
    state, notes = evaluate([drop], collect_inputs(store, [drop], now=NOW), NOW, {})
    assert [(n.status, n.annotations["summary"]) for n in notes] == [(Status.FIRING, "e1 at 30%")]
    state, notes = evaluate([drop], collect_inputs(store, [drop], now=NOW + 60), NOW + 60, state)
    assert notes == []


def test_rank_disagreements_per_rank_with_zero_once_they_stopped(store: Store) -> None:
    from alerts.rule_eval import CountInput

    held = {"tp_rank": 1}
    store_events(store, [
        {**lookup(END - 10, "linear_state", "invalidated", "tp_disagree"), **held},
        {**lookup(END - 20, "linear_state", "invalidated", "tp_disagree"), **held},
        {**lookup(END - 30, "full_kv", "invalidated", "tp_disagree"), "tp_rank": 3},
        {**lookup(END - 1000, "swa_window", "invalidated", "tp_disagree"), **held},  # before the window, within the hour
        lookup(END - 40, "linear_state", "invalidated", "linear_checkpoint_missing"),
    ])  # fmt: skip
    data = collect_inputs(store, [rule(kind="tp_rank_disagreement")], now=NOW)
    assert data == {"A": {
        (("engine", "e1"), ("form", "linear_state"), ("tp_rank", "1")): CountInput(2),
        (("engine", "e1"), ("form", "full_kv"), ("tp_rank", "3")): CountInput(1),
        (("engine", "e1"), ("form", "swa_window"), ("tp_rank", "1")): CountInput(0),
    }}  # fmt: skip
