"""``kvscope_engine_run_info{engine, run_id} 1``: which run of each engine sent its latest batch.

An engine keeps its id across restarts (``--engine-id``, :mod:`engine.identity`); each process
start is a new **run**, named by the ``run_id`` on its batches (``EventBatch.run_id``). This is
an *info metric*, as Prometheus's ``*_build_info`` series are: value always 1, the run id a
label of this one series only — never of a counter or histogram, which would start new series
at every restart (the churn a stable engine id avoids). Join it where a panel needs the run::

    kvscope_requests_total * on (engine) group_left (run_id) kvscope_engine_run_info

One series per engine: the run of the highest seq stored from it (seqs continue across runs,
:mod:`engine.run_seq`, so a late re-send of an earlier run's batch does not move it back); a new
run replaces the series, so they do not accumulate. The ``engine`` label passes the agent's label
cap (:mod:`agent.label_cap`): a folded engine has no series, an evicted one loses it. Absent for
engines whose batches carry no run id (older engines), and after an agent restart until each
engine's next batch (the store keeps every run: ``ingest_batches.run_id``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.ingest import IngestOutcome
from agent.label_cap import FOLDED_VALUE, LabelCap

NAME = "kvscope_engine_run_info"


class EngineRunInfo(Collector):
    """The ``kvscope_engine_run_info`` series (thread-safe). Registers itself on ``registry``;
    engine ids pass ``cap`` (its ``engine`` label)."""

    def __init__(self, cap: LabelCap, registry: CollectorRegistry) -> None:
        self._cap = cap
        self._lock = threading.Lock()
        self._runs: dict[str, tuple[int, str]] = {}
        """Engine id → (highest seq stored with a run id, that batch's run id)."""
        registry.register(self)

    def observe(self, outcome: IngestOutcome) -> None:
        """Note a committed batch: a stored one with a run id and a seq above the engine's
        highest so far makes its run the engine's latest."""
        if outcome.status != "stored" or outcome.run_id is None:
            return
        if self._cap.fold("engine", outcome.engine_id) == FOLDED_VALUE:
            return
        with self._lock:
            current = self._runs.get(outcome.engine_id)
            if current is None or outcome.seq >= current[0]:
                self._runs[outcome.engine_id] = (outcome.seq, outcome.run_id)

    def latest(self, engine_id: str) -> str | None:
        """The run id of ``engine_id``'s latest run, None when none is known."""
        with self._lock:
            current = self._runs.get(engine_id)
        return None if current is None else current[1]

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            NAME,
            "1 for each engine's latest run (process start): the run_id of its batch of highest seq. "
            "Join on engine to label other series with the run; never a label of them.",
            labels=("engine", "run_id"),
        )
        kept = self._cap.kept("engine")
        with self._lock:
            for engine_id in [e for e in self._runs if e not in kept]:  # evicted by the label cap
                del self._runs[engine_id]
            rows = sorted((engine_id, run_id) for engine_id, (_, run_id) in self._runs.items())
        for engine_id, run_id in rows:
            family.add_metric([engine_id, run_id], 1.0)
        yield family

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(NAME, "", labels=("engine", "run_id"))
