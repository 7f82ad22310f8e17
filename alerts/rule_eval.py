"""The pure evaluator of rule-file rules (:mod:`alerts.rulefile`):
``evaluate(rules, data, now, previous_state) -> (state, notifications)``.

No I/O and no clock: the windowed inputs of every series come in ``data`` (what the scheduler
queried), the time in ``now``, so golden time series pin the behaviour exactly.

Per series, each kind first gives a **verdict**: active, inactive, or no data, plus a value:

* ``recoverable_hit_rate_drop`` — value is the current recoverable hit rate (Σ recoverable /
  Σ prompt tokens over the window). Active when it fell below the baseline's by at least both
  fire thresholds (relative to the baseline, and absolute); once active, it stays active until
  the drop is below either clear threshold (hysteresis). No data when either window has fewer
  than ``min_prompt_tokens`` prompt tokens.
* ``recoverable_hit_rate_below`` — the error ratio (share of prompt tokens not recoverable) over
  each window, as a burn rate = error ratio / (1 − objective). Each burn window is its own alert
  series (labels ``window="1h/5m"`` and that window's ``severity``): active when both its long and
  short window burn at least its rate; the value is the short window's burn rate. No data when
  the short window lacks volume, or the long window lacks volume from before the short one (a
  series younger than its short window, e.g. a fresh engine's cold start).
* ``form_invalidation_spike`` — value is the reason's share of the form's lookups in the window;
  active when it exceeds the baseline share by ``min_share_increase``; no data when the window
  or the baseline has fewer than ``min_lookups`` lookups.
* ``tp_rank_disagreement`` — value is how many lookups another tensor-parallel rank held back
  (``tp_disagree``) in the window, per (engine, form, tp_rank); active at ``min_disagreements``;
  a series without any in the window is inactive.
* ``recovery_latency_high`` — value is the ``quantile`` of recovery seconds estimated from
  cumulative bucket counts as Prometheus's ``histogram_quantile`` does (linear within a bucket);
  active above ``threshold``; no data below ``min_recoveries``.
* ``ingest_stalled`` / ``engine_silent`` — value is seconds since the last event; active when at
  least ``silent_for``, unless the engine is retired (silent past the lookback). Never no data
  (silence is the signal).
* ``expr`` rules — as in Prometheus, every series the query returns (with a non-NULL ``value``)
  is active, with that value; write the condition into the query (``WHERE ratio < 0.5``). A
  series the query no longer returns is inactive (its last value is kept).

Then Prometheus's alert state machine, per fingerprint (rule name + sorted labels):
inactive → **pending** when active (straight to firing when ``for`` is 0) → **firing** once
active for ``for`` → **resolved** once inactive for ``keep_firing_for``. A pending alert that
turns inactive, loses its data or disappears goes back to inactive silently; one not evaluated
for over an hour (an agent outage) starts its ``for`` over. **No data does not resolve a firing
alert** (an engine that stopped serving has not recovered) — until it has lasted an hour
(:data:`NO_DATA_RESOLVE_SECONDS`): then the series is gone, and its alert resolves. Hysteresis (the drop kind's clear
thresholds) applies only once an alert fires. Exactly one notification per firing and per
resolve; re-sending while firing is the receivers' job. Labels are the series' labels overridden
by the rule's. Inactive alerts are not kept; resolved ones for 15 minutes; the firing alerts of
a rule removed from the file are resolved.

Peers: Prometheus's rule manager (pending/``for``/``keep_firing_for``, ``histogram_quantile``);
the SRE workbook's multiwindow burn-rate alerts.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from alerts.histogram import histogram_quantile as histogram_quantile
from alerts.rulefile import (
    HitRateBelow,
    HitRateDrop,
    InvalidationSpike,
    RankDisagreement,
    RecoveryLatencyHigh,
    Rule,
    SilentFor,
    render_template,
)

Labels = tuple[tuple[str, str], ...]
"""A series' labels, sorted by name."""


@dataclass(frozen=True, slots=True)
class Tokens:
    """Σ recoverable and Σ prompt tokens of one series over one window."""

    recoverable: int
    prompt: int

    def error_ratio(self) -> float:
        return 1.0 - self.recoverable / self.prompt


@dataclass(frozen=True, slots=True)
class DropInput:
    current: Tokens
    baseline: Tokens


@dataclass(frozen=True, slots=True)
class BurnInput:
    windows: tuple[tuple[Tokens, Tokens], ...]
    """(long, short) per burn window of the rule, in order."""


@dataclass(frozen=True, slots=True)
class ShareInput:
    reason_lookups: int
    form_lookups: int
    baseline_reason_lookups: int
    baseline_form_lookups: int


@dataclass(frozen=True, slots=True)
class CountInput:
    count: int
    """Events of the series in the window (``tp_rank_disagreement``: lookups held back)."""


@dataclass(frozen=True, slots=True)
class LatencyInput:
    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    """Counts of recoveries ≤ each bound, then the total (the +Inf bucket) last."""


@dataclass(frozen=True, slots=True)
class SilenceInput:
    seconds_since_last: float
    retired: bool = False
    """Silent for longer than the rule's lookback: gone for good, never alerting."""


SeriesInput = DropInput | BurnInput | ShareInput | CountInput | LatencyInput | SilenceInput | float | None
"""What one series brings: the kind's input, an expr rule's value, or None (no data)."""

Data = Mapping[str, Mapping[Labels, SeriesInput]]
"""Rule name → series labels → input."""


@dataclass(frozen=True, slots=True)
class Verdict:
    active: bool | None
    """None: no data."""
    value: float | None


class Status(enum.StrEnum):
    INACTIVE = "inactive"
    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"


@dataclass(frozen=True, slots=True, kw_only=True)
class AlertState:
    """One alert: ``active_since`` when its condition last turned true (pending time),
    ``firing_since``, ``inactive_since`` while a firing alert's condition is false
    (``keep_firing_for``), the last value."""

    alert: str
    fingerprint: str
    labels: Mapping[str, str]
    series: Labels
    """The series key in the rule's data (the labels before the rule's own were added)."""
    status: Status
    active_since: float | None = None
    firing_since: float | None = None
    inactive_since: float | None = None
    resolved_at: float | None = None
    evaluated_at: float | None = None
    value: float | None = None


State = Mapping[str, AlertState]

RESOLVED_RETENTION_SECONDS = 900.0
"""A resolved alert's state is kept this long (Prometheus keeps resolved alerts 15 minutes)."""
OUTAGE_TOLERANCE_SECONDS = 3600.0
"""A pending alert not evaluated for longer than this (an agent outage) starts its ``for`` over,
as Prometheus's ``rules.alert.for-outage-tolerance``."""


NO_DATA_RESOLVE_SECONDS = 3600.0
"""A firing alert whose series has had no data for this long resolves: the series is gone (an
engine restarted under a new id), not merely quiet."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Notification:
    alert: str
    fingerprint: str
    status: Status
    labels: Mapping[str, str]
    value: float | None
    at: float
    annotations: Mapping[str, str]


def fingerprint(alert: str, labels: Mapping[str, str]) -> str:
    """sha256 (hex) of the rule name and the sorted labels: the alert's stable identity."""
    canonical = json.dumps([alert, sorted(labels.items())], separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def verdict(rule: Rule, series: SeriesInput, was_active: bool) -> Verdict:
    """The kind's verdict for one series (see the module docstring).

    Raises:
        TypeError: the input does not match the rule's kind (a scheduler bug).
    """
    settings = rule.settings
    if series is None:
        return Verdict(None, None)
    if rule.expr is not None:
        if not isinstance(series, int | float):
            raise TypeError(f"{rule.alert}: an expr rule needs a number, got {series!r}")
        return Verdict(True, float(series))
    if isinstance(settings, HitRateDrop) and isinstance(series, DropInput):
        return _drop(settings, series, was_active)
    if isinstance(settings, InvalidationSpike) and isinstance(series, ShareInput):
        return _spike(settings, series)
    if isinstance(settings, RankDisagreement) and isinstance(series, CountInput):
        return Verdict(series.count >= settings.min_disagreements, float(series.count))
    if isinstance(settings, RecoveryLatencyHigh) and isinstance(series, LatencyInput):
        return _latency(settings, series)
    if isinstance(settings, SilentFor) and isinstance(series, SilenceInput):
        return Verdict(not series.retired and series.seconds_since_last >= settings.silent_for, series.seconds_since_last)
    raise TypeError(f"{rule.alert}: input {type(series).__name__} does not fit kind {rule.kind}")


def _drop(s: HitRateDrop, x: DropInput, was_active: bool) -> Verdict:
    if x.current.prompt < s.min_prompt_tokens or x.baseline.prompt < s.min_prompt_tokens:
        return Verdict(None, None)
    current = x.current.recoverable / x.current.prompt
    baseline = x.baseline.recoverable / x.baseline.prompt
    absolute = baseline - current
    relative = absolute / baseline if baseline > 0 else 0.0
    if was_active:
        cleared = relative < s.clear_relative_drop or absolute < s.clear_absolute_drop
        return Verdict(not cleared, current)
    return Verdict(relative >= s.fire_relative_drop and absolute >= s.fire_absolute_drop, current)


def burn_verdicts(s: HitRateBelow, x: BurnInput | None) -> list[tuple[dict[str, str], Verdict]]:
    """One (labels, verdict) per burn window: ``window`` and ``severity`` labels; active when both
    its long and short window burn at least its rate; no data when the short window lacks volume
    or the long window lacks volume from before the short one."""
    if x is not None and len(x.windows) != len(s.windows):
        raise TypeError(f"need {len(s.windows)} burn windows, got {len(x.windows)}")
    budget = 1.0 - s.objective
    out: list[tuple[dict[str, str], Verdict]] = []
    for i, window in enumerate(s.windows):
        labels = {"window": window.label, "severity": window.severity}
        if x is None:
            out.append((labels, Verdict(None, None)))
            continue
        long, short = x.windows[i]
        # the long window must also hold volume from before the short one: a series younger than
        # its short window (a fresh engine's cold start) has no history for the long window to judge
        if short.prompt < s.min_prompt_tokens or long.prompt - short.prompt < s.min_prompt_tokens:
            out.append((labels, Verdict(None, None)))
            continue
        long_rate, short_rate = long.error_ratio() / budget, short.error_ratio() / budget
        out.append((labels, Verdict(long_rate > window.burn_rate and short_rate > window.burn_rate, short_rate)))
    return out


def _spike(s: InvalidationSpike, x: ShareInput) -> Verdict:
    if x.form_lookups < s.min_lookups or x.baseline_form_lookups < s.min_lookups:
        return Verdict(None, None)  # no baseline is not a 0 % baseline
    share = x.reason_lookups / x.form_lookups
    baseline = x.baseline_reason_lookups / x.baseline_form_lookups
    return Verdict(share - baseline >= s.min_share_increase, share)


def _latency(s: RecoveryLatencyHigh, x: LatencyInput) -> Verdict:
    if len(x.cumulative) != len(x.bounds) + 1:
        raise TypeError("need one cumulative count per bound plus the total")
    if x.cumulative[-1] < s.min_recoveries:
        return Verdict(None, None)
    value = histogram_quantile(s.quantile, x.bounds, x.cumulative)
    return Verdict(value > s.threshold, value)


def evaluate(
    rules: Sequence[Rule], data: Data, now: float, previous_state: State
) -> tuple[dict[str, AlertState], list[Notification]]:
    """Evaluate every rule's series at ``now`` (unix seconds). Returns the new state
    (``previous_state`` is not modified) and the notifications (firing, resolved): first the
    resolves of alerts whose rule is gone, then by rule, then by series labels.

    Every series in ``data`` and every series the state knows for the rule is stepped: a known
    series missing from ``data`` is no data (built-in kinds) or inactive (expr rules). Labels are
    the series' labels overridden by the rule's (as Prometheus's), plus ``window``/``severity``
    per burn window. Inactive alerts are dropped from the state, resolved ones after
    :data:`RESOLVED_RETENTION_SECONDS`.
    """
    state = dict(previous_state)
    notifications: list[Notification] = []
    names = {rule.alert for rule in rules}
    for fp, gone in sorted(state.items()):
        if gone.alert in names:
            continue
        del state[fp]
        if gone.status == Status.FIRING:
            notifications.append(_note(gone.alert, fp, Status.RESOLVED, gone.labels, gone.value, now, {}))
    for rule in rules:
        inputs = data.get(rule.alert, {})
        known = {st.series for st in state.values() if st.alert == rule.alert}
        for key in sorted(set(inputs) | known):
            for extra, v in _verdicts(rule, key, inputs, state):
                labels = {**dict(key), **rule.labels, **extra}
                fp = fingerprint(rule.alert, labels)
                after, change = _step(rule, state.get(fp), fp, key, labels, v, now)
                if after is None:
                    state.pop(fp, None)
                else:
                    state[fp] = after
                if change is not None:
                    if change == Status.RESOLVED and after is not None:
                        value = after.value  # the last active value
                    else:
                        value = v.value if v.value is not None else (after.value if after is not None else None)
                    annotations = {k: render_template(t, labels, value) for k, t in rule.annotations.items()}
                    notifications.append(_note(rule.alert, fp, change, labels, value, now, annotations))
    return state, notifications


def _note(
    alert: str, fp: str, status: Status, labels: Mapping[str, str], value: float | None, at: float, annotations: Mapping[str, str]
) -> Notification:
    return Notification(alert=alert, fingerprint=fp, status=status, labels=labels, value=value, at=at, annotations=annotations)


def _verdicts(
    rule: Rule, key: Labels, inputs: Mapping[Labels, SeriesInput], state: Mapping[str, AlertState]
) -> list[tuple[dict[str, str], Verdict]]:
    present = key in inputs
    raw = inputs.get(key)
    if isinstance(rule.settings, HitRateBelow):
        if raw is not None and not isinstance(raw, BurnInput):
            raise TypeError(f"{rule.alert}: input {type(raw).__name__} does not fit kind {rule.kind}")
        return burn_verdicts(rule.settings, raw)
    before = state.get(fingerprint(rule.alert, {**dict(key), **rule.labels}))
    if rule.expr is not None and (not present or raw is None):
        return [({}, Verdict(False, before.value if before is not None else None))]
    firing = before is not None and before.status == Status.FIRING  # hysteresis only once firing
    return [({}, verdict(rule, raw, firing))]



def _step(
    rule: Rule,
    before: AlertState | None,
    fp: str,
    key: Labels,
    labels: Mapping[str, str],
    v: Verdict,
    now: float,
) -> tuple[AlertState | None, Status | None]:
    """One state-machine step: the new state (None: drop it) and the notification status."""
    status = before.status if before is not None else Status.INACTIVE
    if v.active is None:  # no data: firing stays firing, pending falls back silently
        if before is None or status == Status.PENDING:
            return None, None
        if status == Status.FIRING and before.evaluated_at is not None and now - before.evaluated_at >= NO_DATA_RESOLVE_SECONDS:
            # its series is gone (an engine restarted under a new id, or was retired)
            return replace(before, status=Status.RESOLVED, inactive_since=None, resolved_at=now), Status.RESOLVED
        if status == Status.RESOLVED and before.resolved_at is not None and now - before.resolved_at >= RESOLVED_RETENTION_SECONDS:
            return None, None
        return before, None
    current = before or AlertState(alert=rule.alert, fingerprint=fp, labels=labels, series=key, status=Status.INACTIVE)
    # a firing alert keeps the value it had when last active (a resolve reports what fired, as
    # Prometheus does); otherwise the value follows the verdict
    keep = status == Status.FIRING and not v.active
    current = replace(current, evaluated_at=now, value=current.value if keep or v.value is None else v.value)
    if v.active:
        if status == Status.FIRING:
            return replace(current, inactive_since=None), None
        pending = status == Status.PENDING and before is not None and before.active_since is not None
        outage = pending and before is not None and before.evaluated_at is not None and now - before.evaluated_at > OUTAGE_TOLERANCE_SECONDS
        since = before.active_since if pending and not outage and before is not None and before.active_since is not None else now
        if now - since >= rule.for_seconds:
            fired = replace(current, status=Status.FIRING, active_since=since, firing_since=now, inactive_since=None, resolved_at=None)
            return fired, Status.FIRING
        return replace(current, status=Status.PENDING, active_since=since, resolved_at=None), None
    if status == Status.FIRING:
        inactive_since = current.inactive_since if current.inactive_since is not None else now
        if now - inactive_since >= rule.keep_firing_for_seconds:
            resolved = replace(current, status=Status.RESOLVED, inactive_since=None, resolved_at=now)
            return resolved, Status.RESOLVED
        return replace(current, inactive_since=inactive_since), None
    if status == Status.RESOLVED and before is not None and before.resolved_at is not None and now - before.resolved_at < RESOLVED_RETENTION_SECONDS:
        return current, None
    return None, None  # inactive (or a pending that turned inactive, or an old resolve): dropped
