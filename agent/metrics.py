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
"""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from agent.ingest import IngestOutcome
from engine.events import Outcome

SeriesKey = tuple[str, str]
"""(engine, model)."""


class AgentMetrics:
    """The agent's metrics and the registry exposing them (a fresh registry per instance)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        lookup_labels = ("engine", "model", "form", "outcome")
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
        self.recoverable_hit_ratio = Gauge(
            "kvscope_recoverable_hit_ratio",
            "Recoverable hit rate over the last minute (ratio of token sums), set by the minute "
            "alert job; absent for a series without prompt tokens in that minute.",
            request_labels,
            registry=r,
        )
        self._ratio_series: set[SeriesKey] = set()

    def exposition(self) -> bytes:
        """The text exposition format of this registry (``GET /metrics``)."""
        return generate_latest(self.registry)

    def observe_rejected(self) -> None:
        """Count one rejected batch."""
        self.ingest_batches.labels(status="rejected").inc()

    def observe_ingest(self, outcome: IngestOutcome) -> None:
        """Count a committed batch: its status, and for a stored batch every event counter."""
        self.ingest_batches.labels(status=outcome.status).inc()
        if outcome.status != "stored":
            return
        for kind, n in outcome.events_by_kind.items():
            self.ingest_events.labels(kind=kind).inc(n)
        lookups = outcome.tables.get("cache_lookups")
        if lookups is not None:
            self._observe_lookups(lookups)
        requests = outcome.tables.get("requests")
        if requests is not None:
            self._observe_requests(requests)

    def _observe_lookups(self, table: pa.Table) -> None:
        keys = ["engine_id", "model", "form", "tier", "outcome"]
        for row in table.group_by(keys).aggregate([([], "count_all")]).to_pylist():
            self.cache_lookups.labels(
                row["engine_id"], row["model"], row["form"], row["tier"], row["outcome"]
            ).inc(row["count_all"])
        keys = ["engine_id", "model", "form", "outcome"]
        sums = [("hash_hit_tokens", "sum"), ("usable_tokens", "sum"), ("recoverable_tokens", "sum")]
        for row in table.group_by(keys).aggregate(sums).to_pylist():
            labels = (row["engine_id"], row["model"], row["form"], row["outcome"])
            self.lookup_hash_hit_tokens.labels(*labels).inc(row["hash_hit_tokens_sum"])
            self.lookup_usable_tokens.labels(*labels).inc(row["usable_tokens_sum"])
            self.lookup_recoverable_tokens.labels(*labels).inc(row["recoverable_tokens_sum"])
        invalidated = table.filter(pc.equal(table["outcome"], Outcome.INVALIDATED.value))
        keys = ["engine_id", "model", "form", "reason"]
        for row in invalidated.group_by(keys).aggregate([([], "count_all")]).to_pylist():
            self.invalidations.labels(
                row["engine_id"], row["model"], row["form"], row["reason"]
            ).inc(row["count_all"])

    def _observe_requests(self, table: pa.Table) -> None:
        token_counters = {
            "prompt_tokens": self.prompt_tokens,
            "hash_hit_tokens": self.hash_hit_tokens,
            "recoverable_tokens": self.recoverable_tokens,
            "replayed_tokens": self.replayed_tokens,
            "recomputed_tokens": self.recomputed_tokens,
        }
        aggregations = [([], "count_all"), *((name, "sum") for name in token_counters)]
        for row in table.group_by(["engine_id", "model"]).aggregate(aggregations).to_pylist():
            labels = (row["engine_id"], row["model"])
            self.requests.labels(*labels).inc(row["count_all"])
            for name, counter in token_counters.items():
                counter.labels(*labels).inc(row[f"{name}_sum"])

    def set_recoverable_hit_ratios(self, ratios: Mapping[SeriesKey, float]) -> None:
        """Replace the gauge's series: set every (engine, model) in ``ratios``, remove the ones
        that had a value before but not now (no data is absent, not 0)."""
        for key in self._ratio_series - ratios.keys():
            self.recoverable_hit_ratio.remove(*key)
        for key, ratio in ratios.items():
            self.recoverable_hit_ratio.labels(*key).set(ratio)
        self._ratio_series = set(ratios)
