"""Alert quality over a simulated day: detection latency and false pages of the shipped rules.

Two engines serve a diurnal load for 24 hours (requests per minute Poisson around a day curve,
prompt lengths log-normal, each request's recoverable share Beta-distributed around the engine's
healthy hit rate, so a quiet minute is noisier than a busy one). Engine ``e1`` suffers scripted
incidents (step drops, a near-total loss, a slow drift); ``e2`` stays healthy throughout, and
``e1`` also has two non-incidents (a 2-minute dip, a 6-minute traffic gap) that must not page.
The per-minute totals go through ``kvscope alerts test``'s harness (:mod:`alerts.golden`: the
agent's ingest, store, rollup and rule scheduler) with the shipped default rules, evaluated every
minute; side by side, in the same run and on the same minutes, a naive rule pages whenever one
minute's hit rate is below 0.6 (a per-batch gauge alert).

Reported: per incident, the first page (a firing alert of severity ``page``) for ``e1`` after it
began (``detection_minutes``; null if missed); ``false_pages`` (page firings that begin outside
every incident, from its start to 15 minutes after its end, or on ``e2``); the same two for the
naive rule; and the ratio of false pages. One JSON object on stdout; progress on stderr.

``python -m benchmarks.alert_detection [--seed N] [--hours H]``
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from alerts.golden import GOLDEN_START, GoldenSeries, SeriesFile, run_golden
from alerts.rulefile import DEFAULT_RULES_PATH, load_rule_file

MINUTE = 60.0
GRACE_MINUTES = 15
NAIVE_THRESHOLD = 0.6


@dataclass(frozen=True, slots=True)
class Incident:
    name: str
    start: int
    """Minute of the day it begins."""
    end: int
    """Minute it is over (the hit rate is healthy again)."""
    should_page: bool = True


def incidents() -> list[Incident]:
    return [
        Incident("night step drop 0.8 to 0.4 (low traffic)", 3 * 60, 3 * 60 + 25),
        Incident("2-minute dip to 0.4 (must not page)", 5 * 60, 5 * 60 + 2, should_page=False),
        Incident("6-minute traffic gap (must not page)", 7 * 60, 7 * 60 + 6, should_page=False),
        Incident("cache lost: hit rate 0.05 for 10 minutes", 10 * 60, 10 * 60 + 10),
        Incident("midday step drop 0.8 to 0.5", 14 * 60, 14 * 60 + 30),
        Incident("slow drift 0.8 to 0.2 over 2 hours, held 1 hour", 18 * 60, 21 * 60),
    ]


def healthy_rate(engine: str) -> float:
    return 0.8 if engine == "e1" else 0.75


def target_rate(engine: str, minute: int) -> float | None:
    """The engine's mean recoverable share at ``minute`` (None: it sends nothing)."""
    base = healthy_rate(engine)
    if engine != "e1":
        return base
    if 180 <= minute < 205:
        return 0.4
    if 300 <= minute < 302:
        return 0.4
    if 420 <= minute < 426:
        return None
    if 600 <= minute < 610:
        return 0.05
    if 840 <= minute < 870:
        return 0.5
    if 1080 <= minute < 1200:
        return base - (base - 0.2) * (minute - 1080) / 120
    if 1200 <= minute < 1260:
        return 0.2
    return base


def simulate(minutes: int, rng: np.random.Generator) -> dict[str, tuple[list[float | None], list[float | None]]]:
    """Per engine: per-minute prompt and recoverable token totals."""
    out = {}
    for engine in ("e1", "e2"):
        prompts: list[float | None] = []
        recoverable: list[float | None] = []
        for m in range(minutes):
            mean = target_rate(engine, m)
            day = 0.5 - 0.5 * math.cos(2 * math.pi * ((m / 60 - 4) % 24) / 24)  # trough at 04:00
            n = int(rng.poisson(8 + 110 * day))
            if mean is None or n == 0:
                prompts.append(None)
                recoverable.append(None)
                continue
            lengths = np.maximum(rng.lognormal(math.log(1500), 0.8, n).astype(int), 16)
            k = 8.0  # Beta concentration: per-request shares vary widely
            share = rng.beta(max(mean * k, 1e-3), max((1 - mean) * k, 1e-3), n)
            prompts.append(float(lengths.sum()))
            recoverable.append(float(np.floor(lengths * share).sum()))
        out[engine] = (prompts, recoverable)
    return out


def naive_pages(series: dict[str, tuple[list[float | None], list[float | None]]]) -> list[tuple[str, int]]:
    """(engine, minute) of each page the naive rule sends: it fires when a minute's hit rate is
    below the threshold (with no history, volume guard or hysteresis) and resolves on the next
    minute above it."""
    pages = []
    for engine, (prompts, recs) in series.items():
        firing = False
        for m, (p, r) in enumerate(zip(prompts, recs, strict=True)):
            if p is None or r is None:
                continue
            low = r / p < NAIVE_THRESHOLD
            if low and not firing:
                pages.append((engine, m + 1))  # seen by the evaluation at the end of the minute
            firing = low
    return pages


def score(pages: list[tuple[str, int]], events: list[Incident]) -> tuple[dict[str, int | None], int]:
    detection: dict[str, int | None] = {}
    explained = set()
    for incident in events:
        hits = [m for engine, m in pages if engine == "e1" and incident.start < m <= incident.end + GRACE_MINUTES]
        if incident.should_page:
            detection[incident.name] = (min(hits) - incident.start) if hits else None
            explained.update(("e1", m) for m in hits)
    false = [p for p in pages if p not in explained]
    return detection, len(false)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--hours", type=float, default=24.0)
    args = parser.parse_args(argv)
    logging.getLogger("alerts.rule_scheduler").setLevel(logging.ERROR)
    minutes = int(args.hours * 60)
    rng = np.random.default_rng(args.seed)
    series = simulate(minutes, rng)
    spec = SeriesFile(
        source="<simulated day>",
        interval=MINUTE,
        duration=minutes * MINUTE,
        lag=5,
        series=tuple(
            GoldenSeries(
                kind="requests",
                labels={"engine": engine, "model": "m1"},
                step=MINUTE,
                values={"prompt_tokens": prompts, "recoverable_tokens": recs},
            )
            for engine, (prompts, recs) in series.items()
        ),
    )
    print(f"evaluating {minutes} minutes of two engines with the default rules ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    result = run_golden(load_rule_file(DEFAULT_RULES_PATH), spec)
    elapsed = time.perf_counter() - started
    events = [e for e in incidents() if e.start < minutes]
    pages = [
        (n.labels.get("engine", ""), int((n.at - GOLDEN_START) // MINUTE))  # the minute of the evaluation
        for n in result.notifications
        if n.status.value == "firing" and n.labels.get("severity") == "page"
    ]
    detection, false_pages = score(pages, events)
    naive = naive_pages(series)
    naive_detection, naive_false = score(naive, events)
    doc = {
        "benchmark": "alert_detection",
        "seed": args.seed,
        "simulated_minutes": minutes,
        "evaluations_per_group": minutes,
        "incidents": [{"name": e.name, "start_minute": e.start, "end_minute": e.end, "should_page": e.should_page} for e in events],
        "default_rules": {
            "detection_minutes": detection,
            "missed": sum(1 for v in detection.values() if v is None),
            "pages": len(pages),
            "false_pages": false_pages,
            "notifications": len(result.notifications),
            "by_alert": _by_alert(result.notifications),
        },
        "naive_one_minute_threshold": {
            "threshold": NAIVE_THRESHOLD,
            "detection_minutes": naive_detection,
            "missed": sum(1 for v in naive_detection.values() if v is None),
            "pages": len(naive),
            "false_pages": naive_false,
        },
        "false_page_ratio_default_over_naive": (false_pages / naive_false) if naive_false else None,
        "wall_seconds": round(elapsed, 1),
    }
    print(json.dumps(doc))


def _by_alert(notes: list) -> dict[str, int]:  # type: ignore[type-arg]
    counts: dict[str, int] = {}
    for n in notes:
        key = f"{n.alert}:{n.status.value}"
        counts[key] = counts.get(key, 0) + 1
    return counts


if __name__ == "__main__":
    main()
