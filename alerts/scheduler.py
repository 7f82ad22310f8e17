"""The minute alert job: query the store, evaluate, persist, notify.

:class:`AlertScheduler` runs :meth:`AlertScheduler.run_once` on an APScheduler 3.x
``BackgroundScheduler``: at every minute boundary plus the ingest lag (``CronTrigger(second=lag)``
in UTC), or every ``interval_seconds`` when that override is set (tests, demos). One run:

1. for each rule, sum recoverable and prompt tokens per (engine, model) over the window
   ``[now - lag - window, now - lag)`` on the events' ``ts`` (read on its own cursor);
2. :func:`alerts.evaluator.evaluate` with the state kept in memory;
3. persist every transition into the ``alerts`` table (one transaction), then keep the new state;
4. append each notification as one JSON line to the alert log file (the log receiver);
5. set ``kvscope_recoverable_hit_ratio`` from the last minute ``[now - lag - 60, now - lag)``.

:meth:`AlertScheduler.start` first restores the state from the ``alerts`` table (the latest
transition of each fingerprint), so a restart neither re-pages a firing alert nor forgets it.
If step 4 fails the transition is still in the table (and the error is logged by APScheduler).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC
from pathlib import Path

import duckdb
import pyarrow as pa
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from agent.ingest import registered
from agent.metrics import AgentMetrics
from agent.store import Store, to_timestamp
from alerts.evaluator import (
    AlertState,
    AlertStatus,
    Measurement,
    Notification,
    SeriesKey,
    evaluate,
)
from alerts.rules import RecoverableHitRateRule

log = logging.getLogger(__name__)

GAUGE_WINDOW_SECONDS = 60
JOB_ID = "kvscope-alerts"


def query_window(store: Store, *, start: float, end: float) -> dict[SeriesKey, Measurement]:
    """Σ recoverable and Σ prompt tokens of the requests with ``start <= ts < end`` (unix
    seconds), per (engine, model)."""
    with store.cursor() as cur:
        rows = cur.execute(
            """
            SELECT engine_id, model,
                   sum(recoverable_tokens)::BIGINT, sum(prompt_tokens)::BIGINT
            FROM requests
            WHERE ts >= $start AND ts < $end
            GROUP BY engine_id, model
            """,
            {"start": to_timestamp(start), "end": to_timestamp(end)},
        ).fetchall()
    return {
        (engine, model): Measurement(recoverable_tokens=recoverable, prompt_tokens=prompt)
        for engine, model, recoverable, prompt in rows
    }


def load_state(store: Store, alerts: Sequence[str] | None = None) -> dict[str, AlertState]:
    """The latest transition of every fingerprint in the ``alerts`` table, as state — only of
    the ``alerts`` named (the rule scheduler writes its own rules' transitions there too)."""
    with store.cursor() as cur:
        rows = cur.execute(
            """
            SELECT epoch_us(ts), alert, fingerprint, state, value, labels
            FROM alerts
            WHERE $names::VARCHAR[] IS NULL OR list_contains($names::VARCHAR[], alert)
            QUALIFY row_number() OVER (PARTITION BY fingerprint ORDER BY ts DESC) = 1
            """,
            {"names": list(alerts) if alerts is not None else None},
        ).fetchall()
    return {
        fp: AlertState(
            alert=alert,
            fingerprint=fp,
            labels=json.loads(labels),
            status=AlertStatus(status),
            since=ts_us / 1_000_000,
            value=value,
        )
        for ts_us, alert, fp, status, value, labels in rows
    }


ALERT_COLUMNS = pa.schema(
    [
        ("ts", pa.timestamp("us")),
        ("alert", pa.string()),
        ("fingerprint", pa.string()),
        ("state", pa.string()),
        ("value", pa.float64()),
        ("labels", pa.string()),
        ("summary", pa.string()),
        ("description", pa.string()),
    ]
)
"""The columns of the ``alerts`` table (one row per transition), shared by both schedulers."""


def alert_row(
    *, at: float, alert: str, fingerprint: str, state: str, value: float | None,
    labels: Mapping[str, str], summary: str, description: str,
) -> dict[str, object]:  # fmt: skip
    """One ``alerts`` row: a transition at ``at`` (unix seconds)."""
    return {
        "ts": to_timestamp(at),
        "alert": alert,
        "fingerprint": fingerprint,
        "state": state,
        "value": value,
        "labels": json.dumps(dict(labels), sort_keys=True),
        "summary": summary,
        "description": description,
    }


def insert_alert_rows(cur: duckdb.DuckDBPyConnection, rows: Sequence[Mapping[str, object]]) -> None:
    """Insert ``alerts`` rows (from :func:`alert_row`) with one statement, inside the caller's
    transaction."""
    if not rows:
        return
    columns = ", ".join(ALERT_COLUMNS.names)
    with registered(cur, "_new_alerts", pa.Table.from_pylist(list(rows), schema=ALERT_COLUMNS)):
        cur.execute(f"INSERT INTO alerts ({columns}) SELECT {columns} FROM _new_alerts")


def persist(store: Store, notifications: Sequence[Notification]) -> None:
    """Insert the transitions into the ``alerts`` table in one transaction."""
    if not notifications:
        return
    rows = [
        alert_row(
            at=n.at, alert=n.alert, fingerprint=n.fingerprint, state=n.status.value, value=n.value,
            labels=n.labels, summary=n.summary, description=n.description,
        )
        for n in notifications
    ]
    with store.transaction() as cur:
        insert_alert_rows(cur, rows)


def append_jsonl(path: Path, lines: Sequence[Mapping[str, object]]) -> None:
    """The log receiver: one JSON object per line, appended to ``path``."""
    if not lines:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        for line in lines:
            out.write(json.dumps(line, sort_keys=True) + "\n")


def append_log(path: Path, notifications: Sequence[Notification]) -> None:
    """The log receiver for the built-in rule's notifications."""
    append_jsonl(path, [n.to_json() for n in notifications])


class AlertScheduler:
    """Evaluates ``rules`` against ``store`` on a schedule; see the module docstring.

    Args:
        store: the agent's store (read for data, written for transitions).
        rules: the rules to evaluate.
        log_path: the log receiver's file.
        metrics: where the recoverable-hit-ratio gauge lives (``None``: not updated).
        ingest_lag_seconds: seconds after each minute boundary the job runs, and how far
            before ``now`` its windows end (integer, 0..59).
        interval_seconds: run every N seconds instead (``None``: minute boundaries).
        clock: the time source (unix seconds), injectable for tests.
    """

    def __init__(
        self,
        *,
        store: Store,
        rules: Sequence[RecoverableHitRateRule],
        log_path: Path,
        metrics: AgentMetrics | None = None,
        ingest_lag_seconds: int = 5,
        interval_seconds: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 <= ingest_lag_seconds <= 59:
            raise ValueError(f"ingest_lag_seconds must be in [0, 59], got {ingest_lag_seconds}")
        if interval_seconds is not None and not interval_seconds > 0:
            raise ValueError(f"interval_seconds must be > 0 or None, got {interval_seconds}")
        names = [rule.name for rule in rules]
        if len(set(names)) != len(names):
            raise ValueError(f"rule names must be unique, got {names}")
        self._store = store
        self._rules = tuple(rules)
        self._log_path = log_path
        self._metrics = metrics
        self._lag_seconds = ingest_lag_seconds
        self._interval_seconds = interval_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._state: dict[str, AlertState] = {}
        self._scheduler: BackgroundScheduler | None = None

    @property
    def state(self) -> dict[str, AlertState]:
        """A copy of the current state (fingerprint → state)."""
        with self._lock:
            return dict(self._state)

    @property
    def trigger(self) -> BaseTrigger:
        if self._interval_seconds is not None:
            return IntervalTrigger(seconds=self._interval_seconds, timezone=UTC)
        return CronTrigger(second=self._lag_seconds, timezone=UTC)

    def restore(self) -> None:
        """Load the state from the ``alerts`` table (done by :meth:`start`)."""
        restored = load_state(self._store, [rule.name for rule in self._rules])
        with self._lock:
            self._state = restored

    def run_once(self, now: float | None = None) -> list[Notification]:
        """One evaluation at ``now`` (default: the clock). Returns its notifications."""
        now = self._clock() if now is None else now
        end = now - self._lag_seconds
        windows = {rule.window_seconds for rule in self._rules} | {GAUGE_WINDOW_SECONDS}
        by_window = {w: query_window(self._store, start=end - w, end=end) for w in windows}
        data = {rule.name: by_window[rule.window_seconds] for rule in self._rules}
        with self._lock:
            state, notifications = evaluate(self._rules, data, now, self._state)
            persist(self._store, notifications)
            self._state = state
        for n in notifications:
            log.warning("alert %s %s: %s", n.alert, n.status.value, n.summary)
        append_log(self._log_path, notifications)
        if self._metrics is not None:
            ratios = {
                key: m.ratio
                for key, m in by_window[GAUGE_WINDOW_SECONDS].items()
                if m.ratio is not None
            }
            self._metrics.set_recoverable_hit_ratios(ratios)
        return notifications

    def start(self) -> None:
        """Restore the state, then run on the schedule in a background thread."""
        if self._scheduler is not None:
            raise RuntimeError("the alert scheduler is already started")
        self.restore()
        scheduler = BackgroundScheduler(timezone=UTC)
        scheduler.add_job(
            self.run_once,
            self.trigger,
            id=JOB_ID,
            max_instances=1,
            coalesce=True,
            misfire_grace_time=30,
        )
        scheduler.start()
        self._scheduler = scheduler

    def shutdown(self) -> None:
        """Stop the schedule, waiting for a running evaluation to finish. Idempotent."""
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.shutdown(wait=True)
