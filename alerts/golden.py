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
import math
import tempfile
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from agent.config import read_yaml
from agent.ingest import ingest_batch
from agent.rollups import fold_cache_minute
from agent.store import Store, to_timestamp
from alerts import strict
from alerts.rule_eval import Notification
from alerts.rule_scheduler import RuleScheduler
from alerts.rulefile import RuleFile, RuleGroup, parse_duration
from engine.events import EventError, decode_batch

GOLDEN_START = 1_800_000_000.0
"""Unix seconds of the series' first step (a minute boundary, 2027-01-15 08:00 UTC)."""


MAX_VALUES = 1_000_000
"""Most values one series field may expand to."""
MAX_LOOKUPS_PER_STEP = 100_000
MAX_EVALUATIONS = 100_000
"""Most evaluations of one run, over every rule group (about 10 ms each)."""


class GoldenError(ValueError):
    """A series file that cannot be used; the message names the file and the field."""


def expand(text: object) -> list[float | None]:
    """promtool's expanding notation (module docstring) as a list of values (None: missing).

    Raises:
        ValueError: not in the notation.
    """
    if isinstance(text, int | float) and not isinstance(text, bool):
        return [float(text)]
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected values such as '100x59 50x60', got {text!r}")
    out: list[float | None] = []
    for term in text.split():
        body, x, times_text = term.partition("x")
        if x and not times_text.isdigit():
            raise ValueError(f"{term!r}: the count after x must be a whole number")
        times = int(times_text) if x else None
        if body == "_":
            if len(out) + (times or 1) > MAX_VALUES:
                raise ValueError(f"more than {MAX_VALUES} values")
            out.extend([None] * (times if times is not None else 1))
            continue
        # a, a+b or a-b (a may carry a sign and an exponent of its own)
        cut = next((k for k in range(1, len(body)) if body[k] in "+-" and body[k - 1] not in "eE"), None)
        try:
            start = float(body if cut is None else body[:cut])
            step = 0.0 if cut is None else float(body[cut:])
        except ValueError:
            raise ValueError(f"{term!r} is not a value, '_', '_xn', 'axn' or 'a+bxn'") from None
        if cut is not None and times is None:
            raise ValueError(f"{term!r}: an increment needs a count (a+bxn)")
        if not (math.isfinite(start) and math.isfinite(step)):
            raise ValueError(f"{term!r}: values must be finite")
        if len(out) + (times or 0) + 1 > MAX_VALUES:
            raise ValueError(f"more than {MAX_VALUES} values")
        if times is None:
            out.append(start)
        else:
            out.extend(start + step * k for k in range(times + 1))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class GoldenSeries:
    kind: str
    """``requests`` or ``lookups``."""
    labels: Mapping[str, str]
    step: float
    values: Mapping[str, list[float | None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Expected:
    at: float
    alert: str
    status: str
    labels: Mapping[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class SeriesFile:
    source: str
    interval: float
    duration: float
    lag: int
    series: tuple[GoldenSeries, ...]
    agent_restarts: tuple[float, ...] = ()
    expected: tuple[Expected, ...] | None = None


@dataclass(slots=True)
class GoldenResult:
    notifications: list[Notification] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    start: float = GOLDEN_START


_REQUEST_LABELS = {"engine", "model"}
_LOOKUP_LABELS = {"engine", "model", "form", "tier", "outcome", "reason"}
_KINDS = {
    "requests": (_REQUEST_LABELS, {"prompt_tokens", "recoverable_tokens"}, {"prompt_tokens", "recoverable_tokens"}),
    "lookups": (_LOOKUP_LABELS, {"count", "recovery_seconds"}, {"count"}),
}


def load_series(path: str | Path) -> SeriesFile:
    """Read and check a series file.

    Raises:
        GoldenError: unreadable, bad YAML, or a field that breaks the format.
    """
    path = Path(path)
    return parse_series(read_yaml(path, "series file", GoldenError), source=str(path))


def parse_series(raw: object, *, source: str = "<series>") -> SeriesFile:
    """Check an already parsed series file (see :func:`load_series`)."""
    top = _mapping(raw, source, {"interval", "duration", "lag", "agent_restarts", "series", "expected"}, {"duration", "series"})
    interval = _duration(top, "interval", source, default="1m")
    duration = _duration(top, "duration", source)
    lag = _duration(top, "lag", source, default="5s")
    if interval <= 0 or duration <= 0:
        raise GoldenError(f"{source}: interval and duration must be positive")
    if lag != int(lag) or not 0 <= lag <= 59:
        raise GoldenError(f"{source}: field lag: must be whole seconds in [0s, 59s]")
    if duration / interval > 100_000:
        raise GoldenError(f"{source}: more than 100000 evaluations; use a longer interval or a shorter duration")
    restarts = []
    for i, item in enumerate(_list(top.get("agent_restarts", []), f"{source}: agent_restarts")):
        restarts.append(_parse(lambda v=item: parse_duration(v), f"{source}: agent_restarts[{i}]"))
        if not 0 < restarts[-1] <= duration:
            raise GoldenError(f"{source}: agent_restarts[{i}]: must be within the duration")
    series = []
    for i, item in enumerate(_list(top["series"], f"{source}: series")):
        where = f"{source}: series[{i}]"
        if not isinstance(item, dict):
            raise GoldenError(f"{where}: expected a mapping, got {type(item).__name__}")
        kinds = [k for k in _KINDS if k in item]
        if len(kinds) != 1:
            raise GoldenError(f"{where}: needs exactly one of {', '.join(_KINDS)} (with the series' labels)")
        kind = kinds[0]
        label_names, value_names, required = _KINDS[kind]
        doc = _mapping(item, where, {kind, "step", *value_names}, required)
        labels = doc[kind]
        if not isinstance(labels, dict) or set(labels) != label_names or not all(isinstance(v, str) and v for v in labels.values()):
            raise GoldenError(f"{where}: field {kind}: needs exactly the labels {', '.join(sorted(label_names))} (non-empty strings)")
        step = _duration(doc, "step", where, default=None) if "step" in doc else interval
        if step <= 0:
            raise GoldenError(f"{where}: field step: must be positive")
        values = {name: _parse(lambda v=doc[name]: expand(v), f"{where}: field {name}") for name in value_names if name in doc}
        lengths = {len(v) for v in values.values()}
        if len(lengths) != 1:
            raise GoldenError(f"{where}: its value fields have different lengths ({', '.join(f'{k}: {len(v)}' for k, v in values.items())})")
        for name, vals in values.items():
            if any(v is not None and v < 0 for v in vals):
                raise GoldenError(f"{where}: field {name}: values must be >= 0")
            if name != "recovery_seconds" and any(v is not None and v != int(v) for v in vals):
                raise GoldenError(f"{where}: field {name}: token counts and lookup counts are whole numbers")
        if kind == "lookups" and any(v is not None and v > MAX_LOOKUPS_PER_STEP for v in values["count"]):
            raise GoldenError(f"{where}: field count: at most {MAX_LOOKUPS_PER_STEP} lookups per step")
        series.append(GoldenSeries(kind=kind, labels=dict(labels), step=step, values=values))
    expected = None
    if "expected" in top:
        expected = []
        for i, item in enumerate(_list(top["expected"] or [], f"{source}: expected")):
            where = f"{source}: expected[{i}]"
            doc = _mapping(item, where, {"at", "alert", "status", "labels"}, {"at", "alert", "status"})
            if doc["status"] not in ("firing", "resolved"):
                raise GoldenError(f"{where}: field status: firing or resolved, got {doc['status']!r}")
            labels = doc.get("labels", {})
            if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
                raise GoldenError(f"{where}: field labels: expected a mapping of label names to strings")
            if not isinstance(doc["alert"], str):
                raise GoldenError(f"{where}: field alert: expected an alert name")
            at = _parse(lambda d=doc: parse_duration(d["at"]), f"{where}: field at")
            expected.append(Expected(at=at, alert=str(doc["alert"]), status=doc["status"], labels={str(k): str(v) for k, v in labels.items()}))
    return SeriesFile(
        source=source, interval=interval, duration=duration, lag=int(lag), series=tuple(series),
        agent_restarts=tuple(sorted(restarts)), expected=tuple(expected) if expected is not None else None,
    )  # fmt: skip


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
                if count is None:
                    continue
                for k in range(int(count)):
                    batches[(at, engine)].append(_lookup_event(at, s.labels, f"s{n}-{i}-{k}", latency or 0.0))
    return [(at + 1.0, engine, events) for (at, engine), events in sorted(batches.items())]


def _request_event(at: float, engine: str, model: str, request_id: str, p: int, r: int) -> dict[str, Any]:
    return {
        "kind": "request", "ts": at + 0.5, "engine_id": engine, "request_id": request_id, "model": model,
        "prompt_tokens": p, "output_tokens": 1, "hash_hit_tokens": r, "resume_tokens": min(r, max(p - 1, 0)),
        "recoverable_tokens": r, "replayed_tokens": 0, "recomputed_tokens": p - r, "admission": "exact",
        "ttft_seconds": 0.1, "e2e_seconds": 0.2,
    }  # fmt: skip


def _lookup_event(at: float, labels: Mapping[str, str], request_id: str, recovery: float) -> dict[str, Any]:
    return {
        "kind": "cache_lookup", "ts": at + 0.5, "engine_id": labels["engine"], "request_id": request_id,
        "model": labels["model"], "form": labels["form"], "tier": labels["tier"], "outcome": labels["outcome"],
        "reason": labels["reason"], "hash_hit_tokens": 16, "usable_tokens": 16,
        "recoverable_tokens": 0 if labels["outcome"] == "invalidated" else 16, "recovery_seconds": recovery,
    }  # fmt: skip


def run_golden(rules: RuleFile, spec: SeriesFile, *, start: float = GOLDEN_START) -> GoldenResult:
    """Run ``rules`` over ``spec`` (module docstring); returns the transitions and, when the file
    has ``expected``, the mismatches.

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


def _duration(doc: Mapping[str, Any], name: str, where: str, *, default: str | None = None) -> float:
    value = doc.get(name, default)
    return _parse(lambda: parse_duration(value), f"{where}: field {name}")


def _parse(parse: Any, where: str) -> Any:
    return strict.parsed(where, parse, error=GoldenError)


def _list(value: object, where: str) -> list[Any]:
    return strict.items(value, where, error=GoldenError)


def _mapping(value: object, where: str, allowed: set[str], required: set[str]) -> dict[str, Any]:
    return strict.mapping(value, where, allowed, required, error=GoldenError)
