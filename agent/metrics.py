"""The agent's Prometheus metrics (DESIGN.md §6).

Every metric lives on the :class:`AgentMetrics` instance's own ``CollectorRegistry`` (never the
process-global one), so two agents — or two tests — in one process never share a counter.

Naming: prefix ``kvscope_``, base units, ``_total`` on counters, no ``_created`` series. Labels come only from
{engine, model, form, tier, outcome, reason, tp_rank} plus ``status``/``kind`` on the ingest counters
and ``label`` on the folded-values counter; never request ids. Counters are cumulative since the agent started; consumers compute rates.
They are incremented only after a batch's transaction committed (:meth:`observe_ingest`, and
:meth:`observe_summary` once per flush), so a
rejected or rolled-back batch never moves an event counter.

``kvscope_invalidations_total`` counts lookups whose outcome is ``invalidated`` (present by hash,
unusable), by reason; ``kvscope_tp_disagreements_total{form, tp_rank}`` those whose reason is
``tp_disagree``, by the tensor-parallel rank that held the form back (at most N values); misses and the recovered/replayed outcomes are visible in
``kvscope_cache_lookups_total{outcome}``.

Histograms fed from whole flushes (thousands of events at once) are :class:`BulkHistogram`
collectors: one ``numpy.searchsorted`` per flush instead of one ``observe`` call per event.
``kvscope_recovery_seconds`` observes the lookups that recovered or replayed state (outcome
``recovered`` or ``replayed``), by form and tier; ``kvscope_request_ttft_seconds`` every
request; ``kvscope_ingest_lag_seconds`` every stored event's commit time minus its ``ts``;
``kvscope_indexer_sync_delay_tokens`` / ``_seconds`` every ``indexer_state`` lookup (their module).

The agent's own ingest health: ``kvscope_ingest_batches_total{status}``,
``kvscope_ingest_events_total{kind}``, ``kvscope_ingest_rejected_batches_total{reason}``
(``invalid``, ``too_large``, ``content_type``, ``seq_conflict``, ``queue_full``,
``store_error``, ``decode_error``), ``kvscope_ingest_seq_gaps_total`` (jumps past seqs never received),
``kvscope_ingest_missing_batches`` (seqs never received now, all engines),
``kvscope_ingest_queue_events`` (events waiting for or in a flush).

Bounded labels: ``engine`` and ``model`` come from the events, so each keeps at most
``label_max_values`` (config ``metric_label_max_values``, default 100) distinct values — the
first ones seen — and every later value is folded into ``other`` (:mod:`agent.label_cap`: why
the first, not the busiest). Folding preserves sums: the ``other`` series holds exactly the
folded values' counts and token sums. When a label is full, a kept value unseen for
``label_idle_seconds`` (config ``metric_label_idle_seconds``, default an hour) makes room for a
new one: every series carrying it is removed from every metric with the label (counters,
histograms, the ratio gauge). ``kvscope_metric_label_values_folded_total{label}`` counts the
distinct values folded per label (``engine``, ``model``),
``kvscope_metric_label_values_evicted_total{label}`` the values evicted.

The process: the ``process_*`` metrics of prometheus_client's ``ProcessCollector``;
``kvscope_duckdb_memory_bytes`` (DuckDB's buffer-manager memory, read at scrape time, absent
while no store is open): :mod:`agent.process_metrics`.

:meth:`AgentMetrics.exposition` renders everything; ``GET /metrics`` calls it in a worker thread,
so a slow scrape never holds the event loop (ingest, ``/healthz``).

Split out: :mod:`agent.bulk_histogram`, :mod:`agent.batch_summary` (importable from here as
before), :mod:`agent.sync_delay_metrics`, :mod:`agent.ingest_stages` (``kvscope_ingest_stage_seconds_total``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics import disable_created_metrics

from agent.batch_summary import TTFT_BUCKETS, BatchSummary, Labels, summarize_tables
from agent.bulk_histogram import BulkHistogram, bucket_counts
from agent.ingest import RECOVERY_BUCKETS, IngestOutcome
from agent.ingest_stages import IngestStages
from agent.label_cap import DEFAULT_IDLE_SECONDS, DEFAULT_MAX_VALUES, LabelCap, SeriesFolder
from agent.process_metrics import SourcedGauge, register_process_collector
from agent.run_info import EngineRunInfo
from agent.sync_delay_metrics import SyncDelayHistograms

__all__ = [
    "LAG_BUCKETS",
    "REJECT_REASONS",
    "TTFT_BUCKETS",
    "AgentMetrics",
    "BatchSummary",
    "BulkHistogram",
    "HitSums",
    "Labels",
    "SeriesKey",
    "bucket_counts",
    "summarize_tables",
]

LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Upper bounds (seconds) of ``kvscope_ingest_lag_seconds``."""
REJECT_REASONS = ("invalid", "too_large", "content_type", "seq_conflict", "queue_full", "store_error", "decode_error")
"""Label values of ``kvscope_ingest_rejected_batches_total``."""
CAPPED_LABELS = ("engine", "model")
"""The free-form labels (values from the events) whose distinct values :class:`LabelCap` bounds."""


SeriesKey = tuple[str, str]
"""(engine, model)."""
HitSums = tuple[float, float]
"""(recoverable tokens, prompt tokens) of one series over the ratio gauge's minute."""


class AgentMetrics:
    """The agent's metrics and the registry exposing them (a fresh registry per instance).

    Args:
        label_max_values: distinct values kept per free-form label (``engine``, ``model``); later
            values are folded into ``other`` (:mod:`agent.label_cap`). The agent passes
            ``metric_label_max_values``.
        label_idle_seconds: a kept value unseen this long (by ``clock``, seconds) is evicted,
            its series removed, when a new value arrives at a full cap; ``None`` never evicts.
            The agent passes ``metric_label_idle_seconds``.
        clock: the label cap's clock (monotonic seconds), injectable for tests.

    Raises:
        ValueError: ``label_max_values`` < 1, ``label_idle_seconds`` not > 0 (and not None).
    """

    def __init__(
        self,
        *,
        label_max_values: int = DEFAULT_MAX_VALUES,
        label_idle_seconds: float | None = DEFAULT_IDLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        disable_created_metrics()  # prometheus_client's switch is process-wide: fine in the agent's own process
        self.registry = CollectorRegistry()
        r = self.registry
        self.label_cap = LabelCap(
            CAPPED_LABELS, label_max_values, r, idle_seconds=label_idle_seconds, clock=clock, on_evict=self._forget
        )
        register_process_collector(r)
        self.run_info = EngineRunInfo(self.label_cap, r)  # kvscope_engine_run_info (agent.run_info)
        self.duckdb_memory = SourcedGauge(
            "kvscope_duckdb_memory_bytes",
            "Memory DuckDB's buffer manager holds now (sum of duckdb_memory().memory_usage_bytes); "
            "absent while no store is open.",
            r,
        )
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
        self.tp_disagreements = Counter(
            "kvscope_tp_disagreements_total",
            "Lookups where another tensor-parallel rank held the form back (reason tp_disagree), by that rank.",
            ("engine", "model", "form", "tp_rank"),
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
        self.stages = IngestStages(r)
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
        self.sync_delay = SyncDelayHistograms(r)
        self.recoverable_hit_ratio = Gauge(
            "kvscope_recoverable_hit_ratio",
            "Recoverable hit rate over the last minute (ratio of token sums), set by the "
            "rollup job; absent for a series without prompt tokens in that minute.",
            request_labels,
            registry=r,
        )
        self._ratio_series: set[SeriesKey] = set()
        self._ratio_lock = threading.Lock()

    def _forget(self, label: str, value: str) -> None:
        """Remove every series whose ``label`` is ``value`` (the label cap evicted it)."""
        for metric in (
            self.cache_lookups,
            self.lookup_hash_hit_tokens,
            self.lookup_usable_tokens,
            self.lookup_recoverable_tokens,
            self.invalidations,
            self.tp_disagreements,
            self.requests,
            self.prompt_tokens,
            self.hash_hit_tokens,
            self.recoverable_tokens,
            self.replayed_tokens,
            self.recomputed_tokens,
            self.recovery_seconds,
            self.request_ttft_seconds,
        ):
            metric.remove_by_labels({label: value})
        self.sync_delay.forget(label, value)
        position = CAPPED_LABELS.index(label)
        with self._ratio_lock:
            gone = {key for key in self._ratio_series if key[position] == value}
            for key in gone:
                self.recoverable_hit_ratio.remove(*key)
            self._ratio_series -= gone

    def exposition(self) -> bytes:
        """The text exposition format of this registry (``GET /metrics``). It reads every
        collector, scrape-time sources included (DuckDB's memory): call it off the event loop."""
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

    def set_duckdb_memory_source(self, memory_bytes: Callable[[], float | None]) -> None:
        """Read ``kvscope_duckdb_memory_bytes`` from ``memory_bytes`` at every scrape (``None``
        or an exception: absent from that scrape; see
        :func:`agent.process_metrics.duckdb_memory_bytes`)."""
        self.duckdb_memory.set_source(memory_bytes)

    def observe_ingest(self, outcome: IngestOutcome) -> None:
        """Count one committed batch: its status and, when stored, its events per kind. (Its
        events' counters and histograms come with its flush's :meth:`observe_summary`; seq gaps
        are counted by the flusher.)"""
        if outcome.status == "conflict":
            self.ingest_batches.labels(status="rejected").inc()
            self.rejected_batches.labels(reason="seq_conflict").inc()
            return
        self.ingest_batches.labels(status=outcome.status).inc()
        if outcome.status == "stored":
            for kind, n in outcome.events_by_kind.items():
                self.ingest_events.labels(kind=kind).inc(n)

    def observe_summary(self, summary: BatchSummary, committed_at: float) -> None:
        """Add what one flush stored (:func:`~agent.batch_summary.summarize_tables` of its rows):
        every event counter and histogram; the ingest-lag histogram uses ``committed_at`` (unix
        seconds). Engine and model pass through the label cap; rows that fold onto one series
        are summed first, so the work is one counter update per series, not per event."""
        fold = SeriesFolder(self.label_cap, CAPPED_LABELS)
        lookup_counters = (
            self.cache_lookups,
            self.lookup_hash_hit_tokens,
            self.lookup_usable_tokens,
            self.lookup_recoverable_tokens,
        )
        for labels, sums in fold.sums(summary.lookups).items():
            for counter, value in zip(lookup_counters, sums, strict=True):
                counter.labels(*labels).inc(value)
        for labels, (count,) in fold.sums(summary.invalidations).items():
            self.invalidations.labels(*labels).inc(count)
        for labels, (count,) in fold.sums(summary.disagreements).items():
            self.tp_disagreements.labels(*labels).inc(count)
        for labels, (counts, total) in fold.histograms(summary.recovery).items():
            self.recovery_seconds.add_counts(labels, counts, total)
        self.sync_delay.observe(fold, summary.sync_delay_tokens, summary.sync_delay_seconds)
        request_counters = (
            self.requests,
            self.prompt_tokens,
            self.hash_hit_tokens,
            self.recoverable_tokens,
            self.replayed_tokens,
            self.recomputed_tokens,
        )
        for labels, sums in fold.sums(summary.requests).items():
            for counter, value in zip(request_counters, sums, strict=True):
                counter.labels(*labels).inc(value)
        for labels, (counts, total) in fold.histograms(summary.ttft).items():
            self.request_ttft_seconds.add_counts(labels, counts, total)
        if committed_at and summary.ts_micros.size:
            lag = np.maximum(committed_at - summary.ts_micros / 1e6, 0.0)
            self.ingest_lag_seconds.observe_many((), lag)

    def set_recoverable_hit_ratios(self, sums: Mapping[SeriesKey, HitSums]) -> None:
        """Replace the gauge's series from each (engine, model)'s (recoverable tokens, prompt
        tokens) of the last minute: the gauge is their ratio. Series the label cap folds onto
        one (``other``) are summed before dividing, so ``other`` is the folded series' exact
        ratio of sums. A series with no prompt tokens, or that had a value before but not now,
        is removed (no data is absent, not 0)."""
        folded = SeriesFolder(self.label_cap, CAPPED_LABELS).sums((key, recoverable, prompt) for key, (recoverable, prompt) in sums.items())
        ratios: dict[SeriesKey, float] = {
            (labels[0], labels[1]): recoverable / prompt
            for labels, (recoverable, prompt) in folded.items()
            if prompt > 0
        }
        with self._ratio_lock:
            for key in self._ratio_series - ratios.keys():
                self.recoverable_hit_ratio.remove(*key)
            for key, ratio in ratios.items():
                self.recoverable_hit_ratio.labels(*key).set(ratio)
            self._ratio_series = set(ratios)
