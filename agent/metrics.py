"""The agent's Prometheus metrics (DESIGN.md §6).

Every metric lives on the :class:`AgentMetrics` instance's own ``CollectorRegistry`` (never the
process-global one), so two agents — or two tests — in one process never share a counter.

Naming: prefix ``kvscope_``, base units, ``_total`` on counters. Labels come only from
{engine, model, form, tier, outcome, reason} plus ``status``/``kind`` on the ingest counters;
never request ids. Counters are cumulative since the agent started; consumers compute rates.
They are incremented only after a batch's transaction committed (:meth:`observe_ingest`), so a
rejected or rolled-back batch never moves an event counter.

``kvscope_invalidations_total`` counts lookups whose outcome is ``invalidated`` (present by hash,
unusable), by reason; misses and the recovered/replayed outcomes are visible in
``kvscope_cache_lookups_total{outcome}``.

Histograms fed from whole flushes (thousands of events at once) are :class:`BulkHistogram`
collectors: one ``numpy.searchsorted`` per flush instead of one ``observe`` call per event.
``kvscope_recovery_seconds`` observes the lookups that recovered or replayed state (outcome
``recovered`` or ``replayed``), by form and tier; ``kvscope_request_ttft_seconds`` every
request; ``kvscope_ingest_lag_seconds`` every stored event's commit time minus its ``ts``.

The agent's own ingest health: ``kvscope_ingest_batches_total{status}``,
``kvscope_ingest_events_total{kind}``, ``kvscope_ingest_rejected_batches_total{reason}``
(``invalid``, ``too_large``, ``content_type``, ``seq_conflict``, ``queue_full``,
``store_error``, ``decode_error``), ``kvscope_ingest_seq_gaps_total`` (jumps past seqs never received),
``kvscope_ingest_missing_batches`` (seqs never received now, all engines),
``kvscope_ingest_queue_events`` (events waiting for or in a flush).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.ingest import RECOVERING_OUTCOMES, RECOVERY_BUCKETS, IngestOutcome
from engine.events import Outcome

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of ``kvscope_request_ttft_seconds``."""
LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Upper bounds (seconds) of ``kvscope_ingest_lag_seconds``."""
REJECT_REASONS = (
    "invalid",
    "too_large",
    "content_type",
    "seq_conflict",
    "queue_full",
    "store_error",
    "decode_error",
)
"""Label values of ``kvscope_ingest_rejected_batches_total``."""


class BulkHistogram(Collector):
    """A Prometheus histogram observed many values at a time (a whole flush).

    Buckets are cumulative at exposition (``le``, then ``+Inf``); ``_sum`` and ``_count`` as
    ``prometheus_client.Histogram``. Thread-safe.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = np.asarray(buckets, dtype=np.float64)
        self._series: dict[tuple[str, ...], tuple[np.ndarray, list[float]]] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, labels: tuple[str, ...], values: np.ndarray) -> None:
        """Observe every value of ``values`` (seconds) under ``labels``."""
        if values.size:
            self.add_counts(labels, bucket_counts(self.bounds, values), float(values.sum()))

    def add_counts(self, labels: tuple[str, ...], counts: Sequence[int], total: float) -> None:
        """Add per-bucket (not cumulative) ``counts`` — one per bound plus ``+Inf`` — and their
        values' ``total`` under ``labels``."""
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {labels}")
        if len(counts) != len(self.bounds) + 1:
            raise ValueError(f"{self.name}: expected {len(self.bounds) + 1} bucket counts, got {len(counts)}")
        with self._lock:
            series = self._series.get(labels)
            if series is None:
                series = self._series[labels] = (np.zeros(len(self.bounds) + 1, np.int64), [0.0])
            series[0][:] += np.asarray(counts, dtype=np.int64)
            series[1][0] += total

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            snapshot = [(k, c.copy(), s[0]) for k, (c, s) in self._series.items()]
        for labels, counts, total in snapshot:
            cumulative = np.cumsum(counts)
            buckets = [(_le(b), float(n)) for b, n in zip(self.bounds, cumulative[:-1], strict=True)]
            buckets.append(("+Inf", float(cumulative[-1])))
            family.add_metric(list(labels), buckets, total)
        yield family


def _le(bound: float) -> str:
    return repr(float(bound))


def bucket_counts(bounds: Sequence[float] | np.ndarray, values: np.ndarray) -> list[int]:
    """Per-bucket counts of ``values`` for upper ``bounds`` (a value equal to a bound falls in
    that bound's bucket, as Prometheus's ``le``), plus the ``+Inf`` bucket last."""
    edges = np.asarray(bounds, dtype=np.float64)
    counts = np.bincount(np.searchsorted(edges, values, side="left"), minlength=len(edges) + 1)
    return [int(c) for c in counts]


Labels = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BatchSummary:
    """What a stored batch adds to the event metrics, computed where the batch is decoded (a
    decode process or thread) so the agent's main process only adds numbers. Picklable.

    ``lookups``: (engine, model, form, tier, outcome) → count and hash-hit / usable / recoverable
    token sums; ``invalidations``: (engine, model, form, reason) → count; ``recovery``: (engine,
    model, form, tier) → recovery-seconds bucket counts and sum (outcomes recovered/replayed);
    ``requests``: (engine, model) → count and prompt / hash-hit / recoverable / replayed /
    recomputed token sums; ``ttft``: (engine, model) → TTFT bucket counts and sum; ``ts_micros``:
    every event's ``ts`` (for the ingest lag once the commit time is known).
    """

    lookups: list[tuple[Labels, int, int, int, int]] = field(default_factory=list)
    invalidations: list[tuple[Labels, int]] = field(default_factory=list)
    recovery: list[tuple[Labels, list[int], float]] = field(default_factory=list)
    requests: list[tuple[Labels, int, int, int, int, int, int]] = field(default_factory=list)
    ttft: list[tuple[Labels, list[int], float]] = field(default_factory=list)
    ts_micros: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


_REQUEST_SUMS = ("prompt_tokens", "hash_hit_tokens", "recoverable_tokens", "replayed_tokens", "recomputed_tokens")


def summarize_tables(tables: Mapping[str, pa.Table]) -> BatchSummary:
    """The :class:`BatchSummary` of one batch's prepared tables (table name → rows)."""
    summary = BatchSummary()
    lookups = tables.get("cache_lookups")
    if lookups is not None:
        keys = ["engine_id", "model", "form", "tier", "outcome"]
        aggregations = [
            ([], "count_all"),
            ("hash_hit_tokens", "sum"),
            ("usable_tokens", "sum"),
            ("recoverable_tokens", "sum"),
        ]
        for row in lookups.group_by(keys, use_threads=False).aggregate(aggregations).to_pylist():
            summary.lookups.append(
                (
                    tuple(row[k] for k in keys),
                    row["count_all"],
                    row["hash_hit_tokens_sum"],
                    row["usable_tokens_sum"],
                    row["recoverable_tokens_sum"],
                )
            )
        invalidated = lookups.filter(pc.equal(lookups["outcome"], Outcome.INVALIDATED.value))
        keys = ["engine_id", "model", "form", "reason"]
        for row in invalidated.group_by(keys, use_threads=False).aggregate([([], "count_all")]).to_pylist():
            summary.invalidations.append((tuple(row[k] for k in keys), row["count_all"]))
        recovering = lookups.filter(pc.is_in(lookups["outcome"], pa.array(RECOVERING_OUTCOMES)))
        summary.recovery.extend(
            _histogram_groups(recovering, ("engine_id", "model", "form", "tier"), "recovery_seconds", RECOVERY_BUCKETS)
        )
    requests = tables.get("requests")
    if requests is not None:
        aggregations = [([], "count_all"), *((name, "sum") for name in _REQUEST_SUMS)]
        grouped = requests.group_by(["engine_id", "model"], use_threads=False).aggregate(aggregations)
        for row in grouped.to_pylist():
            summary.requests.append(
                (
                    (row["engine_id"], row["model"]),
                    row["count_all"],
                    *(row[f"{name}_sum"] for name in _REQUEST_SUMS),
                )
            )
        summary.ttft.extend(_histogram_groups(requests, ("engine_id", "model"), "ttft_seconds", TTFT_BUCKETS))
    stamps = [t["ts"].cast(pa.int64()).to_numpy() for t in tables.values()]
    if stamps:
        object.__setattr__(summary, "ts_micros", np.concatenate(stamps))
    return summary


def _histogram_groups(
    table: pa.Table, label_columns: Sequence[str], value_column: str, bounds: Sequence[float]
) -> list[tuple[Labels, list[int], float]]:
    if table.num_rows == 0:
        return []
    grouped = table.group_by(list(label_columns), use_threads=False).aggregate([(value_column, "list")])
    values = grouped[f"{value_column}_list"]
    labels = [grouped[c].to_pylist() for c in label_columns]
    out: list[tuple[Labels, list[int], float]] = []
    for i in range(grouped.num_rows):
        array = np.asarray(values[i].values.to_numpy(zero_copy_only=False), dtype=np.float64)
        out.append((tuple(str(column[i]) for column in labels), bucket_counts(bounds, array), float(array.sum())))
    return out

SeriesKey = tuple[str, str]
"""(engine, model)."""


class AgentMetrics:
    """The agent's metrics and the registry exposing them (a fresh registry per instance)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        lookup_labels = ("engine", "model", "form", "tier", "outcome")
        self.cache_lookups = Counter(
            "kvscope_cache_lookups_total",
            "Cache lookups (one per request and form), by tier and outcome.",
            ("engine", "model", "form", "tier", "outcome"),
            registry=r,
        )
        self.lookup_hash_hit_tokens = Counter(
            "kvscope_lookup_hash_hit_tokens_total",
            "Hash-hit tokens of cache lookups (the classic prefix hit), per form.",
            lookup_labels,
            registry=r,
        )
        self.lookup_usable_tokens = Counter(
            "kvscope_lookup_usable_tokens_total",
            "Tokens each form alone could resume exactly (its usable tokens), per form.",
            lookup_labels,
            registry=r,
        )
        self.lookup_recoverable_tokens = Counter(
            "kvscope_lookup_recoverable_tokens_total",
            "Recoverable tokens of cache lookups: min(usable, L*) for the forms used.",
            lookup_labels,
            registry=r,
        )
        self.invalidations = Counter(
            "kvscope_invalidations_total",
            "Lookups present by hash but unusable (outcome invalidated), by reason.",
            ("engine", "model", "form", "reason"),
            registry=r,
        )
        request_labels = ("engine", "model")
        self.requests = Counter(
            "kvscope_requests_total", "Finished requests.", request_labels, registry=r
        )
        self.prompt_tokens = Counter(
            "kvscope_prompt_tokens_total", "Prompt tokens of requests.", request_labels, registry=r
        )
        self.hash_hit_tokens = Counter(
            "kvscope_hash_hit_tokens_total",
            "Prompt tokens matched by the prefix hash chain (raw hits).",
            request_labels,
            registry=r,
        )
        self.recoverable_tokens = Counter(
            "kvscope_recoverable_tokens_total",
            "Prompt tokens served from cache with no recomputation.",
            request_labels,
            registry=r,
        )
        self.replayed_tokens = Counter(
            "kvscope_replayed_tokens_total",
            "Prompt tokens recomputed only to rebuild state (Tail-Replay, tail recompute).",
            request_labels,
            registry=r,
        )
        self.recomputed_tokens = Counter(
            "kvscope_recomputed_tokens_total",
            "Prompt tokens computed as new (T - L*).",
            request_labels,
            registry=r,
        )
        self.ingest_batches = Counter(
            "kvscope_ingest_batches_total",
            "Event batches received, by status (stored, duplicate, rejected).",
            ("status",),
            registry=r,
        )
        self.ingest_events = Counter(
            "kvscope_ingest_events_total",
            "Events stored, by kind (duplicates and rejected batches excluded).",
            ("kind",),
            registry=r,
        )
        self.rejected_batches = Counter(
            "kvscope_ingest_rejected_batches_total",
            "Event batches refused, by reason (invalid, too_large, content_type, seq_conflict, "
            "queue_full, store_error, decode_error).",
            ("reason",),
            registry=r,
        )
        self.seq_gaps = Counter(
            "kvscope_ingest_seq_gaps_total",
            "Times a stored batch's seq jumped past seqs never received.",
            registry=r,
        )
        self.missing_batches = Gauge(
            "kvscope_ingest_missing_batches",
            "Batch seqs never received below each engine's highest seq, summed over engines.",
            registry=r,
        )
        self.queue_events = Gauge(
            "kvscope_ingest_queue_events",
            "Events waiting in the ingest queue or in the flush being written.",
            registry=r,
        )
        self.recovery_seconds = BulkHistogram(
            "kvscope_recovery_seconds",
            "Recovery latency of lookups that recovered or replayed state, by form and tier.",
            ("engine", "model", "form", "tier"),
            RECOVERY_BUCKETS,
            r,
        )
        self.request_ttft_seconds = BulkHistogram(
            "kvscope_request_ttft_seconds",
            "Time to first token of finished requests.",
            ("engine", "model"),
            TTFT_BUCKETS,
            r,
        )
        self.ingest_lag_seconds = BulkHistogram(
            "kvscope_ingest_lag_seconds",
            "Per stored event: commit time minus the event's ts.",
            (),
            LAG_BUCKETS,
            r,
        )
        self.recoverable_hit_ratio = Gauge(
            "kvscope_recoverable_hit_ratio",
            "Recoverable hit rate over the last minute (ratio of token sums), set by the "
            "rollup job; absent for a series without prompt tokens in that minute.",
            request_labels,
            registry=r,
        )
        self._ratio_series: set[SeriesKey] = set()

    def exposition(self) -> bytes:
        """The text exposition format of this registry (``GET /metrics``)."""
        return generate_latest(self.registry)

    def observe_rejected(self, reason: str = "invalid") -> None:
        """Count one refused batch under ``reason`` (one of :data:`REJECT_REASONS`)."""
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason {reason!r}")
        self.ingest_batches.labels(status="rejected").inc()
        self.rejected_batches.labels(reason=reason).inc()

    def set_ingest_queue_source(self, depth: Callable[[], float]) -> None:
        """Read ``kvscope_ingest_queue_events`` from ``depth`` at every scrape."""
        self.queue_events.set_function(depth)

    def set_missing_batches_source(self, missing: Callable[[], Mapping[str, int]]) -> None:
        """Read ``kvscope_ingest_missing_batches`` from ``missing`` (engine id → seqs never
        received) at every scrape."""
        self.missing_batches.set_function(lambda: float(sum(missing().values())))

    def observe_ingest(self, outcome: IngestOutcome, summary: BatchSummary) -> None:
        """Count one committed batch: its status, and for a stored batch every event counter
        and histogram from its ``summary``; the ingest-lag histogram uses
        ``outcome.committed_at``. (Seq gaps are counted by the flusher.)"""
        if outcome.status == "conflict":
            self.ingest_batches.labels(status="rejected").inc()
            self.rejected_batches.labels(reason="seq_conflict").inc()
            return
        self.ingest_batches.labels(status=outcome.status).inc()
        if outcome.status != "stored":
            return
        for kind, n in outcome.events_by_kind.items():
            self.ingest_events.labels(kind=kind).inc(n)
        for labels, count, hash_hit, usable, recoverable in summary.lookups:
            self.cache_lookups.labels(*labels).inc(count)
            self.lookup_hash_hit_tokens.labels(*labels).inc(hash_hit)
            self.lookup_usable_tokens.labels(*labels).inc(usable)
            self.lookup_recoverable_tokens.labels(*labels).inc(recoverable)
        for labels, count in summary.invalidations:
            self.invalidations.labels(*labels).inc(count)
        for labels, counts, total in summary.recovery:
            self.recovery_seconds.add_counts(labels, counts, total)
        token_counters = (
            self.prompt_tokens,
            self.hash_hit_tokens,
            self.recoverable_tokens,
            self.replayed_tokens,
            self.recomputed_tokens,
        )
        for labels, count, *sums in summary.requests:
            self.requests.labels(*labels).inc(count)
            for counter, value in zip(token_counters, sums, strict=True):
                counter.labels(*labels).inc(value)
        for labels, counts, total in summary.ttft:
            self.request_ttft_seconds.add_counts(labels, counts, total)
        if outcome.committed_at and summary.ts_micros.size:
            lag = np.maximum(outcome.committed_at - summary.ts_micros / 1e6, 0.0)
            self.ingest_lag_seconds.observe_many((), lag)

    def set_recoverable_hit_ratios(self, ratios: Mapping[SeriesKey, float]) -> None:
        """Replace the gauge's series: set every (engine, model) in ``ratios``, remove the ones
        that had a value before but not now (no data is absent, not 0)."""
        for key in self._ratio_series - ratios.keys():
            self.recoverable_hit_ratio.remove(*key)
        for key, ratio in ratios.items():
            self.recoverable_hit_ratio.labels(*key).set(ratio)
        self._ratio_series = set(ratios)
