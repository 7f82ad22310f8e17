"""Quantiles from cumulative histogram buckets, as Prometheus's ``histogram_quantile`` computes
them (the recovery-latency rules and the Forms page share it)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def histogram_quantile(q: float, bounds: Sequence[float], cumulative: Sequence[int]) -> float:
    """Prometheus's ``histogram_quantile``: the q-quantile from cumulative bucket counts (the
    last count is the total), linear within the bucket it falls in; a quantile in the +Inf
    bucket is the highest finite bound."""
    cumulative = [int(c) for c in itertools.accumulate(cumulative, max)]  # as Prometheus: non-decreasing
    total = cumulative[-1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0
    for bound, count in zip(bounds, cumulative, strict=False):
        if count >= rank:
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return bounds[-1]
