"""``kvscope alerts test``: a rule file over a golden time series, like ``promtool test rules``.

The series file (YAML) describes what engines sent, step by step, in promtool's expanding
notation (``a+bxn``: n+1 values a, a+b, ..., a+nb; ``axn``: a, n+1 times; ``_``: nothing sent
that step; ``_xn``: nothing, n times)::

    interval: 1m                 # evaluation step of groups without their own interval
    duration: 3h                 # evaluate from the start through this long
    lag: 5s                      # the ingest lag (windows end this long before each evaluation)
    agent_restarts: [50m]        # optional: the agent restarts here (state reloaded from the store)
    series:
      - requests: {engine: e1, model: m1}      # one request event per step
        step: 1m                               # default: interval
        prompt_tokens: "20000x179"
        recoverable_tokens: "18000x119 6000x59"
      - lookups: {engine: e1, model: m1, form: swa_window, tier: device, outcome: invalidated, reason: window_evicted}
        count: "100x179"                       # lookup events per step
        recovery_seconds: "0x179"              # each one's recovery latency
        # optional, indexer_state lookups: indexer_sync_delay_tokens, indexer_sync_delay_seconds
    expected:                                  # optional: the run fails unless exactly these happen
      - {at: 1h5m, alert: RecoverableHitRateDrop, status: firing, labels: {engine: e1}}

Each step's events go through the agent's real ingest path (:func:`agent.ingest.ingest_batch`,
one batch per engine and step, received one second after the step) into a scratch DuckDB store;
``cache_minute`` is folded before every evaluation; every rule group runs through
:class:`alerts.rule_scheduler.RuleScheduler` at each multiple of its interval. The output is
every transition (firing, resolved), with its time from the start. ``expected`` entries match
in order on ``at``, ``alert``, ``status`` and the listed labels (a subset).

Raises :class:`GoldenError` naming the file and the field for a file that breaks the format or
events the agent would refuse.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from agent.ingest import ingest_batch
from agent.rollups import fold_cache_minute
from agent.store import Store, to_timestamp
from alerts.golden_series import GOLDEN_START as GOLDEN_START
from alerts.golden_series import MAX_EVALUATIONS, Expected
from alerts.golden_series import GoldenError as GoldenError
from alerts.golden_series import GoldenSeries as GoldenSeries
from alerts.golden_series import SeriesFile as SeriesFile
from alerts.golden_series import expand as expand
from alerts.golden_series import load_series as load_series
from alerts.golden_series import parse_series as parse_series
from alerts.rule_eval import Notification
from alerts.rule_scheduler import RuleScheduler
from alerts.rulefile import RuleFile, RuleGroup
from engine.events import EventError, decode_batch


@dataclass(slots=True)
class GoldenResult:
    notifications: list[Notification] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    start: float = GOLDEN_START


def _events_by_batch(spec: SeriesFile, start: float) -> list[tuple[float, str, list[dict[str, Any]]]]:
    """(received at, engine, events) per engine and step, in receive order."""
    batches: dict[tuple[float, str], list[dict[str, Any]]] = defaultdict(list)
    for n, s in enumerate(spec.series):
        length = len(next(iter(s.values.values())))
        for i in range(length):
            at = start + i * s.step
            engine = s.labels["engine"]
            if s.kind == "requests":
                prompt, rec = s.values["prompt_tokens"][i], s.values["recoverable_tokens"][i]
                if prompt is None or rec is None:
                    continue
                batches[(at, engine)].append(_request_event(at, engine, s.labels["model"], f"s{n}-{i}", int(prompt), int(rec)))
            else:
                count = s.values["count"][i]
                latency = s.values.get("recovery_seconds", [0.0] * length)[i]
                delay = {name: s.values[name][i] or 0 for name in ("indexer_sync_delay_tokens", "indexer_sync_delay_seconds") if name in s.values}
                if count is None:
                    continue
                for k in range(int(count)):
                    batches[(at, engine)].append(_lookup_event(at, s.labels, f"s{n}-{i}-{k}", latency or 0.0, delay))
    return [(at + 1.0, engine, events) for (at, engine), events in sorted(batches.items())]


def _request_event(at: float, engine: str, model: str, request_id: str, p: int, r: int) -> dict[str, Any]:
    return {
        "kind": "request", "ts": at + 0.5, "engine_id": engine, "request_id": request_id, "model": model,
        "prompt_tokens": p, "output_tokens": 1, "hash_hit_tokens": r, "resume_tokens": min(r, max(p - 1, 0)),
        "recoverable_tokens": r, "replayed_tokens": 0, "recomputed_tokens": p - r, "admission": "exact",
        "ttft_seconds": 0.1, "e2e_seconds": 0.2,
    }  # fmt: skip


def _lookup_event(at: float, labels: Mapping[str, str], request_id: str, recovery: float, delay: Mapping[str, float]) -> dict[str, Any]:
    return {
        "kind": "cache_lookup", "ts": at + 0.5, "engine_id": labels["engine"], "request_id": request_id,
        "model": labels["model"], "form": labels["form"], "tier": labels["tier"], "outcome": labels["outcome"],
        "reason": labels["reason"], "hash_hit_tokens": 16, "usable_tokens": 16,
        "recoverable_tokens": 0 if labels["outcome"] == "invalidated" else 16, "recovery_seconds": recovery,
        "tp_rank": int(labels.get("tp_rank", "0")),
        "indexer_sync_delay_tokens": int(delay.get("indexer_sync_delay_tokens", 0)),
        "indexer_sync_delay_seconds": float(delay.get("indexer_sync_delay_seconds", 0.0)),
    }  # fmt: skip


def run_golden(
    rules: RuleFile, spec: SeriesFile, *, start: float = GOLDEN_START, on_evaluation: Callable[[int, int], None] | None = None
) -> GoldenResult:
    """Run ``rules`` over ``spec`` (module docstring); returns the transitions and, when the file
    has ``expected``, the mismatches. ``on_evaluation(done, total)`` is called after each
    evaluation time (progress).

    Raises:
        GoldenError: the events break the agent's event contract (the agent would refuse them).
    """
    result = GoldenResult(start=start)
    batches = _events_by_batch(spec, start)
    with tempfile.TemporaryDirectory(prefix="kvscope-golden-") as tmp:
        store = Store.open(Path(tmp) / "golden.duckdb")
        try:
            clock = [start]
            scheduler = _scheduler(store, rules, spec, Path(tmp), clock)
            restarts = list(spec.agent_restarts)
            # the evaluation times of every group, from whole multiples of its interval
            due: dict[float, list[RuleGroup]] = defaultdict(list)
            total = sum(int(spec.duration / scheduler.interval_of(g) + 1e-9) for g in rules.groups)
            if total > MAX_EVALUATIONS:
                raise GoldenError(
                    f"{spec.source}: {total} evaluations over the rule groups' intervals (at most {MAX_EVALUATIONS}); "
                    "use a shorter duration or longer intervals"
                )
            for group in rules.groups:
                interval = scheduler.interval_of(group)
                for k in range(1, int(spec.duration / interval + 1e-9) + 1):
                    due[start + k * interval].append(group)
            pending = 0
            seq: dict[str, int] = defaultdict(int)
            done = 0
            for now in sorted(due):
                while restarts and start + restarts[0] <= now:
                    restarts.pop(0)
                    scheduler = _scheduler(store, rules, spec, Path(tmp), clock)
                while pending < len(batches) and batches[pending][0] <= now:
                    received, engine, events = batches[pending]
                    body = msgspec.json.encode(
                        {"schema_version": 1, "engine_id": engine, "seq": seq[engine], "sent_at": received, "events": events}
                    )
                    seq[engine] += 1
                    try:
                        batch = decode_batch(body)
                    except EventError as exc:
                        raise GoldenError(f"{spec.source}: the events of {engine} at {received - 1 - start:g} s break the event contract: {exc}") from None
                    ingest_batch(store, batch, received_at=to_timestamp(received))
                    pending += 1
                fold_cache_minute(store)
                clock[0] = now
                for group in due[now]:
                    result.notifications += scheduler.run_group(group, now)
                if on_evaluation is not None:
                    on_evaluation(done := done + 1, len(due))
        finally:
            store.close()
    if spec.expected is not None:
        result.mismatches = _compare(spec.expected, result.notifications, start)
    return result


def _scheduler(store: Store, rules: RuleFile, spec: SeriesFile, folder: Path, clock: list[float]) -> RuleScheduler:
    scheduler = RuleScheduler(
        store=store,
        rules=rules,
        log_path=folder / "alerts.log",
        registry=CollectorRegistry(),
        lag_seconds=spec.lag,
        interval_seconds=spec.interval,
        clock=lambda: clock[0],
    )
    scheduler.restore(clock[0])
    return scheduler


def _compare(expected: Sequence[Expected], got: Sequence[Notification], start: float) -> list[str]:
    """Mismatches between the expected and the actual notifications, evaluation by evaluation;
    within one evaluation time the order does not matter (as promtool compares alerts)."""
    def at(seconds: float) -> int:
        return round(seconds * 1000)

    wanted: dict[int, list[Expected]] = defaultdict(list)
    for e in expected:
        wanted[at(e.at)].append(e)
    happened: dict[int, list[Notification]] = defaultdict(list)
    for n in got:
        happened[at(n.at - start)].append(n)
    problems = []
    for moment in sorted(set(wanted) | set(happened)):
        left = list(happened.get(moment, []))
        for want in wanted.get(moment, []):
            match = next(
                (
                    n
                    for n in left
                    if n.alert == want.alert and n.status.value == want.status and all(n.labels.get(k) == v for k, v in want.labels.items())
                ),
                None,
            )
            if match is None:
                problems.append(f"expected {want.status} {want.alert} at {_since(want.at)} {dict(want.labels)} did not happen")
            else:
                left.remove(match)
        problems += [f"unexpected notification: {_line(n, start)}" for n in left]
    return problems


def _since(seconds: float) -> str:
    whole = round(seconds)
    h, rest = divmod(whole, 3600)
    m, s = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if m or h else "") + (f"{s}s" if s or not (h or m) else "")


def _line(n: Notification, start: float) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in sorted(n.labels.items()))
    value = f"{n.value:.6g}" if n.value is not None else "-"
    return f"{_since(n.at - start):>8}  {n.status.value:8}  {n.alert}{{{labels}}}  value={value}"


def render_notifications(result: GoldenResult, *, as_json: bool = False) -> str:
    """The transitions, one per line (a table, or JSON objects with ``as_json``)."""
    if as_json:
        return "".join(
            json.dumps(
                {"at": _since(n.at - result.start), "alert": n.alert, "status": n.status.value, "labels": dict(n.labels), "value": n.value, "annotations": dict(n.annotations)},
                sort_keys=True,
            )
            + "\n"
            for n in result.notifications
        )
    if not result.notifications:
        return "no notifications\n"
    return "".join(_line(n, result.start) + "\n" for n in result.notifications)
