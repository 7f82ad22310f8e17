"""What stored rows add to the event metrics (:class:`BatchSummary`).

:func:`summarize_tables` runs once per flush of the ingest pipeline, over all the rows that flush
stored (:mod:`agent.pipeline`), after its commit and before any of its batches is answered; the
metrics then only add the groups' numbers (:meth:`agent.metrics.AgentMetrics.observe_summary`).
Labels here are the raw event values; the label cap (:mod:`agent.label_cap`) folds them when
they are added.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

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
_LOOKUP_KEYS = ("engine_id", "model", "form", "tier", "outcome", "reason", "tp_rank", "layer_group")
_LOOKUP_SUMS = ("hash_hit_tokens", "usable_tokens", "recoverable_tokens", "recovery_seconds", "indexer_sync_delay_tokens", "indexer_sync_delay_seconds")
_RECOVERING = frozenset(RECOVERING_OUTCOMES)


def _bucket(table: pa.Table, column: str, bounds: Sequence[float]) -> np.ndarray:
    """Each row's histogram bucket for ``column`` (the index of the first upper bound ≥ the
    value, as Prometheus's ``le``; ``len(bounds)``: ``+Inf``)."""
    values = table[column].to_numpy().astype(np.float64, copy=False)
    return np.searchsorted(np.asarray(bounds, dtype=np.float64), values, side="left").astype(np.int8)


def _grouped(table: pa.Table, keys: Sequence[str], sums: Sequence[str]) -> tuple[list[list[object]], ...]:
    """One ``group_by`` over ``keys`` with ``count_all`` and the ``sums``: the result's columns
    as Python lists (keys, then the count, then the sums)."""
    aggregations: list[tuple[object, str]] = [([], "count_all"), *((name, "sum") for name in sums)]
    grouped = table.group_by(list(keys), use_threads=False).aggregate(aggregations)
    names = [*keys, "count_all", *(f"{name}_sum" for name in sums)]
    return tuple(grouped[name].to_pylist() for name in names)


def _add_histogram(into: dict[Labels, tuple[list[int], float]], labels: Labels, buckets: int, bucket: int, count: int, total: float) -> None:
    counts, previous = into.get(labels) or ([0] * buckets, 0.0)
    counts[bucket] += count
    into[labels] = (counts, previous + total)


def summarize_tables(tables: Mapping[str, pa.Table]) -> BatchSummary:
    """The :class:`BatchSummary` of stored rows (table name → rows; one batch or a whole
    flush): per table **one** grouped aggregation (``pyarrow`` ``group_by`` over every label
    column and each row's histogram bucket), then the few resulting groups are folded into the
    metric families in Python — nothing per event."""
    summary = BatchSummary()
    # Both ingest paths give enum columns the enum's own dictionary; unify anyway, so a table
    # built elsewhere (other dictionaries per chunk) cannot fail the grouping.
    tables = {name: table.unify_dictionaries() for name, table in tables.items()}
    lookups = tables.get("cache_lookups")
    if lookups is not None and lookups.num_rows:
        _summarize_lookups(lookups, summary)
    requests = tables.get("requests")
    if requests is not None and requests.num_rows:
        with_bucket = requests.append_column("ttft_bucket", pa.array(_bucket(requests, "ttft_seconds", TTFT_BUCKETS)))
        keys, sums = ("engine_id", "model", "ttft_bucket"), _REQUEST_SUMS
        columns = _grouped(with_bucket, keys, (*sums, "ttft_seconds"))
        per_request: dict[Labels, list[int]] = {}
        ttft: dict[Labels, tuple[list[int], float]] = {}
        for engine, model, bucket, n, *values in zip(*columns, strict=True):
            labels = (engine, model)
            acc = per_request.setdefault(labels, [0] * (1 + len(sums)))
            acc[0] += n
            for i, value in enumerate(values[: len(sums)]):
                acc[1 + i] += value
            _add_histogram(ttft, labels, len(TTFT_BUCKETS) + 1, bucket, n, values[-1])
        summary.requests.extend((labels, *acc) for labels, acc in per_request.items())  # type: ignore[misc]
        summary.ttft.extend((labels, counts, total) for labels, (counts, total) in ttft.items())
    stamps = [t["ts"].cast(pa.int64()).to_numpy() for t in tables.values() if t.num_rows]
    if stamps:
        object.__setattr__(summary, "ts_micros", np.concatenate(stamps))
    return summary


def _summarize_lookups(lookups: pa.Table, summary: BatchSummary) -> None:
    buckets = {
        "recovery_bucket": ("recovery_seconds", RECOVERY_BUCKETS),
        "tokens_bucket": ("indexer_sync_delay_tokens", SYNC_DELAY_TOKEN_BUCKETS),
        "seconds_bucket": ("indexer_sync_delay_seconds", SYNC_DELAY_SECONDS_BUCKETS),
    }
    table = lookups.select([*_LOOKUP_KEYS, *_LOOKUP_SUMS])
    for name, (column, bounds) in buckets.items():
        table = table.append_column(name, pa.array(_bucket(lookups, column, bounds)))
    columns = _grouped(table, (*_LOOKUP_KEYS, *buckets), _LOOKUP_SUMS)
    per_lookup: dict[Labels, list[int]] = {}
    invalidations: dict[Labels, int] = {}
    disagreements: dict[Labels, int] = {}
    recovery: dict[Labels, tuple[list[int], float]] = {}
    sync_tokens: dict[Labels, tuple[list[int], float]] = {}
    sync_seconds: dict[Labels, tuple[list[int], float]] = {}
    for row in zip(*columns, strict=True):
        engine, model, form, tier, outcome, reason, tp_rank, layer_group, rb, tb, sb, n, hit, usable, recoverable, seconds, delay_tokens, delay_seconds = row
        acc = per_lookup.setdefault((engine, model, form, tier, outcome), [0, 0, 0, 0])
        acc[0] += n
        acc[1] += hit
        acc[2] += usable
        acc[3] += recoverable
        if outcome == Outcome.INVALIDATED.value:
            key = (engine, model, form, reason)
            invalidations[key] = invalidations.get(key, 0) + n
        if reason == Reason.TP_DISAGREE.value:
            key = (engine, model, form, str(tp_rank))
            disagreements[key] = disagreements.get(key, 0) + n
        if outcome in _RECOVERING:
            _add_histogram(recovery, (engine, model, form, tier), len(RECOVERY_BUCKETS) + 1, rb, n, seconds)
        if form == Form.INDEXER_STATE.value:
            labels = (engine, model, str(layer_group))
            _add_histogram(sync_tokens, labels, len(SYNC_DELAY_TOKEN_BUCKETS) + 1, tb, n, float(delay_tokens))
            _add_histogram(sync_seconds, labels, len(SYNC_DELAY_SECONDS_BUCKETS) + 1, sb, n, delay_seconds)
    summary.lookups.extend((labels, *acc) for labels, acc in per_lookup.items())  # type: ignore[misc]
    summary.invalidations.extend(invalidations.items())
    summary.disagreements.extend(disagreements.items())
    summary.recovery.extend((labels, counts, total) for labels, (counts, total) in recovery.items())
    summary.sync_delay_tokens.extend((labels, counts, total) for labels, (counts, total) in sync_tokens.items())
    summary.sync_delay_seconds.extend((labels, counts, total) for labels, (counts, total) in sync_seconds.items())
