"""A Prometheus histogram observed a whole flush at a time (:class:`BulkHistogram`).

``prometheus_client.Histogram`` takes one ``observe`` call per value; a flush of thousands of
events would cost thousands of calls under its lock. Here the bucket counts of a batch are
computed once (:func:`bucket_counts`, one ``numpy.searchsorted``, possibly in a decode worker)
and added as one array. Exposition matches ``prometheus_client.Histogram``: cumulative ``le``
buckets then ``+Inf``, ``_sum`` and ``_count``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class BulkHistogram(Collector):
    """A Prometheus histogram observed many values at a time (a whole flush).

    Buckets are cumulative at exposition (``le``, then ``+Inf``); ``_sum`` and ``_count`` as
    ``prometheus_client.Histogram``. Thread-safe. Registers itself on ``registry``.
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

    def add_counts(self, labels: tuple[str, ...], counts: Sequence[int] | np.ndarray, total: float) -> None:
        """Add per-bucket (not cumulative) ``counts`` — one per bound plus ``+Inf`` — and their
        values' ``total`` under ``labels``.

        Raises:
            ValueError: ``labels`` or ``counts`` has the wrong length.
        """
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

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        """Remove every series whose labels include all of ``labels`` (as
        ``prometheus_client``'s ``MetricWrapperBase.remove_by_labels``).

        Raises:
            ValueError: a label name this histogram does not have.
        """
        unknown = [k for k in labels if k not in self.labelnames]
        if unknown:
            raise ValueError(f"{self.name}: unknown label names {unknown}; expected {self.labelnames}")
        wanted = [(self.labelnames.index(k), v) for k, v in labels.items()]
        with self._lock:
            for key in [k for k in self._series if all(k[i] == v for i, v in wanted)]:
                del self._series[key]

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
