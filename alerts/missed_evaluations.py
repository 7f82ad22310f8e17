"""Rule-group evaluations that were due and did not run: :class:`MissedEvaluations` (issue 19).

APScheduler 3.x drops a due run of a job in three ways, and before this module they showed only
as its log warnings (or not at all). Each is counted here in
``kvscope_alert_evaluations_missed_total{group, reason}``, logged once per event, and kept for
``GET /v1/alerts`` (the dashboard's Alerts page):

* ``reason="misfire"`` — ``EVENT_JOB_MISSED``: when the worker got to the run it was due longer
  ago than the job's ``misfire_grace_time`` (the process was suspended or starved, the clock
  jumped), so APScheduler gave it up;
* ``reason="overrun"`` — ``EVENT_JOB_MAX_INSTANCES``: the run fell due while the group's
  previous evaluation was still going (``max_instances=1``), an evaluation slower than its
  interval;
* ``reason="coalesced"`` — run times APScheduler merged into one (``coalesce=True``: several due
  at once after a stall run once) and never reports. They are the gap between two consecutive
  run times it did process, in intervals, less one; every group's trigger fires at a fixed
  period (its interval, or 60 s for the minute-boundary cron trigger), so the gap divides
  exactly.

Counters reset when the agent restarts, as every Prometheus counter; the time an evaluation was
due is the *scheduled* run time APScheduler reports. Peer: Prometheus counts the same thing as
``prometheus_rule_group_iterations_missed_total{rule_group}``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import datetime

from apscheduler.events import (
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_MISSED,
    EVENT_JOB_SUBMITTED,
    JobEvent,
    JobExecutionEvent,
    JobSubmissionEvent,
)
from apscheduler.schedulers.base import BaseScheduler
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

REASONS = ("misfire", "overrun", "coalesced")
"""The ``reason`` label's values (module docstring)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Tracked:
    group: str
    interval_seconds: float


class MissedEvaluations:
    """Counts the evaluations of tracked APScheduler jobs that were due and did not run.

    Args:
        registry: where ``kvscope_alert_evaluations_missed_total`` is registered.

    Thread-safe: APScheduler calls the listener from its scheduler thread (submissions,
    overruns) and from its worker threads (misfires).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter(
            "kvscope_alert_evaluations_missed_total",
            "Rule-group evaluations that were due and did not run, by group and reason "
            "(misfire: given up as too late; overrun: the previous evaluation still ran; "
            "coalesced: merged into a later run after a stall).",
            ("group", "reason"),
            registry=registry,
        )
        self._lock = threading.Lock()
        self._jobs: dict[str, _Tracked] = {}
        self._last_due: dict[str, datetime] = {}
        self._counts: dict[tuple[str, str], int] = {}
        self._last_at: dict[tuple[str, str], float] = {}

    def track(self, job_id: str, *, group: str, interval_seconds: float) -> None:
        """Count the missed runs of ``job_id``, the job of rule group ``group`` that fires every
        ``interval_seconds``; its series start at 0.

        Raises:
            ValueError: ``interval_seconds`` is not positive.
        """
        if not interval_seconds > 0:
            raise ValueError(f"interval_seconds must be positive, got {interval_seconds}")
        with self._lock:
            self._jobs[job_id] = _Tracked(group=group, interval_seconds=interval_seconds)
            for reason in REASONS:
                self.counter.labels(group=group, reason=reason)
                self._counts.setdefault((group, reason), 0)

    def listen(self, scheduler: BaseScheduler) -> None:
        """Receive ``scheduler``'s submission, overrun and misfire events."""
        scheduler.add_listener(self.on_event, EVENT_JOB_SUBMITTED | EVENT_JOB_MAX_INSTANCES | EVENT_JOB_MISSED)

    def on_event(self, event: JobEvent) -> None:
        """Count one APScheduler event (events of untracked jobs are ignored)."""
        tracked = self._jobs.get(event.job_id)
        if tracked is None:
            return
        if isinstance(event, JobExecutionEvent):
            if event.code == EVENT_JOB_MISSED:
                self._add(tracked, "misfire", 1, event.scheduled_run_time)
            return
        if not isinstance(event, JobSubmissionEvent) or not event.scheduled_run_times:
            return
        due = sorted(event.scheduled_run_times)
        with self._lock:
            previous = self._last_due.get(event.job_id)
            self._last_due[event.job_id] = due[-1]
        if previous is not None:
            gap = round((due[0] - previous).total_seconds() / tracked.interval_seconds) - 1
            if gap > 0:
                self._add(tracked, "coalesced", gap, due[0])
        if event.code == EVENT_JOB_MAX_INSTANCES:
            self._add(tracked, "overrun", len(due), due[-1])

    def _add(self, tracked: _Tracked, reason: str, n: int, due: datetime) -> None:
        key = (tracked.group, reason)
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + n
            self._last_at[key] = due.timestamp()
        self.counter.labels(group=tracked.group, reason=reason).inc(n)
        log.warning(
            "rule group %s: %d evaluation(s) due at %s did not run (%s; see kvscope_alert_evaluations_missed_total)",
            tracked.group, n, due.isoformat(), reason,
        )  # fmt: skip

    def counts(self) -> list[dict[str, object]]:
        """Per tracked group and reason: ``group``, ``reason``, ``count`` since the agent
        started and ``last_due_at`` (unix seconds of the latest missed run time, None if none),
        by group then reason."""
        with self._lock:
            return [
                {"group": group, "reason": reason, "count": n, "last_due_at": self._last_at.get((group, reason))}
                for (group, reason), n in sorted(self._counts.items())
            ]
