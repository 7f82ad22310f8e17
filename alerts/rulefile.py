"""Alert rule files: YAML shaped like Prometheus alerting rules, loaded strictly.

A file holds ``groups``; a group has a ``name``, an optional ``interval`` and ``rules``. A rule
has ``alert`` (its name), either ``kind`` (a built-in rule kind, with that kind's settings) or
``expr`` (a named agent query or one read-only SQL statement returning a ``value`` column plus
label columns), and ``for``, ``keep_firing_for``, ``labels`` (``severity`` required) and
``annotations`` (``summary``, ``description``, ``runbook_url``, ...)::

    groups:
      - name: kvscope-cache
        interval: 1m
        rules:
          - alert: RecoverableHitRateDrop
            kind: recoverable_hit_rate_drop
            window: 5m
            baseline: trailing        # or: yesterday (the same window 24 h earlier)
            baseline_window: 1h
            fire_relative_drop: 0.3   # fire when current < baseline × (1 − 0.3) ...
            fire_absolute_drop: 0.1   # ... and baseline − current ≥ 0.1
            clear_relative_drop: 0.15
            clear_absolute_drop: 0.05
            min_prompt_tokens: 10000
            for: 2m
            keep_firing_for: 5m
            labels: {severity: page}
            annotations:
              summary: "Recoverable hit rate of {{ $labels.engine }} fell to {{ $value | humanizePercentage }}"

Durations use Prometheus's syntax (``1h30m``, ``90s``, ``500ms``; units ms, s, m, h, d, w, y).
Templates use the Prometheus subset ``{{ $labels.NAME }}``, ``{{ $value }}`` and the pipes
``humanize``, ``humanizePercentage``, ``humanizeDuration``.

Loading is strict: an unknown key, a wrong type, a bad duration, a bad template, an unknown
named query or parameter, or SQL that is not one read statement is a :class:`RuleFileError`
naming the file, the group, the rule and the field. Peer: Prometheus's rule-file format and
``promtool check rules``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from agent import queries, sql
from agent.config import read_yaml
from agent.ingest import RECOVERY_BUCKETS
from alerts import strict

DEFAULT_RULES_PATH = Path(__file__).with_name("default_rules.yaml")
"""The rule file that ships with kvscope."""

SEVERITIES = ("page", "ticket", "info")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
ALERT_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_DURATION = re.compile(
    r"(?:([0-9]+)y)?(?:([0-9]+)w)?(?:([0-9]+)d)?(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?(?:([0-9]+)ms)?"
)
MIN_GROUP_INTERVAL_SECONDS = 0.1
"""Shortest rule-group interval (each evaluation queries the store)."""
MAX_DURATION_SECONDS = 100 * 365 * 86400
"""Longest accepted duration (Prometheus's limit is about 292 years)."""
_DURATION_UNITS = (365 * 86400, 7 * 86400, 86400, 3600, 60, 1, 0.001)


class RuleFileError(ValueError):
    """A rule file that cannot be used; the message names the file, group, rule and field."""


def parse_duration(text: object) -> float:
    """A Prometheus duration (``1h30m``, ``90s``, ``500ms``; ``0``) in seconds.

    Raises:
        ValueError: not a duration, or longer than :data:`MAX_DURATION_SECONDS`.
    """
    if text == 0 and not isinstance(text, bool):
        return 0.0
    if not isinstance(text, str):
        raise ValueError(f"expected a duration such as 5m, got {type(text).__name__} {text!r}")
    if text == "0":
        return 0.0
    match = _DURATION.fullmatch(text)
    if not text or match is None or not any(match.groups()):
        raise ValueError(f"{text!r} is not a duration (use units ms, s, m, h, d, w, y, e.g. 1h30m)")
    seconds = sum(int(g) * unit for g, unit in zip(match.groups(), _DURATION_UNITS, strict=True) if g)
    if seconds > MAX_DURATION_SECONDS:
        raise ValueError(f"{text!r} is longer than 100 years")
    return float(seconds)


# -- templates ---------------------------------------------------------------------------------
_TEMPLATE_PART = re.compile(r"\{\{(.*?)\}\}", re.S)
_EXPRESSION = re.compile(r"\s*\$(value|labels\.([a-zA-Z_][a-zA-Z0-9_]*))\s*(?:\|\s*([a-zA-Z]+)\s*)?")
def format_value(value: float) -> str:
    """``$value`` as Prometheus prints a float (Go's shortest ``%g``): the fewest digits that
    read back exactly, in exponent form when the exponent is below −4 or at least 6
    (123456789 → ``1.23456789e+08``, 0.5 → ``0.5``)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "0"
    for digits in range(1, 18):
        scientific = f"{value:.{digits - 1}e}"
        if float(scientific) == value:
            break
    mantissa, _, exponent_text = scientific.partition("e")
    exponent = int(exponent_text)
    if exponent < -4 or exponent >= 6:
        if "." in mantissa:
            mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{'-' if exponent < 0 else '+'}{abs(exponent):02d}"
    return f"{value:.{max(digits - 1 - exponent, 0)}f}"


def humanize(value: float) -> str:
    """Prometheus's ``humanize``: SI prefixes, four significant digits (12345 → 12.35k)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.4g}"
    prefix = ""
    if abs(value) >= 1:
        for symbol in ("k", "M", "G", "T", "P", "E", "Z", "Y"):
            if abs(value) < 1000:
                break
            prefix, value = symbol, value / 1000
    else:
        for symbol in ("m", "u", "n", "p", "f", "a", "z", "y"):
            if abs(value) >= 1:
                break
            prefix, value = symbol, value * 1000
    return f"{value:.4g}{prefix}"


def humanize_duration(value: float) -> str:
    """Prometheus's ``humanizeDuration``: 5400 → ``1h 30m 0s``, 0.875 → ``875ms``."""
    if not math.isfinite(value):
        return f"{value:.4g}"
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value == 0:
        return "0s"
    if value >= 1:
        seconds = int(value)
        days, hours = seconds // 86400, seconds // 3600 % 24
        minutes, rest = seconds // 60 % 60, seconds % 60
        if days:
            return f"{sign}{days}d {hours}h {minutes}m {rest}s"
        if hours:
            return f"{sign}{hours}h {minutes}m {rest}s"
        if minutes:
            return f"{sign}{minutes}m {rest}s"
        return f"{sign}{value:.4g}s"
    prefix = ""
    for symbol in ("m", "u", "n", "p", "f", "a", "z", "y"):
        if value >= 1:
            break
        prefix, value = symbol, value * 1000
    return f"{sign}{value:.4g}{prefix}s"


PIPES: dict[str, Callable[[float], str]] = {
    "humanize": humanize,
    "humanizePercentage": lambda v: f"{v * 100:.4g}%",
    "humanizeDuration": humanize_duration,
}
"""Template pipes, as Prometheus's template functions of the same names format values."""


def check_template(text: str) -> None:
    """Raise ValueError naming the first ``{{ ... }}`` this template language does not know."""
    for match in _TEMPLATE_PART.finditer(text):
        expression = _EXPRESSION.fullmatch(match.group(1))
        if expression is None:
            raise ValueError(
                f"unsupported template {match.group(0)!r}: use {{{{ $value }}}}, "
                f"{{{{ $labels.NAME }}}} and the pipes {', '.join(PIPES)}"
            )
        pipe = expression.group(3)
        if pipe is not None and pipe not in PIPES:
            raise ValueError(f"unknown template pipe {pipe!r} in {match.group(0)!r}; known: {', '.join(PIPES)}")
        if pipe is not None and expression.group(2) is not None:
            raise ValueError(f"pipe {pipe!r} applies to $value only, not to labels, in {match.group(0)!r}")
    if "{{" in _TEMPLATE_PART.sub("", text) or "}}" in _TEMPLATE_PART.sub("", text):
        raise ValueError(f"unbalanced braces in template {text!r}")


def render_template(text: str, labels: Mapping[str, str], value: float | None) -> str:
    """Fill a checked template: ``$labels.NAME`` (empty when absent) and ``$value`` (``no
    data`` when None)."""

    def fill(match: re.Match[str]) -> str:
        expression = _EXPRESSION.fullmatch(match.group(1))
        assert expression is not None, "templates are checked at load"
        if expression.group(2) is not None:
            return labels.get(expression.group(2), "")
        if value is None:
            return "no data"
        pipe = expression.group(3)
        return PIPES[pipe](value) if pipe else format_value(value)

    return _TEMPLATE_PART.sub(fill, text)


# -- rule kinds --------------------------------------------------------------------------------
def _duration_field(default: str) -> Any:
    return field(default=parse_duration(default), metadata={"duration": True})


def _ratio(name: str, value: float, *, open_low: bool = False) -> None:
    if not (0.0 < value <= 1.0 if open_low else 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a ratio in {'(0' if open_low else '[0'}, 1], got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class HitRateDrop:
    """``recoverable_hit_rate_drop``: the recoverable hit rate (Σ recoverable / Σ prompt tokens)
    over ``window`` against a baseline (the ``baseline_window`` before it, or the same window a
    day earlier). Fires when it fell by at least ``fire_relative_drop`` of the baseline **and**
    ``fire_absolute_drop``; clears only when the drop is back within the (smaller) clear
    thresholds — hysteresis, so a series near the edge does not flap. Below
    ``min_prompt_tokens`` in either window a series has no data (never 0%)."""

    window: float = _duration_field("5m")
    baseline: Literal["trailing", "yesterday"] = "trailing"
    baseline_window: float = _duration_field("1h")
    fire_relative_drop: float = 0.3
    fire_absolute_drop: float = 0.1
    clear_relative_drop: float = 0.15
    clear_absolute_drop: float = 0.05
    min_prompt_tokens: int = 10_000

    def __post_init__(self) -> None:
        if self.baseline not in ("trailing", "yesterday"):
            raise ValueError(f"baseline must be trailing or yesterday, got {self.baseline!r}")
        for name in ("fire_relative_drop", "fire_absolute_drop", "clear_relative_drop", "clear_absolute_drop"):
            _ratio(name, getattr(self, name))
        if self.clear_relative_drop > self.fire_relative_drop or self.clear_absolute_drop > self.fire_absolute_drop:
            raise ValueError("clear thresholds must not exceed fire thresholds (hysteresis)")
        if self.window <= 0 or self.baseline_window <= 0:
            raise ValueError("window and baseline_window must be positive")
        if self.min_prompt_tokens < 1:
            raise ValueError(f"min_prompt_tokens must be >= 1, got {self.min_prompt_tokens}")


@dataclass(frozen=True, slots=True, kw_only=True)
class BurnWindow:
    """One multiwindow burn-rate condition: both windows burn the error budget at least
    ``burn_rate`` times as fast as the objective allows."""

    long: float
    short: float
    burn_rate: float
    severity: str

    @property
    def label(self) -> str:
        """The ``window`` label of its alerts: ``1h/5m``."""
        return f"{_compact(self.long)}/{_compact(self.short)}"

    def __post_init__(self) -> None:
        if not 0 < self.short < self.long:
            raise ValueError(f"need 0 < short < long, got short {self.short} s, long {self.long} s")
        if not (self.burn_rate > 0 and math.isfinite(self.burn_rate)):
            raise ValueError(f"burn_rate must be a finite number > 0, got {self.burn_rate}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {', '.join(SEVERITIES)}, got {self.severity!r}")


def _compact(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


DEFAULT_BURN_WINDOWS = (
    BurnWindow(long=3600, short=300, burn_rate=14.4, severity="page"),
    BurnWindow(long=6 * 3600, short=1800, burn_rate=6.0, severity="page"),
    BurnWindow(long=3 * 86400, short=6 * 3600, burn_rate=1.0, severity="ticket"),
)
"""The SRE workbook's multiwindow, multi-burn-rate set for a 30-day objective."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HitRateBelow:
    """``recoverable_hit_rate_below``: an SLO that the recoverable hit rate stays at or above
    ``objective``. The error ratio is the share of prompt tokens *not* recoverable; its burn rate
    is that over (1 − objective). Each of ``windows`` fires (with its severity) when both its
    long and short window burn at least its rate (Google SRE workbook, "Alerting on SLOs")."""

    objective: float = 0.95
    windows: tuple[BurnWindow, ...] = DEFAULT_BURN_WINDOWS
    min_prompt_tokens: int = 1000

    def __post_init__(self) -> None:
        if not 0.0 < self.objective < 1.0:
            raise ValueError(f"objective must be a ratio in (0, 1), got {self.objective}")
        if not self.windows:
            raise ValueError("windows must not be empty")
        for window in self.windows:
            if window.burn_rate * (1.0 - self.objective) > 1.0:
                raise ValueError(
                    f"burn rate {window.burn_rate:g} can never be reached with objective {self.objective:g} "
                    f"(the highest possible burn rate is {1 / (1 - self.objective):.4g}); raise the objective"
                )
        identities = [(w.long, w.short, w.severity) for w in self.windows]
        if len(set(identities)) != len(identities):
            raise ValueError("burn windows must differ in long, short or severity")
        if self.min_prompt_tokens < 1:
            raise ValueError(f"min_prompt_tokens must be >= 1, got {self.min_prompt_tokens}")


@dataclass(frozen=True, slots=True, kw_only=True)
class InvalidationSpike:
    """``form_invalidation_spike``: per (engine, form, reason), the reason's share of the form's
    lookups over ``window`` rose by at least ``min_share_increase`` (absolute) over its share in
    the ``baseline_window`` before, with at least ``min_lookups`` lookups in the window."""

    window: float = _duration_field("5m")
    baseline_window: float = _duration_field("1h")
    min_share_increase: float = 0.2
    min_lookups: int = 100

    def __post_init__(self) -> None:
        _ratio("min_share_increase", self.min_share_increase, open_low=True)
        if self.window <= 0 or self.baseline_window <= 0:
            raise ValueError("window and baseline_window must be positive")
        if self.min_lookups < 1:
            raise ValueError(f"min_lookups must be >= 1, got {self.min_lookups}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryLatencyHigh:
    """``recovery_latency_high``: per (engine, form, tier), the ``quantile`` of recovery seconds
    over ``window`` (from the ``cache_minute`` buckets) above ``threshold``, with at least
    ``min_recoveries`` recoveries."""

    quantile: float = 0.95
    threshold: float = _duration_field("500ms")
    window: float = _duration_field("5m")
    min_recoveries: int = 20

    def __post_init__(self) -> None:
        _ratio("quantile", self.quantile, open_low=True)
        if self.threshold <= 0 or self.window <= 0:
            raise ValueError("threshold and window must be positive")
        if self.threshold >= RECOVERY_BUCKETS[-1]:
            raise ValueError(
                f"threshold must be below the highest recovery-latency bucket ({RECOVERY_BUCKETS[-1]:g} s): "
                "a quantile above it cannot be estimated"
            )
        if self.min_recoveries < 1:
            raise ValueError(f"min_recoveries must be >= 1, got {self.min_recoveries}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SilentFor:
    """``ingest_stalled`` (no batch from any engine) / ``engine_silent`` (no event from an engine
    seen within ``lookback``) for ``silent_for``."""

    silent_for: float = _duration_field("5m")
    lookback: float = _duration_field("1h")

    def __post_init__(self) -> None:
        if not 0 < self.silent_for < self.lookback:
            raise ValueError("need 0 < silent_for < lookback")


KINDS: dict[str, type] = {
    "recoverable_hit_rate_drop": HitRateDrop,
    "recoverable_hit_rate_below": HitRateBelow,
    "form_invalidation_spike": InvalidationSpike,
    "recovery_latency_high": RecoveryLatencyHigh,
    "ingest_stalled": SilentFor,
    "engine_silent": SilentFor,
}
"""Built-in rule kinds → their settings."""

KindSettings = HitRateDrop | HitRateBelow | InvalidationSpike | RecoveryLatencyHigh | SilentFor


@dataclass(frozen=True, slots=True)
class NamedQueryExpr:
    """``expr: {query: NAME, params: {...}}``: a named agent query."""

    query: str
    params: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class SqlExpr:
    """``expr: "SELECT ..."``: one read-only statement returning ``value`` plus label columns."""

    sql: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """One alerting rule. Exactly one of ``settings`` (a built-in ``kind``) and ``expr``."""

    alert: str
    kind: str | None
    settings: KindSettings | None
    expr: NamedQueryExpr | SqlExpr | None
    for_seconds: float
    keep_firing_for_seconds: float
    labels: Mapping[str, str]
    annotations: Mapping[str, str]

    @property
    def severity(self) -> str:
        return self.labels["severity"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleGroup:
    """Rules evaluated together; ``interval_seconds`` None means the scheduler's default (every
    minute plus the ingest lag)."""

    name: str
    interval_seconds: float | None
    rules: tuple[Rule, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleFile:
    source: str
    groups: tuple[RuleGroup, ...]

    @property
    def rules(self) -> tuple[Rule, ...]:
        return tuple(rule for group in self.groups for rule in group.rules)


# -- loading -------------------------------------------------------------------------------------
def load_rule_file(path: str | Path) -> RuleFile:
    """Read and check a rule file.

    Raises:
        RuleFileError: unreadable file, bad YAML, or any rule that breaks the format (the
            message names the file, group, rule and field).
    """
    path = Path(path)
    return parse_rule_file(read_yaml(path, "rule file", RuleFileError), source=str(path))


def parse_rule_file(raw: object, *, source: str = "<rules>") -> RuleFile:
    """Check an already parsed rule file (what :func:`load_rule_file` read).

    Raises:
        RuleFileError: see :func:`load_rule_file`.
    """
    top = _mapping(raw, source, {"groups"}, required={"groups"})
    groups_raw = top["groups"]
    if not isinstance(groups_raw, list) or not groups_raw:
        raise RuleFileError(f"{source}: groups must be a non-empty list")
    groups: list[RuleGroup] = []
    seen_groups: set[str] = set()
    for i, group_raw in enumerate(groups_raw):
        where = f"{source}: group {i}"
        group = _mapping(group_raw, where, {"name", "interval", "rules"}, required={"name", "rules"})
        name = group["name"]
        if not isinstance(name, str) or not name:
            raise RuleFileError(f"{where}: name must be a non-empty string")
        where = f"{source}: group {name!r}"
        if name in seen_groups:
            raise RuleFileError(f"{where}: group names must be unique")
        seen_groups.add(name)
        interval = None
        if "interval" in group:
            interval = _field(where, "interval", lambda g=group: parse_duration(g["interval"]))  # type: ignore[misc]
            if interval < MIN_GROUP_INTERVAL_SECONDS:
                raise RuleFileError(f"{where}: field interval: must be at least 100ms")
        rules_raw = group["rules"]
        if not isinstance(rules_raw, list) or not rules_raw:
            raise RuleFileError(f"{where}: rules must be a non-empty list")
        rules = [_parse_rule(rule_raw, where, j) for j, rule_raw in enumerate(rules_raw)]
        names = [rule.alert for rule in rules]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise RuleFileError(f"{where}: rule {duplicate!r}: alert names must be unique in a group")
        groups.append(RuleGroup(name=name, interval_seconds=interval, rules=tuple(rules)))
    everywhere = [rule.alert for group in groups for rule in group.rules]
    duplicate = next((n for n in everywhere if everywhere.count(n) > 1), None)
    if duplicate is not None:
        raise RuleFileError(f"{source}: rule {duplicate!r}: alert names must be unique in the file (they name the alert's state)")
    return RuleFile(source=source, groups=tuple(groups))


_RULE_KEYS = {"alert", "kind", "expr", "for", "keep_firing_for", "labels", "annotations"}


def _parse_rule(raw: object, group_where: str, index: int) -> Rule:
    if not isinstance(raw, dict):
        raise RuleFileError(f"{group_where}: rule {index}: expected a mapping, got {type(raw).__name__}")
    alert = raw.get("alert")
    if not isinstance(alert, str) or not ALERT_NAME.fullmatch(alert):
        raise RuleFileError(f"{group_where}: rule {index}: field alert: must be a name like RecoverableHitRateDrop, got {alert!r}")
    where = f"{group_where}: rule {alert!r}"
    kind = raw.get("kind")
    settings_keys: set[str] = set()
    if kind is not None:
        if not isinstance(kind, str) or kind not in KINDS:
            raise RuleFileError(f"{where}: field kind: unknown kind {kind!r}; known: {', '.join(KINDS)}")
        settings_keys = {f.name for f in dataclasses.fields(KINDS[kind])}
    unknown = set(raw) - _RULE_KEYS - settings_keys
    if unknown:
        known = sorted(_RULE_KEYS | settings_keys)
        raise RuleFileError(f"{where}: unknown field {sorted(map(str, unknown))[0]!r}; known: {', '.join(known)}")
    if (kind is None) == ("expr" not in raw):
        raise RuleFileError(f"{where}: give exactly one of kind (a built-in rule) and expr (a query)")
    settings = None if kind is None else _settings(where, KINDS[kind], {k: raw[k] for k in settings_keys if k in raw})
    expr = None if kind is not None else _field(where, "expr", lambda: _expr(raw["expr"]))
    for_seconds = _field(where, "for", lambda: parse_duration(raw.get("for", "0")))
    keep = _field(where, "keep_firing_for", lambda: parse_duration(raw.get("keep_firing_for", "0")))
    labels = _string_map(where, "labels", raw.get("labels", {}))
    if labels.get("severity") not in SEVERITIES:
        raise RuleFileError(
            f"{where}: field labels.severity: required, one of {', '.join(SEVERITIES)}; got {labels.get('severity')!r}"
        )
    annotations = _string_map(where, "annotations", raw.get("annotations", {}))
    for key, template in annotations.items():
        _field(where, f"annotations.{key}", lambda t=template: check_template(t))  # type: ignore[misc]
    return Rule(
        alert=alert,
        kind=kind,
        settings=settings,
        expr=expr,
        for_seconds=for_seconds,
        keep_firing_for_seconds=keep,
        labels=labels,
        annotations=annotations,
    )


def _settings(where: str, cls: type, raw: Mapping[str, object]) -> KindSettings:
    values: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        value = raw[f.name]
        if f.metadata.get("duration"):
            values[f.name] = _field(where, f.name, lambda v=value: parse_duration(v))  # type: ignore[misc]
        elif f.name == "windows":
            values[f.name] = _field(where, f.name, lambda v=value: _burn_windows(v))  # type: ignore[misc]
        else:
            values[f.name] = _field(where, f.name, lambda v=value, d=f.default: _scalar(v, d))  # type: ignore[misc]
    try:
        settings: KindSettings = cls(**values)
    except ValueError as exc:
        raise RuleFileError(f"{where}: {exc}") from None
    return settings


def _scalar(value: object, default: object) -> object:
    """``value`` checked against the type of the field's default (ints accepted for floats)."""
    if isinstance(default, bool) or isinstance(value, bool):
        raise ValueError(f"expected a number or name, got {value!r}")
    if isinstance(default, float) and isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"must be finite, got {value}")
        return float(value)
    if isinstance(default, int) and isinstance(value, int):
        return value
    if isinstance(default, str) and isinstance(value, str):
        return value
    raise ValueError(f"expected {type(default).__name__}, got {type(value).__name__} {value!r}")


def _burn_windows(value: object) -> tuple[BurnWindow, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("expected a non-empty list of {long, short, burn_rate, severity}")
    windows = []
    for item in value:
        if not isinstance(item, dict) or set(item) != {"long", "short", "burn_rate", "severity"}:
            raise ValueError(f"each window needs exactly long, short, burn_rate, severity; got {item!r}")
        rate = item["burn_rate"]
        if isinstance(rate, bool) or not isinstance(rate, int | float):
            raise ValueError(f"burn_rate must be a number, got {rate!r}")
        windows.append(
            BurnWindow(
                long=parse_duration(item["long"]),
                short=parse_duration(item["short"]),
                burn_rate=float(rate),
                severity=str(item["severity"]),
            )
        )
    return tuple(windows)


def _expr(value: object) -> NamedQueryExpr | SqlExpr:
    if isinstance(value, str):
        try:
            sql.check_read_only(value)
        except sql.SqlError as exc:
            raise ValueError(exc.reason) from None
        return SqlExpr(value)
    if isinstance(value, dict) and set(value) <= {"query", "params"} and "query" in value:
        params = value.get("params", {})
        if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
            raise ValueError("params must be a mapping of parameter names to values")
        text = {k: str(v) for k, v in params.items()}
        try:
            query = queries.get_query(str(value["query"]))
            query.bind(text, now=datetime.now(UTC).replace(tzinfo=None))
        except queries.QueryError as exc:
            raise ValueError(exc.reason) from None
        if "value" not in query.columns:
            raise ValueError(
                f"named query {query.name} returns no value column ({', '.join(query.columns)}); "
                "write the rule's SQL instead"
            )
        return NamedQueryExpr(query.name, text)
    raise ValueError("expected one SQL statement (a string) or {query: NAME, params: {...}}")


def _string_map(where: str, name: str, value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise RuleFileError(f"{where}: field {name}: expected a mapping, got {type(value).__name__}")
    out: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not LABEL_NAME.fullmatch(key) or key.startswith("__"):
            raise RuleFileError(f"{where}: field {name}: {key!r} is not a valid name")
        if not isinstance(item, str):
            raise RuleFileError(f"{where}: field {name}.{key}: expected a string, got {type(item).__name__}")
        out[key] = item
    return out


def _mapping(value: object, where: str, allowed: set[str], *, required: set[str]) -> dict[str, Any]:
    return strict.mapping(value, where, allowed, required, error=RuleFileError)


def _field(where: str, name: str, parse: Callable[[], Any]) -> Any:
    return strict.parsed(f"{where}: field {name}", parse, error=RuleFileError)
