"""Where the agent's ingest time goes: ``kvscope_ingest_stage_seconds_total{stage}``, the
seconds spent per stage of storing batches (a counter; ``rate()`` of it over
``rate(kvscope_ingest_batches_total)`` is the cost per batch, what ``benchmarks/ingest_load.py``
prints as its split):

* ``decode`` — reading the body (msgspec for JSON/msgpack, the IPC streams for Arrow), in a
  decode worker;
* ``check`` — the contract's checks and building the store's tables, in a decode worker;
* ``insert`` — the flush's ``INSERT ... SELECT`` statements and bookkeeping rows;
* ``commit`` — DuckDB's ``COMMIT`` (the WAL written and synced);
* ``summary`` — the flush's grouped aggregation for the event metrics and adding it to them.

And ``kvscope_ingest_flush_batches``, a histogram of the batches each flush (one transaction)
stored together: group commit at work (:mod:`agent.pipeline`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

STAGES = ("decode", "check", "insert", "commit", "summary")


class IngestStages:
    """The stage counter on ``registry``; every stage is exposed from the start (at 0)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Counter(
            "kvscope_ingest_stage_seconds",
            "Seconds spent storing event batches, by stage (decode, check, insert, commit, summary).",
            ("stage",),
            registry=registry,
        )
        for stage in STAGES:
            self.seconds.labels(stage=stage)
        self.flush_batches = Histogram(
            "kvscope_ingest_flush_batches",
            "Batches one ingest flush (one transaction) stored together.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=registry,
        )

    def add(self, stage: str, seconds: float) -> None:
        """Add ``seconds`` (≥ 0) to ``stage`` (one of :data:`STAGES`)."""
        self.seconds.labels(stage=stage).inc(max(seconds, 0.0))
