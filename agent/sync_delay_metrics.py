"""The indexer's sync-delay histograms (issue 23): how far a CSA indexer's state trailed the main
compressed KV boundary where lookups met it (``cache_lookup.indexer_sync_delay_tokens`` /
``indexer_sync_delay_seconds``, set by ``engine/cache/indexer_sync.py``).

* ``kvscope_indexer_sync_delay_tokens{engine, model, layer_group}`` — every ``indexer_state``
  lookup's delay in tokens; in a healthy engine all of them fall in the ``le="0.0"`` bucket, so
  ``_count − _bucket{le="0.0"}`` counts the lookups that met a trailing index;
* ``kvscope_indexer_sync_delay_seconds{engine, model, layer_group}`` — the same lookups'
  seconds since that indexer state last matched the boundary (0 when in sync).

``layer_group`` is the indexer group (CSA layers sharing one indexer geometry) the event names,
``0`` for a model with one. Fed a whole flush at a time (:class:`BulkHistogram`) from the
:class:`~agent.batch_summary.BatchSummary` of each stored batch, after its commit.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry

from agent.bulk_histogram import BulkHistogram
from agent.label_cap import SeriesFolder

SYNC_DELAY_TOKEN_BUCKETS = (0.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0, 16384.0)
"""Upper bounds (tokens) of ``kvscope_indexer_sync_delay_tokens``: 0 (in sync), then multiples
of the default prefix-match unit U = 16 (a trailing stamp is a whole number of units)."""
SYNC_DELAY_SECONDS_BUCKETS = (0.0, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 21600.0, 86400.0)
"""Upper bounds (seconds) of ``kvscope_indexer_sync_delay_seconds``: 0 (in sync) to a day."""
SYNC_DELAY_LABELS = ("engine", "model", "layer_group")

HistogramRows = Iterable[tuple[tuple[str, ...], list[int], float]]
"""``(labels, per-bucket counts, sum)`` rows, as :class:`BatchSummary` holds them."""


class SyncDelayHistograms:
    """The two histograms, registered on ``registry`` (the agent's own)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.tokens = BulkHistogram(
            "kvscope_indexer_sync_delay_tokens",
            "Tokens the CSA indexer's state trailed the main compressed KV boundary, per indexer_state lookup (0: in sync).",
            SYNC_DELAY_LABELS,
            SYNC_DELAY_TOKEN_BUCKETS,
            registry,
        )
        self.seconds = BulkHistogram(
            "kvscope_indexer_sync_delay_seconds",
            "Seconds since the CSA indexer's state last matched the main compressed KV boundary, per indexer_state lookup (0: in sync).",
            SYNC_DELAY_LABELS,
            SYNC_DELAY_SECONDS_BUCKETS,
            registry,
        )

    def observe(self, fold: SeriesFolder, tokens: HistogramRows, seconds: HistogramRows) -> None:
        """Add one committed batch's rows (engine and model folded by ``fold``'s label cap)."""
        for histogram, rows in ((self.tokens, tokens), (self.seconds, seconds)):
            for labels, (counts, total) in fold.histograms(rows).items():
                histogram.add_counts(labels, counts, total)

    def forget(self, label: str, value: str) -> None:
        """Remove every series whose ``label`` (``engine`` or ``model``) is ``value``."""
        self.tokens.remove_by_labels({label: value})
        self.seconds.remove_by_labels({label: value})
