"""The agent's background jobs: ``cache_minute`` rollup, hourly Parquet export, retention, WAL
checkpoints and the NVML GPU sampler, on one APScheduler 3.x ``BackgroundScheduler``.

Jobs (each ``max_instances=1``, ``coalesce=True``; a failure is logged and counted in
``kvscope_maintenance_runs_total{job, status="error"}``, and the next run tries again):

* ``rollup`` every ``rollup_interval_seconds``: :func:`agent.rollups.fold_cache_minute` and
  :func:`agent.rollups.fold_form_usable_minute`, then the
  ``kvscope_recoverable_hit_ratio`` gauge from the last minute (:func:`recent_hit_sums`).
* ``export`` every hour, ``export_lag_seconds`` after the hour (or every
  ``maintenance_interval_seconds``): :func:`export_parquet` writes the rows of finished hours
  stored since their last export (a late event adds a part, never rewrites one), then — only if
  the export succeeded — :func:`apply_retention`, which deletes only rows already exported (and,
  for lookups and requests, folded into the rollups).
* ``checkpoint`` every ``checkpoint_interval_seconds``: ``CHECKPOINT`` (folds the WAL into the
  file; acknowledged batches are durable in the WAL before that already).
* ``gpu`` every ``gpu_sample_seconds`` when NVML found a GPU (:class:`agent.gpu.GpuSampler`).

Parquet layout (Hive partitioning, readable with DuckDB's
``read_parquet('<dir>/cache_lookups/**/*.parquet', hive_partitioning = true, union_by_name = true)``)::

    <export_dir>/<table>/date=YYYY-MM-DD/form=<form>/<table>-YYYYMMDDTHH-<part>.parquet   (tables with a form)
    <export_dir>/<table>/date=YYYY-MM-DD/<table>-YYYYMMDDTHH-<part>.parquet               (requests, gpu_stats)

The partition column ``form`` is not repeated inside the files. Files are written through
pyarrow (the database itself has no file access) to a temporary name, fsynced and renamed (the
folders fsynced too) before the part is recorded, so a reader never sees half a file and
retention never deletes rows whose file could still be lost. A part is rewritten only when the
agent stopped between writing it and recording it; it is then written again with the same rows
plus any newer ones.
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

from agent.arrow_utc import utc_adjusted
from agent.config import AgentConfig
from agent.gpu import GpuSampler
from agent.metrics import AgentMetrics
from agent.rollups import fold_cache_minute, fold_form_usable_minute
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


STAMP_COLUMN: dict[str, str] = {table: "ingested_at" for table in EXPORTED_TABLES} | {"gpu_stats": "ts"}
"""The column that orders a table's rows by when they were stored (the GPU sampler writes
``gpu_stats`` with ``ts`` = now)."""


@dataclass(frozen=True, slots=True)
class ExportedPart:
    """One part of one (table, hour) written: ``rows`` in ``files`` Parquet files (one per form
    for tables partitioned by form)."""

    table: str
    hour: datetime
    part: int
    rows: int
    files: tuple[Path, ...]


def export_parquet(store: Store, export_dir: Path, *, now: float, lag_seconds: int = 60) -> list[ExportedPart]:
    """Write the rows of every finished hour (ended at least ``lag_seconds`` before ``now``, unix
    seconds) stored since that hour was last exported, as a new part; record it in
    ``parquet_exports``. Never rewrites a file: the first export of an hour is part 0, rows that
    arrive later (late events) go to part 1, 2, ... — so the archive keeps every row even after
    retention deleted the hour from the database.

    Which rows are new is decided by the table's stamp (``ingested_at``): the ingest flusher
    stamps flushes in increasing order and commits them one after the other, so in one snapshot
    every row stamped up to the newest visible stamp ``W`` is visible; rows above ``W`` are left
    for the next run. ``exported_through`` records the stamp reached per hour.

    Raises:
        OSError: a file could not be written (parts written before it stay recorded).
        duckdb.Error: the store failed.
    """
    cutoff = to_timestamp((int(now - lag_seconds) // HOUR) * HOUR)
    done: list[ExportedPart] = []
    for table, by_form in EXPORTED_TABLES.items():
        stamp = STAMP_COLUMN[table]
        with store.cursor() as cur:
            cur.execute("BEGIN TRANSACTION READ ONLY")
            try:
                ((high,),) = cur.execute(f"SELECT max({stamp}) FROM {table}").fetchall()
                if high is None:
                    continue
                pending = cur.execute(
                    f"""
                    SELECT date_trunc('hour', t.ts) AS hour, any_value(e.exported_through),
                           any_value(e.parts), any_value(e.rows)
                    FROM {table} t
                    LEFT JOIN parquet_exports e
                        ON e.table_name = $table AND e.hour = date_trunc('hour', t.ts)
                    WHERE t.ts < $cutoff AND t.{stamp} <= $high
                      AND (e.exported_through IS NULL OR t.{stamp} > e.exported_through)
                    GROUP BY 1 ORDER BY 1
                    """,
                    {"table": table, "cutoff": cutoff, "high": high},
                ).fetchall()
                for hour, through, parts, exported_rows in pending:
                    fetched = cur.sql(
                        f"SELECT * FROM {table} WHERE ts >= $start AND ts < $end AND {stamp} <= $high "
                        f"AND ($through::TIMESTAMP IS NULL OR {stamp} > $through) ORDER BY {stamp}",
                        params={"start": hour, "end": hour + timedelta(hours=1), "high": high, "through": through},
                    ).to_arrow_table()
                    if fetched is None:
                        raise RuntimeError(f"DuckDB returned no result for the {table} hour {hour}")
                    rows: pa.Table = fetched
                    part = int(parts or 0)
                    files = _write_part(export_dir, table, hour, part, rows, by_form)
                    reached = pc.max(rows[stamp]).as_py()
                    with store.transaction() as writer:
                        writer.execute(
                            "INSERT INTO parquet_exports VALUES ($table, $hour, $rows, $parts, $through, $at) "
                            "ON CONFLICT (table_name, hour) DO UPDATE SET rows = EXCLUDED.rows, "
                            "parts = EXCLUDED.parts, exported_through = EXCLUDED.exported_through, "
                            "exported_at = EXCLUDED.exported_at",
                            {
                                "table": table,
                                "hour": hour,
                                "rows": int(exported_rows or 0) + rows.num_rows,
                                "parts": part + 1,
                                "through": reached,
                                "at": to_timestamp(time.time()),
                            },
                        )
                    done.append(ExportedPart(table, hour, part, rows.num_rows, files))
            finally:
                cur.execute("ROLLBACK")
    return done


def _write_part(
    export_dir: Path, table: str, hour: datetime, part: int, rows: pa.Table, by_form: bool
) -> tuple[Path, ...]:
    folder = export_dir / table / f"date={hour:%Y-%m-%d}"
    name = f"{table}-{hour:%Y%m%dT%H}-{part}.parquet"
    if not by_form:
        return (_write_file(folder / name, rows),)
    files = []
    for form in sorted(pc.unique(rows["form"]).to_pylist()):
        chunk = rows.filter(pc.equal(rows["form"], form)).drop_columns(["form"])
        files.append(_write_file(folder / f"form={form}" / name, chunk))
    return tuple(files)


def _write_file(path: Path, rows: pa.Table) -> Path:
    """Write ``rows`` durably: to a temporary name, fsynced, renamed, and the folders fsynced,
    so once the part is recorded (and retention may delete its rows) it survives a power loss."""
    created = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    pq.write_table(utc_adjusted(rows), temporary)  # timestamps: isAdjustedToUTC = true
    with open(temporary, "rb") as written:
        os.fsync(written.fileno())
    os.replace(temporary, path)
    for folder in (path.parent, *(p.parent for p in created)):
        _fsync_directory(folder)
    return path


def _fsync_directory(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def retention_cutoffs(
    now: float, raw_retention_hours: float | None, rollup_retention_days: float | None
) -> tuple[datetime | None, datetime | None]:
    """(raw cutoff, rollup cutoff) as naive UTC, raw aligned down to an hour; ``None`` keeps
    everything."""
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
    exported_only: bool = True,
) -> dict[str, int]:
    """Delete raw rows older than the raw cutoff (by ``ts``) and rollup rows (``cache_minute``,
    ``form_usable_minute``) older than
    the rollup cutoff (by ``minute``), in one transaction. Returns rows deleted per table.

    A raw row is deleted only once it is safe: with ``exported_only``, only if its hour's export
    reached its stamp (so an hour never exported, or rows that arrived since, wait for the next
    export); and a ``cache_lookups`` or ``requests`` row only once the rollups folded it. ``ingest_batches``
    is kept (it is what makes re-sent batches duplicates).

    Raises:
        duckdb.Error: the store failed; nothing was deleted.
    """
    raw, rollup = retention_cutoffs(now, raw_retention_hours, rollup_retention_days)
    deleted: dict[str, int] = {}
    with store.transaction() as cur:
        if raw is not None:
            for table in EXPORTED_TABLES:
                stamp = STAMP_COLUMN[table]
                conditions = ["ts < $cutoff"]
                if exported_only:
                    conditions.append(
                        f"{stamp} <= coalesce((SELECT e.exported_through FROM parquet_exports e "
                        f"WHERE e.table_name = '{table}' AND e.hour = date_trunc('hour', {table}.ts)), "
                        "TIMESTAMP '0001-01-01')"
                    )
                for rollup_name in FOLDED_INTO.get(table, ()):
                    conditions.append(
                        "ingested_at <= coalesce((SELECT w.ingested_at FROM rollup_watermarks w "
                        f"WHERE w.name = '{rollup_name}'), TIMESTAMP '0001-01-01')"
                    )
                ((n,),) = cur.execute(
                    f"DELETE FROM {table} WHERE {' AND '.join(conditions)}", {"cutoff": raw}
                ).fetchall()
                deleted[table] = int(n)
        if rollup is not None:
            for rollup_table in ROLLUP_TABLES:
                ((n,),) = cur.execute(f"DELETE FROM {rollup_table} WHERE minute < $cutoff", {"cutoff": rollup}).fetchall()
                deleted[rollup_table] = int(n)
    return deleted


ROLLUP_TABLES = ("cache_minute", "form_usable_minute")
"""The per-minute rollups, kept ``rollup_retention_days``."""
FOLDED_INTO = {"cache_lookups": ROLLUP_TABLES, "requests": ("form_usable_minute",)}
"""Raw tables whose rows retention deletes only once these rollups have folded them."""

HIT_RATIO_WINDOW_SECONDS = 60.0
HIT_RATIO_LAG_SECONDS = 5.0


def recent_hit_sums(store: Store, *, now: float) -> dict[tuple[str, str], tuple[float, float]]:
    """Per (engine, model): (Σ recoverable, Σ prompt tokens) of the requests with ``ts`` in the
    minute ending :data:`HIT_RATIO_LAG_SECONDS` before ``now`` (late events allowed for); a
    series without prompt tokens there is left out (no data, not 0). Sums, not ratios, so the
    metrics can merge series the label cap folds into ``other``."""
    end = now - HIT_RATIO_LAG_SECONDS
    with store.cursor() as cur:
        rows = cur.execute(
            """
            SELECT engine_id, model, sum(recoverable_tokens)::DOUBLE, sum(prompt_tokens)::DOUBLE
            FROM requests WHERE ts >= $start AND ts < $end
            GROUP BY ALL HAVING sum(prompt_tokens) > 0
            """,
            {"start": to_timestamp(end - HIT_RATIO_WINDOW_SECONDS), "end": to_timestamp(end)},
        ).fetchall()
    return {(engine, model): (float(recoverable), float(prompt)) for engine, model, recoverable, prompt in rows}


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
        checkpoint: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self._checkpoint = checkpoint if checkpoint is not None else store.checkpoint
        self.config = config
        self.clock = clock
        self.runs = Counter(
            "kvscope_maintenance_runs_total",
            "Background job runs of the agent, by job (rollup, export, checkpoint, gpu) and status.",
            ("job", "status"),
            registry=metrics.registry,
        )
        self.metrics = metrics
        self.gpu = gpu if gpu is not None else GpuSampler(store, metrics.registry)
        self._scheduler: BackgroundScheduler | None = None

    # -- the jobs (callable directly) ---------------------------------------------------------------
    def rollup(self) -> int:
        folded = fold_cache_minute(self.store)
        fold_form_usable_minute(self.store)
        self.metrics.set_recoverable_hit_ratios(recent_hit_sums(self.store, now=self.clock()))
        return folded

    def export_and_retain(self) -> tuple[list[ExportedPart], dict[str, int]]:
        """Export (when enabled), then apply retention (deleting only exported, folded rows);
        retention is skipped if the export raised (the exception propagates)."""
        now = self.clock()
        exported: list[ExportedPart] = []
        if self.config.export_enabled:
            exported = export_parquet(
                self.store,
                self.config.parquet_dir,
                now=now,
                lag_seconds=self.config.export_lag_seconds,
            )
            for item in exported:
                log.info("exported %s %s part %d: %d rows in %d files", item.table, item.hour, item.part, item.rows, len(item.files))
        deleted = apply_retention(
            self.store,
            now=now,
            raw_retention_hours=self.config.raw_retention_hours,
            rollup_retention_days=self.config.rollup_retention_days,
            exported_only=self.config.export_enabled,
        )
        if any(deleted.values()):
            log.info("retention deleted %s", {k: v for k, v in deleted.items() if v})
        return exported, deleted

    def checkpoint(self) -> None:
        self._checkpoint()

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

    def start(self, *, parent_pid: int | None = None, on_parent_exit: Callable[[], None] | None = None) -> None:
        """Start the jobs in a background thread (the GPU job only when NVML found a GPU).

        With ``parent_pid`` and ``on_parent_exit``, a job (not counted in the runs metric) checks
        every second whether this process's parent is still ``parent_pid`` — read by the caller as
        early as it can, so a parent killed during start-up is noticed too — and calls it once
        when not (this process was re-parented): an agent started by ``kvscope up`` does not
        outlive an ``up`` that was killed and keep the DuckDB lock.
        """
        if self._scheduler is not None:
            raise RuntimeError("the maintenance scheduler is already started")
        scheduler = BackgroundScheduler(timezone=UTC)
        jobs: list[tuple[str, Callable[[], object], BaseTrigger]] = [
            ("rollup", self.rollup, IntervalTrigger(seconds=self.config.rollup_interval_seconds, timezone=UTC)),
            ("export", self.export_and_retain, self.export_trigger()),
            ("checkpoint", self.checkpoint, IntervalTrigger(seconds=self.config.checkpoint_interval_seconds, timezone=UTC)),
        ]
        if parent_pid is not None and on_parent_exit is not None:
            scheduler.add_job(
                _parent_watch(parent_pid, on_parent_exit),
                IntervalTrigger(seconds=1, timezone=UTC),
                id="kvscope-parent",
                name="kvscope parent watch",
                max_instances=1,
                coalesce=True,
            )
        if self.config.gpu_sample_seconds is not None and self.gpu.start():
            jobs.append(("gpu", self.sample_gpu, IntervalTrigger(seconds=self.config.gpu_sample_seconds, timezone=UTC)))
        for job, run, trigger in jobs:
            scheduler.add_job(
                self._counted(job, run),
                trigger,
                id=f"kvscope-{job}",
                name=f"kvscope {job} job",
                max_instances=1,
                coalesce=True,
                misfire_grace_time=60,
            )
        scheduler.start()
        self._scheduler = scheduler

    def shutdown(self) -> None:
        """Stop the jobs (waiting for a running one), then fold what is left into
        the rollups once more. Idempotent."""
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is None:
            return
        scheduler.shutdown(wait=True)
        self.gpu.shutdown()
        self._counted("rollup", self.rollup)()


def _parent_watch(parent: int, on_exit: Callable[[], None]) -> Callable[[], None]:
    """A job calling ``on_exit`` once, after this process's parent is no longer ``parent``."""
    fired = False

    def check() -> None:
        nonlocal fired
        if not fired and os.getppid() != parent:
            fired = True
            log.warning("the parent process %d exited; stopping", parent)
            on_exit()

    return check
