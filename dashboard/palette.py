"""One colour per form, per outcome and per series on every page, and readable reason labels.

Vega-Lite picks colours by the order values appear in a chart's data, so the same form would be
blue on one chart and orange on the next; every chart colours through the fixed scales here
instead (:func:`color`). Reason values are the ``engine.events.Reason`` enum values; their labels
(:data:`REASON_LABELS`) say what happened in words an operator reads without the design notes.
"""

from __future__ import annotations

from collections.abc import Iterable

import altair as alt

FORM_COLORS = {
    "full_kv": "#1f77b4",
    "swa_window": "#ff7f0e",
    "compressed_kv": "#2ca02c",
    "uncompressed_tail": "#9467bd",
    "indexer_state": "#8c564b",
    "linear_state": "#e377c2",
    "(no form)": "#7f7f7f",
}
"""Form → colour (Tableau 10, far apart), and the colour of losses no form explains."""

OUTCOME_COLORS = {
    "hit": "#2ca02c",
    "recovered": "#1f77b4",
    "replayed": "#ff7f0e",
    "invalidated": "#d62728",
    "miss": "#7f7f7f",
}
"""Outcome → colour: reuse green and blue, reuse at a cost orange, not reused red and grey."""

SERIES_COLORS = {
    "recoverable": "#2ca02c",
    "raw": "#1f77b4",
    "replayed": "#ff7f0e",
    "recomputed": "#d62728",
    "p50": "#2ca02c",
    "p95": "#ff7f0e",
    "p99": "#d62728",
}
"""The other series: hit-rate lines, prompt-token parts, latency quantiles."""

REASON_LABELS = {
    "none": "none (reused)",
    "no_prefix_match": "no prefix match",
    "prompt_end": "prompt end (last token recomputed)",
    "kv_evicted": "KV blocks evicted",
    "below_granularity": "below the form's granularity",
    "compressed_evicted": "compressed KV evicted",
    "compressed_version_mismatch": "compressed KV version mismatch",
    "tail_missing": "uncompressed tail missing",
    "tail_version_mismatch": "uncompressed tail version mismatch",
    "swa_evicted": "sliding window evicted",
    "indexer_stale": "indexer keys stale",
    "linear_checkpoint_missing": "no recurrent checkpoint",
    "in_flight_swap": "swap-in still in flight",
    "offload_corrupt": "offloaded copy corrupt",
    "layout_mismatch": "kernel layout mismatch",
    "misaligned": "misaligned resume point",
    "group_disagree": "layer groups disagree",
    "tp_disagree": "another TP rank held it back",
    "epoch_changed": "state replaced (epoch changed)",
    "admission_recompute_cheaper": "recompute was cheaper",
    "recovery_cap_reached": "recovery cap reached",
    "model_revision_changed": "model revision changed",
    "tier_incomplete": "lower tier incomplete",
}
"""Reason value → what happened, in words."""


def reason_label(reason: str) -> str:
    """The readable label of ``reason``, followed by its value (``KV blocks evicted
    (kv_evicted)``) so it can be searched and typed into SQL; an unknown value as it is."""
    label = REASON_LABELS.get(reason)
    return reason if label is None else f"{label} ({reason})"


_SCALES = {"form": FORM_COLORS, "outcome": OUTCOME_COLORS, "series": SERIES_COLORS}


def color(field: str, kind: str, present: Iterable[object] | None = None, *, title: str | None = None) -> alt.Color:
    """``field`` coloured by the fixed scale of ``kind`` (``form``, ``outcome`` or ``series``);
    the legend lists the values in ``present`` (default: all the scale knows), each keeping its
    colour; a value the scale does not know is appended in grey.

    Raises:
        KeyError: an unknown ``kind``.
    """
    colors = _SCALES[kind]
    wanted = list(colors) if present is None else list(dict.fromkeys(str(v) for v in present))
    domain = [v for v in colors if v in wanted] + [v for v in wanted if v not in colors]
    return alt.Color(
        f"{field}:N",
        scale=alt.Scale(domain=domain, range=[colors.get(v, "#bcbd22") for v in domain]),
        title=title if title is not None else field,
        legend=alt.Legend(labelLimit=400),
    )
