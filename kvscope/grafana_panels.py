"""What the Grafana dashboard shows: every panel as a title, a unit and its PromQL over the
agent's ``kvscope_`` metrics (DESIGN.md §6, :mod:`agent.metrics`), in three rows — the
Overview's panels, the agent's ingest health and the per-form panels of the Forms page.

Only metric names and labels are needed here (nothing is imported from the agent): the
queries are checked against a real Prometheus scraping a real agent in
``tests/e2e/test_grafana_dashboard.py``, which fails a panel that returns no data.

Conventions of the queries:

* Counters are read as ``rate`` (per second) or ``increase`` over Grafana's
  ``$__rate_interval`` in time series, and as ``increase`` over ``$__range`` (the dashboard's
  time range) in stat panels; a hit rate is a ratio of token sums, never an average of ratios.
* ``engine``, ``model`` and (on per-form panels) ``form`` are template variables matched as
  regular expressions (``=~"$engine"``), so "All" is ``.*``.
* No ``or vector(0)``: a figure without data shows "No data", not a made-up 0.
* Quantiles come from the agent's histograms with ``histogram_quantile`` over summed bucket
  rates (``sum by (le)``), so they merge across engines and tiers.

Latency and lag panels use the agent's bucket bounds: ``kvscope_recovery_seconds`` (1 ms to
10 s), ``kvscope_request_ttft_seconds`` (5 ms to 60 s), ``kvscope_ingest_lag_seconds`` (10 ms to
5 min); a quantile past the last bound reads as that bound.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

ENGINE_MODEL = 'engine=~"$engine", model=~"$model"'
"""The label matchers of every per-engine panel (template variables ``engine`` and ``model``)."""
ENGINE_MODEL_FORM = ENGINE_MODEL + ', form=~"$form"'
"""The same plus the ``form`` template variable (the per-form panels)."""

PanelKind = Literal["stat", "timeseries"]
_OR_VECTOR = re.compile(r"\bor\s+vector\s*\(")


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """One query of a panel: ``ref_id`` (A, B, ...), the PromQL ``expr`` and the legend
    (Grafana's ``{{label}}`` template)."""

    ref_id: str
    expr: str
    legend: str

    def __post_init__(self) -> None:
        if _OR_VECTOR.search(self.expr):
            raise ValueError(f"target {self.ref_id}: `or vector(0)` hides a query without data: {self.expr}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PanelSpec:
    """One panel: a stat (one figure over the dashboard's range) or a time series.

    ``unit`` is a Grafana unit id (``percentunit``, ``s``, ``short``, ``suffix:…``); ``stack``
    stacks a time series' lines (the prompt-token split)."""

    kind: PanelKind
    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    stack: bool = False

    def __post_init__(self) -> None:
        refs = [t.ref_id for t in self.targets]
        if not refs or len(set(refs)) != len(refs):
            raise ValueError(f"panel {self.title!r}: needs targets with distinct ref ids, got {refs}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RowSpec:
    """A row of panels; each panel is ``width`` of Grafana's 24 columns wide."""

    title: str
    panels: tuple[PanelSpec, ...]
    width: int = 12


def _ratio(func: str, numerator: str, denominator: str, window: str, by: str = "") -> str:
    """``sum(func(numerator[window])) / sum(func(denominator[window]))``, grouped ``by``."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} ({func}({numerator}[{window}])) / sum{grouping} ({func}({denominator}[{window}]))"


def _rate(metric: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}[$__rate_interval]))"


def _p95(bucket: str, by: str = "") -> str:
    labels = f"{by}, le" if by else "le"
    return f"histogram_quantile(0.95, sum by ({labels}) (rate({bucket}[$__rate_interval])))"


def _target(ref_id: str, expr: str, legend: str) -> Target:
    return Target(ref_id=ref_id, expr=expr, legend=legend)


def _requests(metric: str) -> str:
    return f"kvscope_{metric}_total{{{ENGINE_MODEL}}}"


def _lookups(metric: str) -> str:
    return f"kvscope_{metric}_total{{{ENGINE_MODEL_FORM}}}"


OVERVIEW = RowSpec(
    title="Overview",
    panels=(
        PanelSpec(
            kind="stat",
            title="Recoverable hit rate",
            description="Prompt tokens served from cache with no recomputation / prompt tokens, over the time range.",
            unit="percentunit",
            targets=(_target("A", _ratio("increase", _requests("recoverable_tokens"), _requests("prompt_tokens"), "$__range"), "recoverable"),),
        ),
        PanelSpec(
            kind="stat",
            title="Raw hit rate",
            description="Prompt tokens matched by the prefix hash chain / prompt tokens, over the time range: "
            "the gap to the recoverable hit rate is what hybrid caches lose between hash hit and reuse.",
            unit="percentunit",
            targets=(_target("A", _ratio("increase", _requests("hash_hit_tokens"), _requests("prompt_tokens"), "$__range"), "raw"),),
        ),
        PanelSpec(
            kind="stat",
            title="Requests",
            description="Finished requests over the time range.",
            unit="short",
            targets=(_target("A", f"sum (increase({_requests('requests')}[$__range]))", "requests"),),
        ),
        PanelSpec(
            kind="stat",
            title="Alerts firing",
            description="kvscope's own alerts firing now (the agent evaluates its rule file; kvscope_alerts).",
            unit="short",
            targets=(_target("A", 'sum (kvscope_alerts{alertstate="firing"})', "firing"),),
        ),
        PanelSpec(
            kind="timeseries",
            title="Recoverable vs raw hit rate",
            description="Ratios of token rates: recoverable / prompt and hash hit / prompt.",
            unit="percentunit",
            targets=(
                _target("A", _ratio("rate", _requests("recoverable_tokens"), _requests("prompt_tokens"), "$__rate_interval"), "recoverable"),
                _target("B", _ratio("rate", _requests("hash_hit_tokens"), _requests("prompt_tokens"), "$__rate_interval"), "raw"),
            ),
        ),
        PanelSpec(
            kind="timeseries",
            title="Prompt tokens: recoverable / replayed / recomputed",
            description="Prompt tokens per second, split into served from cache, recomputed only to rebuild state "
            "(Tail-Replay) and computed as new.",
            unit="suffix: tok/s",
            stack=True,
            targets=(
                _target("A", _rate(_requests("recoverable_tokens")), "recoverable"),
                _target("B", _rate(_requests("replayed_tokens")), "replayed"),
                _target("C", _rate(_requests("recomputed_tokens")), "recomputed"),
            ),
        ),
        PanelSpec(
            kind="timeseries",
            title="Usable rate per form",
            description="Each form's usable tokens / its hash-hit tokens: which form explains the gap.",
            unit="percentunit",
            targets=(
                _target(
                    "A",
                    _ratio("rate", _lookups("lookup_usable_tokens"), _lookups("lookup_hash_hit_tokens"), "$__rate_interval", "form"),
                    "{{form}}",
                ),
            ),
        ),
        PanelSpec(
            kind="timeseries",
            title="Time to first token p95",
            description="95th percentile of finished requests' time to first token.",
            unit="s",
            targets=(_target("A", _p95(f"kvscope_request_ttft_seconds_bucket{{{ENGINE_MODEL}}}"), "p95"),),
        ),
    ),
)

INGEST = RowSpec(
    title="Ingest",
    panels=(
        PanelSpec(
            kind="timeseries",
            title="Events stored per second",
            description="Events the agent stored, by kind (duplicates and rejected batches excluded).",
            unit="suffix: events/s",
            targets=(_target("A", _rate("kvscope_ingest_events_total", "kind"), "{{kind}}"),),
        ),
        PanelSpec(
            kind="timeseries",
            title="Ingest lag p95",
            description="95th percentile of each stored event's commit time minus its timestamp.",
            unit="s",
            targets=(_target("A", _p95("kvscope_ingest_lag_seconds_bucket"), "p95"),),
        ),
    ),
)

FORMS = RowSpec(
    title="Forms",
    panels=(
        PanelSpec(
            kind="timeseries",
            title="Usable tokens per form",
            description="Tokens each form alone could resume exactly, per second.",
            unit="suffix: tok/s",
            targets=(_target("A", _rate(_lookups("lookup_usable_tokens"), "form"), "{{form}}"),),
        ),
        PanelSpec(
            kind="timeseries",
            title="Recoverable tokens per form",
            description="Recoverable tokens of the lookups, min(usable, L*) for the forms used, per second.",
            unit="suffix: tok/s",
            targets=(_target("A", _rate(_lookups("lookup_recoverable_tokens"), "form"), "{{form}}"),),
        ),
        PanelSpec(
            kind="timeseries",
            title="Lookups per outcome",
            description="Cache lookups (one per request and form) per second, by form and outcome.",
            unit="suffix: lookups/s",
            targets=(_target("A", _rate(_lookups("cache_lookups"), "form, outcome"), "{{form}} {{outcome}}"),),
        ),
        PanelSpec(
            kind="timeseries",
            title="Invalidations by reason",
            description="Lookups present by hash but unusable, per second, by form and reason.",
            unit="suffix: lookups/s",
            targets=(_target("A", _rate(_lookups("invalidations"), "form, reason"), "{{form}} {{reason}}"),),
        ),
        PanelSpec(
            kind="timeseries",
            title="Recovery latency p95",
            description="95th percentile of the recovery latency of lookups that recovered or replayed state, by form.",
            unit="s",
            targets=(_target("A", _p95(f"kvscope_recovery_seconds_bucket{{{ENGINE_MODEL_FORM}}}", "form"), "{{form}}"),),
        ),
        PanelSpec(
            kind="timeseries",
            title="Tensor-parallel disagreements",
            description="Lookups another tensor-parallel rank held back (reason tp_disagree) per interval, "
            "by form and the rank that held it back.",
            unit="short",
            targets=(
                _target(
                    "A",
                    f"sum by (form, tp_rank) (increase({_lookups('tp_disagreements')}[$__rate_interval]))",
                    "{{form}} rank {{tp_rank}}",
                ),
            ),
        ),
    ),
)

ROWS = (OVERVIEW, INGEST, FORMS)
"""The dashboard's rows, top to bottom."""
