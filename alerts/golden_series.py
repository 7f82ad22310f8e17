"""The golden series file of ``kvscope alerts test`` (format in :mod:`alerts.golden`): its
expanding notation, its dataclasses and its strict loader."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import read_yaml
from alerts import strict
from alerts.rulefile import parse_duration

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


_REQUEST_LABELS = {"engine", "model"}
_LOOKUP_LABELS = {"engine", "model", "form", "tier", "outcome", "reason"}
_OPTIONAL_LABELS = {"requests": set(), "lookups": {"tp_rank"}}
"""Labels a series may add (a lookup's tensor-parallel rank, 0 when absent)."""
_SYNC_DELAY = ("indexer_sync_delay_tokens", "indexer_sync_delay_seconds")
"""Optional values of ``indexer_state`` lookups: each one's indexer sync delay (0 when absent)."""
_SECONDS = {"recovery_seconds", "indexer_sync_delay_seconds"}
_KINDS = {
    "requests": (_REQUEST_LABELS, {"prompt_tokens", "recoverable_tokens"}, {"prompt_tokens", "recoverable_tokens"}),
    "lookups": (_LOOKUP_LABELS, {"count", "recovery_seconds", *_SYNC_DELAY}, {"count"}),
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
        optional = _OPTIONAL_LABELS[kind]
        if not isinstance(labels, dict) or not label_names <= set(labels) <= label_names | optional or not all(isinstance(v, str) and v for v in labels.values()):
            also = f", optionally {', '.join(sorted(optional))}" if optional else ""
            raise GoldenError(f"{where}: field {kind}: needs exactly the labels {', '.join(sorted(label_names))}{also} (non-empty strings)")
        if "tp_rank" in labels and not labels["tp_rank"].isdigit():
            raise GoldenError(f"{where}: field {kind}: tp_rank must be a rank number, got {labels['tp_rank']!r}")
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
            if name not in _SECONDS and any(v is not None and v != int(v) for v in vals):
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


def _duration(doc: Mapping[str, Any], name: str, where: str, *, default: str | None = None) -> float:
    value = doc.get(name, default)
    return _parse(lambda: parse_duration(value), f"{where}: field {name}")


def _parse(parse: Any, where: str) -> Any:
    return strict.parsed(where, parse, error=GoldenError)


def _list(value: object, where: str) -> list[Any]:
    return strict.items(value, where, error=GoldenError)


def _mapping(value: object, where: str, allowed: set[str], required: set[str]) -> dict[str, Any]:
    return strict.mapping(value, where, allowed, required, error=GoldenError)
