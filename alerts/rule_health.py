"""Which rules could not judge their series, and why: "no data", with the volume each one saw.

A built-in kind needs volume before it judges (``min_prompt_tokens``, ``min_lookups``,
``min_recoveries``): below it a series has **no data** — never a 0 % hit rate, and never a
resolve. That is right, but silent: an operator whose drill never pages cannot tell "the rate
held" from "the rule never had enough traffic to look". :class:`RuleHealth` keeps, per rule, the
series without data at the last evaluation with the volume they had and the volume they need
(:func:`no_data_detail`), logs each series entering no data (``WARNING``) and leaving it
(``INFO``) once per change, not per evaluation, and serves :meth:`RuleHealth.snapshot` to
``GET /v1/alerts/rules`` (the Alerts page's "Rules" table). A rule without any series in its
windows is one no-data entry without labels.

Peers: Prometheus's ``/api/v1/rules`` (each rule's ``health``, ``lastEvaluation``) and Grafana's
"No data" alert state.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from alerts.durations import format_duration
from alerts.rule_eval import BurnInput, DropInput, Labels, LatencyInput, SeriesInput, ShareInput
from alerts.rulefile import HitRateBelow, HitRateDrop, InvalidationSpike, RecoveryLatencyHigh, Rule

log = logging.getLogger(__name__)

NO_SERIES = "no series in its windows (nothing was stored there)"


def no_data_detail(rule: Rule, series: SeriesInput) -> str | None:
    """Why the kind of ``rule`` cannot judge ``series`` — the volume it saw against the volume it
    needs, in words — or None when it can (or the kind never lacks data)."""
    s = rule.settings
    if series is None:
        return "no input" if rule.expr is None and isinstance(s, HitRateDrop | HitRateBelow | InvalidationSpike | RecoveryLatencyHigh) else None
    if isinstance(s, HitRateDrop) and isinstance(series, DropInput):
        if series.current.prompt >= s.min_prompt_tokens and series.baseline.prompt >= s.min_prompt_tokens:
            return None
        return (
            f"{series.current.prompt:,} prompt tokens in the {format_duration(s.window)} window and "
            f"{series.baseline.prompt:,} in its baseline; needs {s.min_prompt_tokens:,} in each"
        )
    if isinstance(s, HitRateBelow) and isinstance(series, BurnInput):
        short_of = []
        for window, (long, short) in zip(s.windows, series.windows, strict=True):
            if short.prompt < s.min_prompt_tokens or long.prompt - short.prompt < s.min_prompt_tokens:
                short_of.append(f"{window.label}: {short.prompt:,} in the short window, {long.prompt - short.prompt:,} before it in the long one")
        if not short_of:
            return None
        return f"prompt tokens {'; '.join(short_of)}; needs {s.min_prompt_tokens:,} in each"
    if isinstance(s, InvalidationSpike) and isinstance(series, ShareInput):
        if series.form_lookups >= s.min_lookups and series.baseline_form_lookups >= s.min_lookups:
            return None
        return (
            f"{series.form_lookups:,} lookups of the form in the {format_duration(s.window)} window and "
            f"{series.baseline_form_lookups:,} in its baseline; needs {s.min_lookups:,} in each"
        )
    if isinstance(s, RecoveryLatencyHigh) and isinstance(series, LatencyInput):
        if series.cumulative[-1] >= s.min_recoveries:
            return None
        return f"{series.cumulative[-1]:,} recoveries in the {format_duration(s.window)} window; needs {s.min_recoveries:,}"
    return None


@dataclass(frozen=True, slots=True)
class NoData:
    """One series a rule could not judge: its labels, why, and since when (unix seconds)."""

    labels: Labels
    detail: str
    since: float


class RuleHealth:
    """The rules' no-data series as of their last evaluation (module docstring). Thread-safe:
    the scheduler's group threads observe, the API's thread reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._no_data: dict[str, dict[Labels, NoData]] = {}
        self._evaluated: dict[str, tuple[float, int]] = {}

    def observe(self, rule: Rule, inputs: Mapping[Labels, SeriesInput], now: float) -> None:
        """Note ``rule``'s evaluation at ``now`` over ``inputs`` (series → input); logs the series
        that entered or left no data since the last one."""
        found = {key: detail for key, x in inputs.items() if (detail := no_data_detail(rule, x)) is not None}
        if not inputs and no_data_detail(rule, None) is not None:
            found = {(): NO_SERIES}
        with self._lock:
            before = self._no_data.get(rule.alert, {})
            now_no_data = {key: NoData(key, detail, before[key].since if key in before else now) for key, detail in found.items()}
            self._no_data[rule.alert] = now_no_data
            self._evaluated[rule.alert] = (now, len(inputs))
        for key, entry in now_no_data.items():
            if key not in before:
                log.warning("alert rule %s has no data%s: %s", rule.alert, _where(key), entry.detail)
        for key in before.keys() - now_no_data.keys():
            log.info("alert rule %s has data again%s", rule.alert, _where(key))

    def snapshot(self, rules: list[Rule]) -> list[dict[str, Any]]:
        """Per rule of ``rules``, in order: ``alert``, ``kind``, ``evaluated_at`` (unix seconds,
        None before its first evaluation), ``series`` (how many it saw) and ``no_data`` (each:
        ``labels``, ``detail``, ``since``)."""
        with self._lock:
            out = []
            for rule in rules:
                at, series = self._evaluated.get(rule.alert, (None, 0))
                entries = sorted(self._no_data.get(rule.alert, {}).values(), key=lambda e: e.labels)
                out.append(
                    {
                        "alert": rule.alert,
                        "kind": rule.kind,
                        "evaluated_at": at,
                        "series": series,
                        "no_data": [{"labels": dict(e.labels), "detail": e.detail, "since": e.since} for e in entries],
                    }
                )
            return out


def _where(key: Labels) -> str:
    return f" for {', '.join(f'{k}={v}' for k, v in key)}" if key else ""
