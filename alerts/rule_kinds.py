"""The built-in alert rule kinds and their settings (:data:`KINDS`), as a rule file gives them
(:mod:`alerts.rulefile` loads them; :mod:`alerts.inputs` queries and :mod:`alerts.rule_eval`
judges each kind)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from agent.ingest import RECOVERY_BUCKETS
from agent.sync_delay_metrics import SYNC_DELAY_TOKEN_BUCKETS
from alerts.durations import SEVERITIES, format_duration, parse_duration


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
        return f"{format_duration(self.long)}/{format_duration(self.short)}"

    def __post_init__(self) -> None:
        if not 0 < self.short < self.long:
            raise ValueError(f"need 0 < short < long, got short {self.short} s, long {self.long} s")
        if not (self.burn_rate > 0 and math.isfinite(self.burn_rate)):
            raise ValueError(f"burn_rate must be a finite number > 0, got {self.burn_rate}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {', '.join(SEVERITIES)}, got {self.severity!r}")


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


@dataclass(frozen=True, slots=True, kw_only=True)
class RankDisagreement:
    """``tp_rank_disagreement``: per (engine, form, tp_rank), the lookups another
    tensor-parallel rank held back (reason ``tp_disagree``; ``tp_rank`` names that rank) over
    ``window``; active at ``min_disagreements`` or more. One rank whose shard of a form keeps
    failing (lost, corrupt, mid-swap) costs every rank that form's reuse."""

    window: float = _duration_field("5m")
    min_disagreements: int = 10

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise ValueError("window must be positive")
        if self.min_disagreements < 1:
            raise ValueError(f"min_disagreements must be >= 1, got {self.min_disagreements}")


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexerSyncDelay:
    """``indexer_sync_delay``: per (engine, model, layer_group), the largest indexer sync delay
    (tokens the CSA indexer's state trailed the main compressed KV boundary, on ``indexer_state``
    lookups) over ``window``; active while above ``threshold_tokens``. It is 0 in a healthy
    engine, so the default threshold is 0. Evaluated as its named query (:meth:`named_query`,
    ``indexer_sync_delay_series``), whose rows are the active series.

    ``threshold_tokens`` must be a bound of ``kvscope_indexer_sync_delay_tokens``
    (:data:`SYNC_DELAY_TOKEN_BUCKETS`), so the exported PromQL fires on the same lookups."""

    window: float = _duration_field("5m")
    threshold_tokens: int = 0

    def __post_init__(self) -> None:
        if self.window < 1 or self.window != int(self.window):
            raise ValueError(f"window must be whole seconds, at least 1s, got {self.window:g} s")
        if self.threshold_tokens not in SYNC_DELAY_TOKEN_BUCKETS:
            bounds = ", ".join(f"{b:g}" for b in SYNC_DELAY_TOKEN_BUCKETS)
            raise ValueError(f"threshold_tokens must be a bucket bound of kvscope_indexer_sync_delay_tokens ({bounds}), got {self.threshold_tokens}")

    def named_query(self) -> dict[str, object]:
        """The rule's ``expr``: ``{query, params}`` of ``indexer_sync_delay_series``."""
        return {"query": "indexer_sync_delay_series", "params": {"since_seconds": int(self.window), "threshold_tokens": self.threshold_tokens}}


KINDS: dict[str, type] = {
    "recoverable_hit_rate_drop": HitRateDrop,
    "recoverable_hit_rate_below": HitRateBelow,
    "form_invalidation_spike": InvalidationSpike,
    "recovery_latency_high": RecoveryLatencyHigh,
    "tp_rank_disagreement": RankDisagreement,
    "indexer_sync_delay": IndexerSyncDelay,
    "ingest_stalled": SilentFor,
    "engine_silent": SilentFor,
}
"""Built-in rule kinds → their settings."""

KindSettings = HitRateDrop | HitRateBelow | InvalidationSpike | RecoveryLatencyHigh | RankDisagreement | IndexerSyncDelay | SilentFor
