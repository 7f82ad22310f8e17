"""The figures the Grafana dashboard's panels must show, computed from the agent's own tables
through ``POST /v1/sql`` — the SQL twin of every panel target of ``dashboards/grafana/kvscope.json``.

:func:`sql_snapshot` re-derives the agent's ``kvscope_`` counters and histograms from its tables
(a series exists where its SQL group has a row, as the agent creates a series on its first
event). Two snapshots taken around a window give the window's increase (:func:`window_delta`),
which is what ``increase`` and ``rate`` over that window read from Prometheus when the window's
ends are scrape timestamps (no extrapolation). :data:`EXPECTED` maps every target (panel title,
ref id) to its figure over a :class:`Figures`; :func:`histogram_quantile` is Prometheus's
bucket interpolation (promql/quantile.go), so a quantile panel is compared with the same
estimate computed from the SQL bucket counts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from agent.batch_summary import TTFT_BUCKETS
from agent.event_tables import RECOVERY_BUCKETS
from agent.metrics import LAG_BUCKETS

Labels = tuple[tuple[str, str], ...]
"""A series' labels, sorted by name (the ``metric`` object of a Prometheus result)."""
Result = dict[Labels, float]

COUNTER_QUERIES: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    (
        "SELECT engine_id, model, count(*), sum(prompt_tokens), sum(hash_hit_tokens), sum(recoverable_tokens), "
        "sum(replayed_tokens), sum(recomputed_tokens) FROM requests GROUP BY engine_id, model",
        ("engine", "model"),
        ("requests", "prompt_tokens", "hash_hit_tokens", "recoverable_tokens", "replayed_tokens", "recomputed_tokens"),
    ),
    (
        "SELECT engine_id, model, form, tier, outcome, count(*), sum(hash_hit_tokens), sum(usable_tokens), "
        "sum(recoverable_tokens) FROM cache_lookups GROUP BY engine_id, model, form, tier, outcome",
        ("engine", "model", "form", "tier", "outcome"),
        ("cache_lookups", "lookup_hash_hit_tokens", "lookup_usable_tokens", "lookup_recoverable_tokens"),
    ),
    (
        "SELECT engine_id, model, form, reason, count(*) FROM cache_lookups WHERE outcome = 'invalidated' "
        "GROUP BY engine_id, model, form, reason",
        ("engine", "model", "form", "reason"),
        ("invalidations",),
    ),
    (
        "SELECT engine_id, model, form, CAST(tp_rank AS VARCHAR), count(*) FROM cache_lookups "
        "WHERE reason = 'tp_disagree' GROUP BY engine_id, model, form, tp_rank",
        ("engine", "model", "form", "tp_rank"),
        ("tp_disagreements",),
    ),
    (
        "SELECT kind, n FROM (SELECT 'cache_lookup' AS kind, count(*) AS n FROM cache_lookups UNION ALL "
        "SELECT 'request', count(*) FROM requests UNION ALL SELECT 'engine_stats', count(*) FROM engine_stats "
        "UNION ALL SELECT 'block', count(*) FROM block_events) WHERE n > 0",
        ("kind",),
        ("ingest_events",),
    ),
)
"""(SQL, its label columns, the counters of its value columns: ``kvscope_<name>_total``)."""

HISTOGRAM_QUERIES: tuple[tuple[str, str, tuple[str, ...], Sequence[float]], ...] = (
    (
        "kvscope_recovery_seconds",
        "SELECT engine_id, model, form, tier, recovery_seconds FROM cache_lookups WHERE outcome IN ('recovered', 'replayed')",
        ("engine", "model", "form", "tier"),
        RECOVERY_BUCKETS,
    ),
    ("kvscope_request_ttft_seconds", "SELECT engine_id, model, ttft_seconds FROM requests", ("engine", "model"), TTFT_BUCKETS),
    (
        "kvscope_ingest_lag_seconds",
        "SELECT (epoch_us(ingested_at) - epoch_us(ts)) / 1e6 FROM (SELECT ts, ingested_at FROM cache_lookups UNION ALL "
        "SELECT ts, ingested_at FROM requests UNION ALL SELECT ts, ingested_at FROM engine_stats UNION ALL "
        "SELECT ts, ingested_at FROM block_events)",
        (),
        LAG_BUCKETS,
    ),
)
"""(histogram, SQL of label columns and one observed value per row, label names, bucket bounds).
The ingest lag is ``ingested_at`` (stamped as the flush starts) minus ``ts``; the agent's
histogram measures from the commit, a few milliseconds later (see the test's docstring)."""

FIRING_SQL = "SELECT count(*) FROM alert_state WHERE status = 'firing'"


def sql_rows(agent_url: str, sql: str) -> list[list[Any]]:
    """The rows of ``sql`` run by the agent (``POST /v1/sql``)."""
    response = httpx.post(f"{agent_url}/v1/sql", json={"sql": sql}, timeout=30)
    assert response.status_code == 200, f"{sql}: {response.status_code} {response.text}"
    rows: list[list[Any]] = response.json()["rows"]
    return rows


def _labels(names: Iterable[str], values: Iterable[Any]) -> Labels:
    return tuple(sorted(zip(names, (str(v) for v in values), strict=True)))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The agent's series as its tables give them: counters (metric → labels → value),
    histograms (metric → labels → per-bucket counts, ``+Inf`` last, not cumulative) with their
    bounds, and the number of alerts firing."""

    counters: dict[str, Result]
    histograms: dict[str, dict[Labels, list[int]]]
    bounds: dict[str, Sequence[float]]
    firing: float


def sql_snapshot(agent_url: str) -> Snapshot:
    """Every counter and histogram the dashboard reads, re-derived through ``/v1/sql``."""
    counters: dict[str, Result] = defaultdict(dict)
    for sql, label_names, metrics in COUNTER_QUERIES:
        for row in sql_rows(agent_url, sql):
            labels = _labels(label_names, row[: len(label_names)])
            for metric, value in zip(metrics, row[len(label_names) :], strict=True):
                counters[f"kvscope_{metric}_total"][labels] = float(value)
    histograms: dict[str, dict[Labels, list[int]]] = {}
    bounds: dict[str, Sequence[float]] = {}
    for metric, sql, label_names, edges in HISTOGRAM_QUERIES:
        series: dict[Labels, list[int]] = {}
        for row in sql_rows(agent_url, sql):
            value = float(row[-1])
            counts = series.setdefault(_labels(label_names, row[:-1]), [0] * (len(edges) + 1))
            counts[sum(value > edge for edge in edges)] += 1  # Prometheus's le: value <= bound
        histograms[metric], bounds[metric] = series, edges
    (firing,) = sql_rows(agent_url, FIRING_SQL)[0]
    return Snapshot(dict(counters), histograms, bounds, float(firing))


def window_delta(before: Snapshot, after: Snapshot) -> Snapshot:
    """``after`` − ``before`` for counters and histograms (what the window added); the alerts
    firing are ``after``'s (a gauge). Every series of ``after`` must already be in ``before``:
    Prometheus's first sample of a series is its baseline, so a series born inside the window
    would count from there, not from 0."""
    counters: dict[str, Result] = {}
    for metric, series in after.counters.items():
        born = set(series) - set(before.counters.get(metric, {}))
        assert not born, f"{metric}: series first seen inside the window: {sorted(born)}"
        counters[metric] = {k: v - before.counters[metric][k] for k, v in series.items()}
    histograms: dict[str, dict[Labels, list[int]]] = {}
    for metric, hist in after.histograms.items():
        born = set(hist) - set(before.histograms.get(metric, {}))
        assert not born, f"{metric}: series first seen inside the window: {sorted(born)}"
        histograms[metric] = {k: [a - b for a, b in zip(v, before.histograms[metric][k], strict=True)] for k, v in hist.items()}
    return Snapshot(counters, histograms, after.bounds, after.firing)


def histogram_quantile(q: float, edges: Sequence[float], counts: Sequence[float]) -> float:
    """Prometheus's ``histogram_quantile`` of per-bucket ``counts`` (``+Inf`` last) with upper
    bounds ``edges``: the rank's bucket, linearly interpolated; past the last finite bound it is
    that bound; NaN without observations (promql/quantile.go, ``bucketQuantile``)."""
    cumulative, total = [], 0.0
    for c in counts:
        total += c
        cumulative.append(total)
    if total == 0:
        return math.nan
    rank = q * total
    b = next((i for i, c in enumerate(cumulative[:-1]) if c >= rank), len(cumulative) - 1)
    if b == len(cumulative) - 1:
        return float(edges[-1])
    start, count = (0.0, cumulative[0]) if b == 0 else (float(edges[b - 1]), cumulative[b] - cumulative[b - 1])
    if b > 0:
        rank -= cumulative[b - 1]
    return start + (float(edges[b]) - start) * (rank / count)


@dataclass(frozen=True, slots=True)
class Figures:
    """PromQL's aggregations over a window's :class:`Snapshot` (``delta``) of
    ``window_seconds``: ``increase``/``rate`` summed by labels, ratios, quantiles."""

    delta: Snapshot
    window_seconds: float

    def increase(self, metric: str, by: Sequence[str] = ()) -> Result:
        """``sum by (by) (increase(metric[window]))``."""
        out: Result = defaultdict(float)
        for labels, value in self.delta.counters[metric].items():
            out[tuple((k, v) for k, v in labels if k in by)] += value
        return dict(out)

    def rate(self, metric: str, by: Sequence[str] = ()) -> Result:
        """``sum by (by) (rate(metric[window]))``."""
        return {k: v / self.window_seconds for k, v in self.increase(metric, by).items()}

    @staticmethod
    def ratio(numerator: Result, denominator: Result) -> Result:
        """``numerator / denominator`` on matching labels (NaN where PromQL's would not be finite)."""
        return {k: v / denominator[k] if denominator[k] else math.nan for k, v in numerator.items() if k in denominator}

    def p95(self, metric: str, by: Sequence[str] = ()) -> Result:
        """``histogram_quantile(0.95, sum by (by, le) (rate(metric_bucket[window])))``."""
        edges = self.delta.bounds[metric]
        sums: dict[Labels, list[float]] = defaultdict(lambda: [0.0] * (len(edges) + 1))
        for labels, counts in self.delta.histograms[metric].items():
            key = tuple((k, v) for k, v in labels if k in by)
            sums[key] = [s + c / self.window_seconds for s, c in zip(sums[key], counts, strict=True)]
        return {k: histogram_quantile(0.95, edges, v) for k, v in sums.items()}

    def firing(self) -> Result:
        """``sum(kvscope_alerts{alertstate="firing"})`` at the window's end."""
        return {(): self.delta.firing}


def _req(name: str) -> str:
    return f"kvscope_{name}_total"


EXPECTED: dict[tuple[str, str], Callable[[Figures], Result]] = {
    ("Recoverable hit rate", "A"): lambda f: f.ratio(f.increase(_req("recoverable_tokens")), f.increase(_req("prompt_tokens"))),
    ("Raw hit rate", "A"): lambda f: f.ratio(f.increase(_req("hash_hit_tokens")), f.increase(_req("prompt_tokens"))),
    ("Requests", "A"): lambda f: f.increase(_req("requests")),
    ("Alerts firing", "A"): lambda f: f.firing(),
    ("Recoverable vs raw hit rate", "A"): lambda f: f.ratio(f.rate(_req("recoverable_tokens")), f.rate(_req("prompt_tokens"))),
    ("Recoverable vs raw hit rate", "B"): lambda f: f.ratio(f.rate(_req("hash_hit_tokens")), f.rate(_req("prompt_tokens"))),
    ("Prompt tokens: recoverable / replayed / recomputed", "A"): lambda f: f.rate(_req("recoverable_tokens")),
    ("Prompt tokens: recoverable / replayed / recomputed", "B"): lambda f: f.rate(_req("replayed_tokens")),
    ("Prompt tokens: recoverable / replayed / recomputed", "C"): lambda f: f.rate(_req("recomputed_tokens")),
    ("Usable rate per form", "A"): lambda f: f.ratio(
        f.rate(_req("lookup_usable_tokens"), ("form",)), f.rate(_req("lookup_hash_hit_tokens"), ("form",))
    ),
    ("Time to first token p95", "A"): lambda f: f.p95("kvscope_request_ttft_seconds"),
    ("Events stored per second", "A"): lambda f: f.rate(_req("ingest_events"), ("kind",)),
    ("Ingest lag p95", "A"): lambda f: f.p95("kvscope_ingest_lag_seconds"),
    ("Usable tokens per form", "A"): lambda f: f.rate(_req("lookup_usable_tokens"), ("form",)),
    ("Recoverable tokens per form", "A"): lambda f: f.rate(_req("lookup_recoverable_tokens"), ("form",)),
    ("Lookups per outcome", "A"): lambda f: f.rate(_req("cache_lookups"), ("form", "outcome")),
    ("Invalidations by reason", "A"): lambda f: f.rate(_req("invalidations"), ("form", "reason")),
    ("Recovery latency p95", "A"): lambda f: f.p95("kvscope_recovery_seconds", ("form",)),
    ("Tensor-parallel disagreements", "A"): lambda f: f.increase(_req("tp_disagreements"), ("form", "tp_rank")),
}
"""Every panel target's figure (all template variables "All"); the test checks this covers
exactly the dashboard's targets, so a new panel needs its SQL twin here."""

VARIABLE_VALUES_SQL = {
    "engine": "SELECT DISTINCT engine_id FROM requests",
    "model": "SELECT DISTINCT model FROM requests",
    "form": "SELECT DISTINCT form FROM cache_lookups",
}
"""What each query template variable must list."""
