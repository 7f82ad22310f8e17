"""What one stored batch adds to the event metrics (:class:`BatchSummary`).

:func:`summarize_tables` runs where the batch is decoded (a decode worker process or thread,
:mod:`agent.decode`), so the agent's main process only adds numbers
(:meth:`agent.metrics.AgentMetrics.observe_ingest`). Labels here are the raw event values; the
label cap (:mod:`agent.label_cap`) folds them when they are added.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from agent.bulk_histogram import bucket_counts
from agent.ingest import RECOVERING_OUTCOMES, RECOVERY_BUCKETS
from agent.sync_delay_metrics import SYNC_DELAY_SECONDS_BUCKETS, SYNC_DELAY_TOKEN_BUCKETS
from engine.events import Form, Outcome, Reason

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of ``kvscope_request_ttft_seconds``."""

Labels = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BatchSummary:
    """What a stored batch adds to the event metrics, computed where the batch is decoded (a
    decode process or thread) so the agent's main process only adds numbers. Picklable.

    ``lookups``: (engine, model, form, tier, outcome) → count and hash-hit / usable / recoverable
    token sums; ``invalidations``: (engine, model, form, reason) → count; ``recovery``: (engine,
    model, form, tier) → recovery-seconds bucket counts and sum (outcomes recovered/replayed);
    ``requests``: (engine, model) → count and prompt / hash-hit / recoverable / replayed /
    recomputed token sums; ``ttft``: (engine, model) → TTFT bucket counts and sum;
    ``disagreements``: (engine, model, form, tp_rank) → lookups whose reason is ``tp_disagree``
    (``tp_rank``: the tensor-parallel rank that held the form back); ``sync_delay_tokens`` /
    ``sync_delay_seconds``: (engine, model, layer_group) → the ``indexer_state`` lookups'
    indexer sync-delay bucket counts and sum (:mod:`agent.sync_delay_metrics`); ``ts_micros``:
    every event's ``ts`` (for the ingest lag once the commit time is known). Every label tuple
    starts with (engine, model).
    """

    lookups: list[tuple[Labels, int, int, int, int]] = field(default_factory=list)
    invalidations: list[tuple[Labels, int]] = field(default_factory=list)
    disagreements: list[tuple[Labels, int]] = field(default_factory=list)
    recovery: list[tuple[Labels, list[int], float]] = field(default_factory=list)
    requests: list[tuple[Labels, int, int, int, int, int, int]] = field(default_factory=list)
    ttft: list[tuple[Labels, list[int], float]] = field(default_factory=list)
    sync_delay_tokens: list[tuple[Labels, list[int], float]] = field(default_factory=list)
    sync_delay_seconds: list[tuple[Labels, list[int], float]] = field(default_factory=list)
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
        disagreeing = lookups.filter(pc.equal(lookups["reason"], Reason.TP_DISAGREE.value))
        keys = ["engine_id", "model", "form", "tp_rank"]
        for row in disagreeing.group_by(keys, use_threads=False).aggregate([([], "count_all")]).to_pylist():
            summary.disagreements.append((tuple(str(row[k]) for k in keys), row["count_all"]))
        recovering = lookups.filter(pc.is_in(lookups["outcome"], pa.array(RECOVERING_OUTCOMES)))
        summary.recovery.extend(
            _histogram_groups(recovering, ("engine_id", "model", "form", "tier"), "recovery_seconds", RECOVERY_BUCKETS)
        )
        indexed = lookups.filter(pc.equal(lookups["form"], Form.INDEXER_STATE.value))
        keys = ["engine_id", "model", "layer_group"]
        summary.sync_delay_tokens.extend(_histogram_groups(indexed, keys, "indexer_sync_delay_tokens", SYNC_DELAY_TOKEN_BUCKETS))
        summary.sync_delay_seconds.extend(_histogram_groups(indexed, keys, "indexer_sync_delay_seconds", SYNC_DELAY_SECONDS_BUCKETS))
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
