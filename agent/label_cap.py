"""A cap on the distinct values of free-form Prometheus labels (:class:`LabelCap`).

``engine`` and ``model`` come from the events, so nothing bounds them: 20,000 distinct models made
``/metrics`` 74 MB and a scrape took half a minute (issue 19). A :class:`LabelCap` keeps at most
``max_values`` distinct values per label name — the first ones seen — and folds every later value
into :data:`FOLDED_VALUE` (``other``). Folding only renames the series, so sums are preserved:
``sum(kvscope_requests_total)`` is the same with or without the cap, and the ``other`` series
holds exactly the folded values' counts.

Why the first values, not the busiest: a kept value's series keeps its name while the value is in
use, so no counter ever moves from ``model="a"`` to ``model="other"`` between two scrapes (which
would read as a reset and a jump to Prometheus's ``rate``). The price is that a busy model first
seen after the cap filled is only visible inside ``other`` while every kept value is in use;
raise ``metric_label_max_values`` when ``kvscope_metric_label_values_folded_total`` grows. The raw
events keep every value: SQL and the named queries see all models.

Idle values are evicted, and only when the cap is full: the default engine id
(``host-pid-start``, :func:`engine.llm.default_engine_id`) is new at every engine run, so without
eviction 100 engine restarts would fill the slots with ids that never come back, and every later
engine would read ``other``. When a label is at its cap and a new value arrives, the kept value
idle longest (not seen in any fold) is evicted if it has been idle for at least ``idle_seconds``
— one per new value, only as many as needed — and the new value takes its slot; below the cap
nothing is evicted. Every series carrying the evicted value is removed from every metric that has
the label (the ``on_evict`` callback), and ``kvscope_metric_label_values_evicted_total{label}``
counts it. A dead engine id never returns, and removing its series is what Prometheus exporters
do for deleted objects (kube-state-metrics drops a deleted pod's series); ``rate()`` and
``increase()`` handle a series that ends. An evicted value that comes back is a new value: it
takes a slot if one is free or evictable, else it folds (its earlier counts are gone from
``/metrics``, not from the store). ``idle_seconds=None`` never evicts (the first values are kept
for the life of the process).

Source: the OpenTelemetry metrics SDK's cardinality limit, which also keeps the first attribute
sets seen and aggregates the overflow into one series (``otel.metric.overflow="true"``); here the
cap is per label rather than per series, so the overflow keeps its other labels (form, tier,
outcome) and only the capped label reads ``other``. (Prometheus's own ``sample_limit`` instead
fails the whole scrape.)

``kvscope_metric_label_values_folded_total{label}`` counts the *distinct* values folded per label
name, exactly, up to :data:`FOLDED_MEMORY_MAX` per label (the cap remembers a 64-bit hash of each
folded value to count it once, about 60 bytes each); past that it stops counting, so the counter is
a lower bound — by then the label is far past its cap anyway.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter

FOLDED_VALUE = "other"
"""The label value every folded value becomes. A real value spelled ``other`` shares its series
(and takes no slot of the cap)."""
DEFAULT_MAX_VALUES = 100
"""Distinct values kept per label name unless configured (``metric_label_max_values``)."""
DEFAULT_IDLE_SECONDS = 3600.0
"""A kept value unseen this long may be evicted when the cap is full, unless configured
(``metric_label_idle_seconds``)."""
FOLDED_MEMORY_MAX = 100_000
"""Distinct folded values remembered (as hashes) per label name for the exact folded count."""


class LabelCap:
    """Keeps at most ``max_values`` distinct values per label in ``label_names``; later values
    read as :data:`FOLDED_VALUE`, unless the cap is full and the kept value idle longest has been
    unseen for ``idle_seconds`` (by ``clock``, seconds): that one is evicted — ``on_evict(label,
    value)`` is called, under the cap's lock, so the caller removes its series — and the new value
    takes its slot. Thread-safe. Registers ``kvscope_metric_label_values_folded_total{label}`` and
    ``kvscope_metric_label_values_evicted_total{label}`` on ``registry`` (0 for every label name
    from the start).

    Raises:
        ValueError: ``max_values`` < 1, ``idle_seconds`` not > 0 (and not None), or no label names.
    """

    def __init__(
        self,
        label_names: Sequence[str],
        max_values: int,
        registry: CollectorRegistry,
        *,
        idle_seconds: float | None = DEFAULT_IDLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[str, str], None] | None = None,
    ) -> None:
        if max_values < 1:
            raise ValueError(f"max_values must be >= 1, got {max_values}")
        if idle_seconds is not None and not idle_seconds > 0:
            raise ValueError(f"idle_seconds must be > 0 or None, got {idle_seconds}")
        if not label_names:
            raise ValueError("label_names must not be empty")
        self.max_values = max_values
        self.idle_seconds = idle_seconds
        self.on_evict = on_evict
        self._clock = clock
        # value -> when last seen, least recently seen first
        self._kept: dict[str, OrderedDict[str, float]] = {name: OrderedDict() for name in label_names}
        self._folded: dict[str, set[int]] = {name: set() for name in label_names}
        self._lock = threading.Lock()
        self.folded_values = Counter(
            "kvscope_metric_label_values_folded_total",
            "Distinct values of a free-form label (engine, model) folded into 'other' because the "
            "label already had metric_label_max_values values.",
            ("label",),
            registry=registry,
        )
        self.evicted_values = Counter(
            "kvscope_metric_label_values_evicted_total",
            "Kept values of a free-form label (engine, model) evicted, their series removed, to "
            "make room for a new value: unseen for metric_label_idle_seconds while the label was "
            "at its cap.",
            ("label",),
            registry=registry,
        )
        for name in label_names:
            self.folded_values.labels(label=name)
            self.evicted_values.labels(label=name)

    def fold(self, name: str, value: str) -> str:
        """``value`` if it is (or can become) one of label ``name``'s kept values, else
        :data:`FOLDED_VALUE` (the first fold of a value is counted). Marks a kept ``value`` as
        seen now.

        Raises:
            KeyError: ``name`` is not a capped label.
        """
        kept = self._kept[name]
        with self._lock:
            if value == FOLDED_VALUE:
                return value
            now = self._clock()
            if value in kept:
                kept[value] = now
                kept.move_to_end(value)
                return value
            if len(kept) >= self.max_values:
                self._evict_idle(name, kept, now)
            if len(kept) < self.max_values:
                kept[value] = now
                return value
            folded = self._folded[name]
            key = hash(value)
            if key not in folded and len(folded) < FOLDED_MEMORY_MAX:
                folded.add(key)
                self.folded_values.labels(label=name).inc()
            return FOLDED_VALUE

    def _evict_idle(self, name: str, kept: OrderedDict[str, float], now: float) -> None:
        """Evict the value idle longest if unseen for ``idle_seconds`` (caller holds the lock)."""
        if self.idle_seconds is None:
            return
        oldest, seen = next(iter(kept.items()))
        if now - seen < self.idle_seconds:
            return
        del kept[oldest]
        self.evicted_values.labels(label=name).inc()
        if self.on_evict is not None:
            self.on_evict(name, oldest)

    def kept(self, name: str) -> frozenset[str]:
        """The values of label ``name`` kept now (at most ``max_values``)."""
        with self._lock:
            return frozenset(self._kept[name])


Labels = tuple[str, ...]


class SeriesFolder:
    """Folds label tuples whose first labels are ``names`` (for the agent: engine, model) through
    ``cap``, memoised for one use (a batch), and sums the rows that land on one series — so a
    batch of 20,000 distinct models costs one counter update per resulting series."""

    def __init__(self, cap: LabelCap, names: Sequence[str]) -> None:
        self._cap = cap
        self._names = tuple(names)
        self._memo: dict[Labels, Labels] = {}

    def key(self, labels: Labels) -> Labels:
        """``labels`` with its first ``len(names)`` values folded."""
        n = len(self._names)
        head = labels[:n]
        folded = self._memo.get(head)
        if folded is None:
            folded = self._memo[head] = tuple(
                self._cap.fold(name, v) for name, v in zip(self._names, head, strict=True)
            )
        return (*folded, *labels[n:])

    def sums(self, rows: Iterable[Sequence[Any]]) -> dict[Labels, list[float]]:
        """``(labels, n1, n2, ...)`` rows → folded labels → [Σ n1, Σ n2, ...]."""
        out: dict[Labels, list[float]] = {}
        for row in rows:
            key = self.key(row[0])
            acc = out.get(key)
            if acc is None:
                out[key] = list(row[1:])
            else:
                for i, value in enumerate(row[1:]):
                    acc[i] += value
        return out

    def histograms(
        self, rows: Iterable[tuple[Labels, list[int], float]]
    ) -> dict[Labels, tuple[np.ndarray, float]]:
        """``(labels, bucket counts, sum)`` rows → folded labels → (Σ counts, Σ sums)."""
        out: dict[Labels, tuple[np.ndarray, float]] = {}
        for labels, counts, total in rows:
            key = self.key(labels)
            previous = out.get(key)
            array = np.asarray(counts, dtype=np.int64)
            out[key] = (
                (array, total) if previous is None else (previous[0] + array, previous[1] + total)
            )
        return out
