"""The agent's background jobs: ``cache_minute`` rollup, hourly Parquet export, retention, WAL
checkpoints and the NVML GPU sampler, on one APScheduler 3.x ``BackgroundScheduler``.

Jobs (each ``max_instances=1``, ``coalesce=True``; a failure is logged and counted in
``kvscope_maintenance_runs_total{job, status="error"}``, and the next run tries again):

* ``rollup`` every ``rollup_interval_seconds``: :func:`agent.ingest.fold_cache_minute`.
* ``export`` every hour, ``export_lag_seconds`` after the hour (or every
  ``maintenance_interval_seconds``): :func:`export_parquet` for every finished hour whose row
  count differs from what was exported (new hours, and hours that received late events), then
  — only if the export succeeded, so nothing is deleted before it was exported —
  :func:`apply_retention`.
* ``checkpoint`` every ``checkpoint_interval_seconds``: ``CHECKPOINT`` (folds the WAL into the
  file; acknowledged batches are durable in the WAL before that already).
* ``gpu`` every ``gpu_sample_seconds`` when NVML found a GPU (:class:`agent.gpu.GpuSampler`).

Parquet layout (Hive partitioning, readable with DuckDB's
``read_parquet('<dir>/cache_lookups/**/*.parquet', hive_partitioning = true)``)::

    <export_dir>/<table>/date=YYYY-MM-DD/form=<form>/<table>-YYYYMMDDTHH.parquet   (tables with a form)
    <export_dir>/<table>/date=YYYY-MM-DD/<table>-YYYYMMDDTHH.parquet               (requests, gpu_stats)

The partition column ``form`` is not repeated inside the files. Files are written through
pyarrow (the database itself has no file access) to a temporary name and renamed, so a reader
never sees half a file; re-exporting an hour replaces its files.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client import Counter

from agent.config import AgentConfig
from agent.gpu import GpuSampler
from agent.ingest import fold_cache_minute
from agent.metrics import AgentMetrics
from agent.store import Store, to_timestamp

log = logging.getLogger(__name__)

EXPORTED_TABLES: dict[str, bool] = {
    "cache_lookups": True,
    "requests": False,
    "engine_stats": True,
    "block_events": True,
    "gpu_stats": False,
}
"""Raw tables exported hourly and trimmed by retention → whether they are partitioned by form."""

HOUR = 3600


@dataclass(frozen=True, slots=True)
class ExportedHour:
    """One (table, hour) written: ``rows`` in ``files`` Parquet files."""

    table: str
    hour: datetime
    rows: int
    files: tuple[Path, ...]


def export_parquet(
    store: Store,
    export_dir: Path,
    *,
    now: float,
    lag_seconds: int = 60,
) -> list[ExportedHour]:
    """Write every finished hour (ended at least ``lag_seconds`` before ``now``, unix seconds)
    whose row count differs from its ``parquet_exports`` record; record each. Hours that
    retention emptied have no rows, so they are never written again.

    Raises:
        OSError: a file could not be written (hours written before it stay recorded).
        duckdb.Error: the store failed.
    """
    cutoff = to_timestamp((int(now - lag_seconds) // HOUR) * HOUR)
    done: list[ExportedHour] = []
    for table, by_form in EXPORTED_TABLES.items():
        with store.cursor() as cur:
            pending = cur.execute(
                f"""
                SELECT h.hour, h.n FROM (
                    SELECT date_trunc('hour', ts) AS hour, count(*) AS n FROM {table}
                    WHERE ts < $cutoff GROUP BY ALL
                ) h
                LEFT JOIN parquet_exports e ON e.table_name = $table AND e.hour = h.hour
                WHERE e.rows IS NULL OR e.rows <> h.n
                ORDER BY h.hour
                """,
                {"cutoff": cutoff, "table": table},
            ).fetchall()
        for hour, _ in pending:
            with store.cursor() as cur:
                fetched = cur.sql(
                    f"SELECT * FROM {table} WHERE ts >= $start AND ts < $end",
                    params={"start": hour, "end": hour + timedelta(hours=1)},
                ).to_arrow_table()
            if fetched is None:
                raise RuntimeError(f"DuckDB returned no result for the {table} hour {hour}")
            rows: pa.Table = fetched
            files = _write_hour(export_dir, table, hour, rows, by_form)
            with store.transaction() as cur:
                cur.execute(
                    "INSERT INTO parquet_exports VALUES ($table, $hour, $rows, $files, $at) "
                    "ON CONFLICT (table_name, hour) DO UPDATE SET rows = EXCLUDED.rows, "
                    "files = EXCLUDED.files, exported_at = EXCLUDED.exported_at",
                    {
                        "table": table,
                        "hour": hour,
                        "rows": rows.num_rows,
                        "files": len(files),
                        "at": to_timestamp(time.time()),
                    },
                )
            done.append(ExportedHour(table, hour, rows.num_rows, files))
    return done


def _write_hour(export_dir: Path, table: str, hour: datetime, rows: pa.Table, by_form: bool) -> tuple[Path, ...]:
    folder = export_dir / table / f"date={hour:%Y-%m-%d}"
    name = f"{table}-{hour:%Y%m%dT%H}.parquet"
    if not by_form:
        return (_write_file(folder / name, rows),)
    files = []
    for form in sorted(pc.unique(rows["form"]).to_pylist()):
        part = rows.filter(pc.equal(rows["form"], form)).drop_columns(["form"])
        files.append(_write_file(folder / f"form={form}" / name, part))
    return tuple(files)


def _write_file(path: Path, rows: pa.Table) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    pq.write_table(rows, temporary)
    os.replace(temporary, path)
    return path


def retention_cutoffs(
    now: float, raw_retention_hours: float | None, rollup_retention_days: float | None
) -> tuple[datetime | None, datetime | None]:
    """(raw cutoff, rollup cutoff) as naive UTC, raw aligned down to an hour so an hour is
    either whole or gone; ``None`` keeps everything."""
    raw = None
    if raw_retention_hours is not None:
        raw = to_timestamp((int(now - raw_retention_hours * HOUR) // HOUR) * HOUR)
    rollup = None if rollup_retention_days is None else to_timestamp(now - rollup_retention_days * 86400)
    return raw, rollup


def apply_retention(
    store: Store,
    *,
    now: float,
    raw_retention_hours: float | None,
    rollup_retention_days: float | None,
) -> dict[str, int]:
    """Delete raw rows older than the raw cutoff (by ``ts``) and ``cache_minute`` rows older than
    the rollup cutoff (by ``minute``), in one transaction. Returns rows deleted per table.
    ``ingest_batches`` is kept (it is what makes re-sent batches duplicates).

    Raises:
        duckdb.Error: the store failed; nothing was deleted.
    """
    raw, rollup = retention_cutoffs(now, raw_retention_hours, rollup_retention_days)
    deleted: dict[str, int] = {}
    with store.transaction() as cur:
        if raw is not None:
            for table in EXPORTED_TABLES:
                ((n,),) = cur.execute(f"DELETE FROM {table} WHERE ts < $cutoff", {"cutoff": raw}).fetchall()
                deleted[table] = int(n)
        if rollup is not None:
            ((n,),) = cur.execute("DELETE FROM cache_minute WHERE minute < $cutoff", {"cutoff": rollup}).fetchall()
            deleted["cache_minute"] = int(n)
    return deleted


class MaintenanceScheduler:
    """Runs the jobs of the module docstring for one agent.

    Args:
        store: the agent's store.
        config: intervals, retention, export settings.
        metrics: its registry gets ``kvscope_maintenance_runs_total`` and the GPU gauges.
        clock: unix seconds, injectable for tests.
    """

    def __init__(
        self,
        store: Store,
        config: AgentConfig,
        metrics: AgentMetrics,
        *,
        clock: Callable[[], float] = time.time,
        gpu: GpuSampler | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.runs = Counter(
            "kvscope_maintenance_runs_total",
            "Background job runs of the agent, by job (rollup, export, checkpoint, gpu) and status.",
            ("job", "status"),
            registry=metrics.registry,
        )
        self.gpu = gpu if gpu is not None else GpuSampler(store, metrics.registry)
        self._scheduler: BackgroundScheduler | None = None

    # -- the jobs (callable directly) ---------------------------------------------------------------
    def rollup(self) -> int:
        return fold_cache_minute(self.store)

    def export_and_retain(self) -> tuple[list[ExportedHour], dict[str, int]]:
        """Export (when enabled), then apply retention; retention is skipped if the export
        raised (the exception propagates)."""
        now = self.clock()
        exported: list[ExportedHour] = []
        if self.config.export_enabled:
            exported = export_parquet(
                self.store,
                self.config.parquet_dir,
                now=now,
                lag_seconds=self.config.export_lag_seconds,
            )
            for item in exported:
                log.info("exported %s %s: %d rows in %d files", item.table, item.hour, item.rows, len(item.files))
        deleted = apply_retention(
            self.store,
            now=now,
            raw_retention_hours=self.config.raw_retention_hours,
            rollup_retention_days=self.config.rollup_retention_days,
        )
        if any(deleted.values()):
            log.info("retention deleted %s", {k: v for k, v in deleted.items() if v})
        return exported, deleted

    def checkpoint(self) -> None:
        self.store.checkpoint()

    def sample_gpu(self) -> int:
        return self.gpu.sample(self.clock())

    # -- scheduling ---------------------------------------------------------------------------------
    def _counted(self, job: str, run: Callable[[], object]) -> Callable[[], None]:
        def wrapped() -> None:
            try:
                run()
            except Exception:
                self.runs.labels(job=job, status="error").inc()
                log.exception("maintenance job %s failed; it runs again at its next time", job)
            else:
                self.runs.labels(job=job, status="ok").inc()

        return wrapped

    def export_trigger(self) -> BaseTrigger:
        if self.config.maintenance_interval_seconds is not None:
            return IntervalTrigger(seconds=self.config.maintenance_interval_seconds, timezone=UTC)
        offset = self.config.export_lag_seconds % HOUR
        return CronTrigger(minute=offset // 60, second=offset % 60, timezone=UTC)

    def start(self) -> None:
        """Start the jobs in a background thread (the GPU job only when NVML found a GPU)."""
        if self._scheduler is not None:
            raise RuntimeError("the maintenance scheduler is already started")
        scheduler = BackgroundScheduler(timezone=UTC)
        jobs: list[tuple[str, Callable[[], object], BaseTrigger]] = [
            ("rollup", self.rollup, IntervalTrigger(seconds=self.config.rollup_interval_seconds, timezone=UTC)),
            ("export", self.export_and_retain, self.export_trigger()),
            ("checkpoint", self.checkpoint, IntervalTrigger(seconds=self.config.checkpoint_interval_seconds, timezone=UTC)),
        ]
        if self.config.gpu_sample_seconds is not None and self.gpu.start():
            jobs.append(("gpu", self.sample_gpu, IntervalTrigger(seconds=self.config.gpu_sample_seconds, timezone=UTC)))
        for job, run, trigger in jobs:
            scheduler.add_job(
                self._counted(job, run),
                trigger,
                id=f"kvscope-{job}",
                max_instances=1,
                coalesce=True,
                misfire_grace_time=60,
            )
        scheduler.start()
        self._scheduler = scheduler

    def shutdown(self) -> None:
        """Stop the jobs (waiting for a running one), then fold what is left into
        ``cache_minute`` once more. Idempotent."""
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is None:
            return
        scheduler.shutdown(wait=True)
        self.gpu.shutdown()
        self._counted("rollup", self.rollup)()
