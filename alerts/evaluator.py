"""The pure alert evaluator: ``evaluate(rules, data, now, previous_state)``.

No I/O and no clock: everything comes in as arguments, so a golden time series of
``(now, data)`` steps pins the behaviour exactly.

Semantics of :class:`~alerts.rules.RecoverableHitRateRule`, per (engine, model) series:

* **Measurement.** ``data[rule.name][(engine, model)]`` holds the series' Σ recoverable tokens
  and Σ prompt tokens over the rule's window (a windowed ratio of token sums).
* **No data is not 0%.** A series with fewer than ``min_prompt_tokens`` prompt tokens, or absent
  from ``data``, has no data: it never fires, and a firing alert **stays firing** (it is not
  resolved by silence — an engine that stopped serving has not recovered; the alert resolves on
  the next window that has enough volume and a ratio at or above the threshold).
* **Transitions.** inactive → firing when ratio < threshold; firing → resolved when
  ratio >= threshold; resolved → firing again when it drops again. Exactly one notification
  per transition; an evaluation that changes no status notifies nothing (no duplicate pages).
* **Identity.** An alert is identified by its fingerprint: sha256 of the rule name and the
  sorted labels (``engine``, ``model``, ``severity``), stable across processes and restarts.

The state maps fingerprint → :class:`AlertState`. Entries are never dropped: a resolved entry
remembers when it resolved. State of a rule no longer in ``rules`` is carried over unchanged.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from alerts.rules import RecoverableHitRateRule

SeriesKey = tuple[str, str]
"""(engine, model)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """Token sums of one series over a rule's window."""

    recoverable_tokens: int
    prompt_tokens: int

    def __post_init__(self) -> None:
        if not 0 <= self.recoverable_tokens <= self.prompt_tokens:
            raise ValueError(
                f"need 0 <= recoverable_tokens <= prompt_tokens, got "
                f"{self.recoverable_tokens} and {self.prompt_tokens}"
            )

    @property
    def ratio(self) -> float | None:
        """Σ recoverable / Σ prompt, ``None`` when there were no prompt tokens."""
        return self.recoverable_tokens / self.prompt_tokens if self.prompt_tokens else None


Data = Mapping[str, Mapping[SeriesKey, Measurement]]
"""Rule name → series → measurement."""


class AlertStatus(enum.StrEnum):
    FIRING = "firing"
    RESOLVED = "resolved"


@dataclass(frozen=True, slots=True, kw_only=True)
class AlertState:
    """One alert's state. ``since`` is the unix time of its last transition; ``value`` the last
    measured ratio (updated on every evaluation with data, without a notification)."""

    alert: str
    fingerprint: str
    labels: Mapping[str, str]
    status: AlertStatus
    since: float
    value: float | None


State = Mapping[str, AlertState]
"""Fingerprint → state."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Notification:
    """One transition, to be persisted and sent to the receivers."""

    alert: str
    fingerprint: str
    status: AlertStatus
    labels: Mapping[str, str]
    value: float | None
    at: float
    summary: str
    description: str

    def to_json(self) -> dict[str, object]:
        """The log receiver's line (JSON-compatible dict)."""
        return {
            "at": self.at,
            "alert": self.alert,
            "fingerprint": self.fingerprint,
            "status": self.status.value,
            "labels": dict(self.labels),
            "value": self.value,
            "summary": self.summary,
            "description": self.description,
        }


def fingerprint(alert: str, labels: Mapping[str, str]) -> str:
    """sha256 (hex) of the rule name and the sorted labels: the alert's stable identity."""
    canonical = json.dumps([alert, sorted(labels.items())], separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def series_labels(rule: RecoverableHitRateRule, key: SeriesKey) -> dict[str, str]:
    engine, model = key
    return {"engine": engine, "model": model, "severity": rule.severity}


def evaluate(
    rules: Sequence[RecoverableHitRateRule],
    data: Data,
    now: float,
    previous_state: State,
) -> tuple[dict[str, AlertState], list[Notification]]:
    """Evaluate every rule on ``data`` at time ``now`` (unix seconds).

    Returns the new state (``previous_state`` is not modified) and the notifications of the
    transitions that happened, ordered by rule, then by (engine, model).
    """
    state = dict(previous_state)
    notifications: list[Notification] = []
    for rule in rules:
        series = data.get(rule.name, {})
        for key in sorted(series):
            measurement = series[key]
            if measurement.prompt_tokens < rule.min_prompt_tokens:
                continue  # no data: neither fires nor resolves
            ratio = measurement.ratio
            assert ratio is not None  # min_prompt_tokens >= 1
            labels = series_labels(rule, key)
            fp = fingerprint(rule.name, labels)
            before = state.get(fp)
            firing_now = ratio < rule.threshold
            was_firing = before is not None and before.status == AlertStatus.FIRING
            if firing_now == was_firing:
                if before is not None:
                    state[fp] = replace(before, value=ratio)
                continue
            status = AlertStatus.FIRING if firing_now else AlertStatus.RESOLVED
            state[fp] = AlertState(
                alert=rule.name,
                fingerprint=fp,
                labels=labels,
                status=status,
                since=now,
                value=ratio,
            )
            fields = {
                "engine": key[0],
                "model": key[1],
                "value": ratio,
                "recoverable_tokens": measurement.recoverable_tokens,
                "prompt_tokens": measurement.prompt_tokens,
                "window_seconds": rule.window_seconds,
            }
            notifications.append(
                Notification(
                    alert=rule.name,
                    fingerprint=fp,
                    status=status,
                    labels=labels,
                    value=ratio,
                    at=now,
                    summary=rule.render(rule.summary, **fields),
                    description=rule.render(rule.description, **fields),
                )
            )
    return state, notifications
