"""``kvscope alerts export-prometheus``: a rule file's built-in rules as Prometheus alerting rules
over the agent's own metrics (``/metrics``), for teams that already run Prometheus.

Each kind becomes PromQL over the agent's counters and histograms (rates over the same windows):

* ``recoverable_hit_rate_drop`` — ``rate(kvscope_recoverable_tokens_total)`` over
  ``rate(kvscope_prompt_tokens_total)`` per (engine, model) now, against the same ratio over the
  baseline window ending where the current one starts (``offset``) or a day earlier; both the
  relative and the absolute fire thresholds and the minimum volume (``increase`` of prompt tokens
  in each window) must hold. Prometheus has no hysteresis: the clear thresholds are not exported
  (``keep_firing_for`` is).
* ``recoverable_hit_rate_below`` — one rule per burn window (label ``window``, the window's
  severity): the burn rate ``(1 − recoverable/prompt) / (1 − objective)`` over the short and the
  long window, both above ``burn_rate``.
* ``form_invalidation_spike`` — ``rate(kvscope_invalidations_total)`` per (engine, form, reason)
  over ``rate(kvscope_cache_lookups_total)`` per (engine, form), at least the baseline share plus
  ``min_share_increase``.

Each expression's value is what kvscope's evaluator reports for the kind (the current hit rate,
the short window's burn rate, the reason's share, the quantile), so the annotations' ``$value``
reads the same — except for the two silence kinds, whose PromQL value is the increase (0), not
seconds of silence.
* ``recovery_latency_high`` — ``histogram_quantile`` over ``kvscope_recovery_seconds_bucket``.
* ``tp_rank_disagreement`` — ``increase(kvscope_tp_disagreements_total)`` per (engine, form,
  tp_rank) over the window, at least ``min_disagreements`` (the same count kvscope reports).
* ``indexer_sync_delay`` — the ``indexer_state`` lookups of the window above ``threshold_tokens``
  per (engine, model, layer_group): ``increase`` of ``kvscope_indexer_sync_delay_tokens_count``
  minus that of its ``le`` bucket at the threshold, above 0 — the same series fire, but the
  PromQL value is that count of lookups, not kvscope's largest delay in tokens.
* ``ingest_stalled`` / ``engine_silent`` — no stored batch, or no finished request of an engine,
  within ``silent_for`` (``increase(...) == 0``).

``expr`` rules (SQL or named queries over the agent's tables; not a kind evaluated by its named
query) have no PromQL equivalent and are left out, each named in a comment at the top. Every exported file passes ``promtool check rules``.
"""

from __future__ import annotations

import yaml

from alerts.rulefile import (
    HitRateBelow,
    HitRateDrop,
    IndexerSyncDelay,
    InvalidationSpike,
    RankDisagreement,
    RecoveryLatencyHigh,
    Rule,
    RuleFile,
    SilentFor,
)

DAY = 86_400


def duration(seconds: float) -> str:
    """Seconds as a Prometheus duration (``1h30m``, ``500ms``)."""
    if seconds <= 0:
        return "0s"
    millis = round(seconds * 1000)
    out = ""
    for unit, size in (("d", DAY * 1000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        if millis >= size:
            out += f"{millis // size}{unit}"
            millis %= size
    return out


def _ratio(window: str, offset: str = "") -> str:
    off = f" offset {offset}" if offset else ""
    return (
        f"sum by (engine, model) (rate(kvscope_recoverable_tokens_total[{window}]{off}))"
        f" / sum by (engine, model) (rate(kvscope_prompt_tokens_total[{window}]{off}))"
    )


def _volume(window: str, minimum: int, offset: str = "") -> str:
    off = f" offset {offset}" if offset else ""
    return f"sum by (engine, model) (increase(kvscope_prompt_tokens_total[{window}]{off})) >= {minimum}"


def expressions(rule: Rule) -> list[tuple[dict[str, str], str]]:
    """The PromQL of a built-in rule: (extra labels, expression) per exported rule; empty for an
    expr rule."""
    s = rule.settings
    if isinstance(s, HitRateDrop):
        window = duration(s.window)
        if s.baseline == "trailing":
            base_window, offset = duration(s.baseline_window), window
        else:
            base_window, offset = window, "1d"
        current, baseline = f"({_ratio(window)})", f"({_ratio(base_window, offset)})"
        expr = (
            f"{current} < {baseline} * {1 - s.fire_relative_drop:g}"
            f"\nand {baseline} - {current} >= {s.fire_absolute_drop:g}"
            f"\nand ({_volume(window, s.min_prompt_tokens)})"
            f"\nand ({_volume(base_window, s.min_prompt_tokens, offset)})"
        )
        return [({}, expr)]
    if isinstance(s, HitRateBelow):
        out = []
        for w in s.windows:
            budget = 1 - s.objective
            long, short = duration(w.long), duration(w.short)
            # the short window first: its burn rate is the alert's value, as in kvscope
            expr = (
                f"(1 - ({_ratio(short)})) / {budget:g} > {w.burn_rate:g}"
                f"\nand (1 - ({_ratio(long)})) / {budget:g} > {w.burn_rate:g}"
                f"\nand ({_volume(short, s.min_prompt_tokens)})"
                f"\nand ({_volume(duration(w.long - w.short), s.min_prompt_tokens, short)})"
            )
            out.append(({"window": w.label, "severity": w.severity}, expr))
        return out
    if isinstance(s, InvalidationSpike):
        window, base = duration(s.window), duration(s.baseline_window)

        def share(w: str, offset: str = "") -> str:
            off = f" offset {offset}" if offset else ""
            return (
                f"(sum by (engine, form, reason) (rate(kvscope_invalidations_total[{w}]{off}))"
                f" / on (engine, form) group_left"
                f" sum by (engine, form) (rate(kvscope_cache_lookups_total[{w}]{off})))"
            )

        expr = (
            f"{share(window)} >= {share(base, window)} + {s.min_share_increase:g}"
            f"\nand on (engine, form) sum by (engine, form) (increase(kvscope_cache_lookups_total[{window}])) >= {s.min_lookups}"
        )
        return [({}, expr)]
    if isinstance(s, RankDisagreement):
        window = duration(s.window)
        return [({}, f'sum by (engine, form, tp_rank) (increase(kvscope_tp_disagreements_total[{window}])) >= {s.min_disagreements}')]
    if isinstance(s, IndexerSyncDelay):
        window, by = duration(s.window), "sum by (engine, model, layer_group)"
        le = repr(float(s.threshold_tokens))  # the exposition's le label of that bound
        expr = (
            f"{by} (increase(kvscope_indexer_sync_delay_tokens_count[{window}]))"
            f'\n- {by} (increase(kvscope_indexer_sync_delay_tokens_bucket{{le="{le}"}}[{window}])) > 0'
        )
        return [({}, expr)]
    if isinstance(s, RecoveryLatencyHigh):
        window = duration(s.window)
        expr = (
            f"histogram_quantile({s.quantile:g}, sum by (engine, form, tier, le)"
            f" (rate(kvscope_recovery_seconds_bucket[{window}]))) > {s.threshold:g}"
            f"\nand on (engine, form, tier) sum by (engine, form, tier)"
            f" (increase(kvscope_recovery_seconds_count[{window}])) >= {s.min_recoveries}"
        )
        return [({}, expr)]
    if isinstance(s, SilentFor):
        window = duration(s.silent_for)
        if rule.kind == "ingest_stalled":
            return [({}, f'sum(increase(kvscope_ingest_batches_total{{status="stored"}}[{window}])) == 0')]
        return [({}, f"sum by (engine) (increase(kvscope_requests_total[{window}])) == 0")]
    return []


def export_prometheus(rules: RuleFile, dashboard_url: str = "") -> str:
    """The Prometheus rule file (YAML text) equivalent to ``rules``' built-in rules, with
    ``{{ $dashboardURL }}`` bound to ``dashboard_url`` (Prometheus has no such variable; empty:
    the links are relative)."""
    rules = rules.with_dashboard_url(dashboard_url)
    skipped = [rule.alert for rule in rules.rules if rule.kind is None]
    groups = []
    for group in rules.groups:
        exported = []
        for rule in group.rules:
            for extra, expr in expressions(rule):
                entry: dict[str, object] = {"alert": rule.alert, "expr": expr}
                if rule.for_seconds:
                    entry["for"] = duration(rule.for_seconds)
                if rule.keep_firing_for_seconds:
                    entry["keep_firing_for"] = duration(rule.keep_firing_for_seconds)
                entry["labels"] = {**rule.labels, **extra}
                if rule.annotations:
                    entry["annotations"] = dict(rule.annotations)  # our templates are Prometheus's (urlquery too)
                exported.append(entry)
        if exported:
            body: dict[str, object] = {"name": group.name}
            if group.interval_seconds is not None:
                body["interval"] = duration(group.interval_seconds)
            body["rules"] = exported
            groups.append(body)
    header = f"# Generated by kvscope alerts export-prometheus from {rules.source}\n"
    if skipped:
        header += f"# Left out (SQL expr rules have no PromQL equivalent): {', '.join(skipped)}\n"
    return header + yaml.safe_dump({"groups": groups}, sort_keys=False, width=1000)
