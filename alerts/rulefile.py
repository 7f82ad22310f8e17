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
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agent import queries, sql
from agent.config import read_yaml
from alerts import strict
from alerts.durations import MAX_DURATION_SECONDS as MAX_DURATION_SECONDS
from alerts.durations import MIN_GROUP_INTERVAL_SECONDS as MIN_GROUP_INTERVAL_SECONDS
from alerts.durations import SEVERITIES as SEVERITIES
from alerts.durations import parse_duration as parse_duration
from alerts.rule_kinds import DEFAULT_BURN_WINDOWS as DEFAULT_BURN_WINDOWS
from alerts.rule_kinds import KINDS as KINDS
from alerts.rule_kinds import BurnWindow as BurnWindow
from alerts.rule_kinds import HitRateBelow as HitRateBelow
from alerts.rule_kinds import HitRateDrop as HitRateDrop
from alerts.rule_kinds import IndexerSyncDelay as IndexerSyncDelay
from alerts.rule_kinds import InvalidationSpike as InvalidationSpike
from alerts.rule_kinds import KindSettings as KindSettings
from alerts.rule_kinds import RankDisagreement as RankDisagreement
from alerts.rule_kinds import RecoveryLatencyHigh as RecoveryLatencyHigh
from alerts.rule_kinds import SilentFor as SilentFor
from alerts.templates import PIPES as PIPES
from alerts.templates import bind_dashboard_url
from alerts.templates import check_template as check_template
from alerts.templates import format_value as format_value
from alerts.templates import humanize as humanize
from alerts.templates import humanize_duration as humanize_duration
from alerts.templates import render_template as render_template

DEFAULT_RULES_PATH = Path(__file__).with_name("default_rules.yaml")
"""The rule file that ships with kvscope."""

LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
ALERT_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class RuleFileError(ValueError):
    """A rule file that cannot be used; the message names the file, group, rule and field."""


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
    """One alerting rule: ``settings`` for a built-in ``kind``, ``expr`` for a query. A kind
    evaluated by a named query (``indexer_sync_delay``: settings with ``named_query()``) has
    both, and is evaluated as that ``expr``."""

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

    def with_dashboard_url(self, dashboard_url: str) -> RuleFile:
        """The same rules with ``{{ $dashboardURL }}`` in their annotations bound to
        ``dashboard_url`` (the agent's ``dashboard_url``)."""

        def bound(rule: Rule) -> Rule:
            return replace(rule, annotations={k: bind_dashboard_url(t, dashboard_url) for k, t in rule.annotations.items()})

        return replace(self, groups=tuple(replace(g, rules=tuple(bound(r) for r in g.rules)) for g in self.groups))


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
    if settings is not None and hasattr(settings, "named_query"):  # a kind its named query evaluates
        expr = _field(where, "kind", lambda: _expr(settings.named_query()))
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
