"""Runs rule files on a schedule: :class:`RuleScheduler` (issue 7, item 3).

One APScheduler 3.x ``BackgroundScheduler`` job per rule group: every ``interval`` when the group
sets one, else at every minute boundary plus the ingest lag (``CronTrigger(second=lag)``, UTC);
``max_instances=1`` and coalescing, so a slow run is never doubled up. A run of a group:

1. collects each rule's inputs (:func:`alerts.inputs.collect_inputs`); a rule whose query fails
   (a bad expr value, a truncated result, a store error) is skipped this time with its state
   unchanged (logged, counted in ``kvscope_alert_rule_failures_total``);
2. evaluates the group (:func:`alerts.rule_eval.evaluate`) against its own alerts' state;
3. in one transaction: writes the changed states to ``alert_state`` (deleting the dropped ones)
   and the notifications (firing, resolved) to ``alerts``;
4. appends each notification as one JSON line to the log receiver's file.

:meth:`RuleScheduler.start` first restores the state from ``alert_state``, so a restart neither
re-pages nor loses pending time; alerts the file can no longer produce (a rule removed, or its
labels or burn windows changed) are resolved then.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC
from pathlib import Path

import pyarrow as pa
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client import CollectorRegistry, Counter

from agent.ingest import registered
from agent.store import Store, to_timestamp
from alerts.inputs import ExprError, collect_inputs
from alerts.rule_eval import (
    AlertState,
    Labels,
    Notification,
    SeriesInput,
    Status,
    burn_verdicts,
    evaluate,
    fingerprint,
)
from alerts.rulefile import HitRateBelow, RuleFile, RuleGroup
from alerts.scheduler import alert_row, append_jsonl, insert_alert_rows

log = logging.getLogger(__name__)

_STATE_SCHEMA = pa.schema(
    [
        ("fingerprint", pa.string()),
        ("alert", pa.string()),
        ("labels", pa.string()),
        ("series", pa.string()),
        ("status", pa.string()),
        ("active_since", pa.float64()),
        ("firing_since", pa.float64()),
        ("inactive_since", pa.float64()),
        ("resolved_at", pa.float64()),
        ("evaluated_at", pa.float64()),
        ("value", pa.float64()),
        ("updated_at", pa.timestamp("us")),
    ]
)
def load_rule_state(store: Store) -> dict[str, AlertState]:
    """Every alert's state from ``alert_state``."""
    with store.cursor() as cur:
        rows = cur.execute(
            "SELECT fingerprint, alert, labels, series, status, active_since, firing_since, "
            "inactive_since, resolved_at, evaluated_at, value FROM alert_state"
        ).fetchall()
    return {
        fp: AlertState(
            alert=alert,
            fingerprint=fp,
            labels=json.loads(labels),
            series=tuple((k, v) for k, v in json.loads(series)),
            status=Status(status),
            active_since=active,
            firing_since=firing,
            inactive_since=inactive,
            resolved_at=resolved,
            evaluated_at=evaluated,
            value=value,
        )
        for fp, alert, labels, series, status, active, firing, inactive, resolved, evaluated, value in rows
    }


def save(store: Store, before: dict[str, AlertState], after: dict[str, AlertState], notes: Sequence[Notification], now: float) -> None:
    """Write the state changes between ``before`` and ``after`` and the notifications, in one
    transaction."""
    changed = [st for fp, st in after.items() if before.get(fp) != st]
    dropped = [fp for fp in before if fp not in after]
    if not changed and not dropped and not notes:
        return
    at = to_timestamp(now)
    states = pa.Table.from_pylist(
        [
            {
                "fingerprint": st.fingerprint,
                "alert": st.alert,
                "labels": json.dumps(dict(st.labels), sort_keys=True),
                "series": json.dumps([list(kv) for kv in st.series]),
                "status": st.status.value,
                "active_since": st.active_since,
                "firing_since": st.firing_since,
                "inactive_since": st.inactive_since,
                "resolved_at": st.resolved_at,
                "evaluated_at": st.evaluated_at,
                "value": st.value,
                "updated_at": at,
            }
            for st in changed
        ],
        schema=_STATE_SCHEMA,
    )
    alerts = [
        alert_row(
            at=n.at, alert=n.alert, fingerprint=n.fingerprint, state=n.status.value, value=n.value, labels=n.labels,
            summary=n.annotations.get("summary", ""), description=n.annotations.get("description", ""),
        )
        for n in notes
    ]
    with store.transaction() as cur:
        if dropped or changed:
            doomed = dropped + [st.fingerprint for st in changed]
            cur.execute("DELETE FROM alert_state WHERE list_contains($fps, fingerprint)", {"fps": doomed})
        if changed:
            with registered(cur, "_alert_state", states):
                cur.execute(f"INSERT INTO alert_state SELECT {', '.join(_STATE_SCHEMA.names)} FROM _alert_state")
        insert_alert_rows(cur, alerts)


def append_log(path: Path, notes: Sequence[Notification]) -> None:
    """The log receiver: one JSON line per notification."""
    append_jsonl(
        path,
        [
            {
                "at": n.at,
                "alert": n.alert,
                "fingerprint": n.fingerprint,
                "status": n.status.value,
                "labels": dict(n.labels),
                "value": n.value,
                "annotations": dict(n.annotations),
            }
            for n in notes
        ],
    )


class RuleScheduler:
    """Evaluates a rule file's groups against ``store`` on their schedules (module docstring).

    Args:
        store: the agent's store.
        rules: the loaded rule file.
        log_path: the log receiver's file.
        registry: where ``kvscope_alert_rule_failures_total`` is registered.
        lag_seconds: the ingest lag: windows end this long before now; default runs happen this
            many seconds after each minute boundary (0..59).
        clock: unix seconds, injectable for tests.
    """

    def __init__(
        self,
        *,
        store: Store,
        rules: RuleFile,
        log_path: Path,
        registry: CollectorRegistry,
        lag_seconds: int = 5,
        clock: Callable[[], float] = time.time,
        row_limit: int = 10_000,
        timeout_seconds: float = 10.0,
    ) -> None:
        if not 0 <= lag_seconds <= 59:
            raise ValueError(f"lag_seconds must be in [0, 59], got {lag_seconds}")
        self.store = store
        self.rules = rules
        self.log_path = log_path
        self.lag_seconds = lag_seconds
        self.clock = clock
        self.row_limit = row_limit
        self.timeout_seconds = timeout_seconds
        self.failures = Counter(
            "kvscope_alert_rule_failures_total",
            "Rule evaluations skipped because the rule's query failed, by alert.",
            ("alert",),
            registry=registry,
        )
        self._lock = threading.Lock()
        self._state: dict[str, AlertState] = {}
        self._scheduler: BackgroundScheduler | None = None

    @property
    def state(self) -> dict[str, AlertState]:
        with self._lock:
            return dict(self._state)

    def restore(self, now: float | None = None) -> list[Notification]:
        """Load the state; resolve (and forget) the alerts of rules no longer in the file."""
        now = self.clock() if now is None else now
        loaded = load_rule_state(self.store)
        current = {fp for st in loaded.values() for fp in self._fingerprints(st)}
        orphans = {fp: st for fp, st in loaded.items() if fp not in current}
        _, notes = evaluate([], {}, now, orphans)
        save(self.store, orphans, {}, notes, now)
        append_log(self.log_path, notes)
        with self._lock:
            self._state = {fp: st for fp, st in loaded.items() if fp not in orphans}
        return notes

    def _fingerprints(self, st: AlertState) -> set[str]:
        """The fingerprints the file's rules can give ``st``'s series now (none when its rule is
        gone): a rule whose labels or burn windows changed no longer reaches the old alert, which
        is then resolved like a removed rule's."""
        rule = next((r for r in self.rules.rules if r.alert == st.alert), None)
        if rule is None:
            return set()
        extras: list[dict[str, str]] = [{}]
        if isinstance(rule.settings, HitRateBelow):
            extras = [labels for labels, _ in burn_verdicts(rule.settings, None)]
        return {fingerprint(rule.alert, {**dict(st.series), **rule.labels, **extra}) for extra in extras}

    def run_group(self, group: RuleGroup, now: float | None = None) -> list[Notification]:
        """Evaluate one group at ``now`` (default: the clock); returns its notifications."""
        now = self.clock() if now is None else now
        inputs: dict[str, Mapping[Labels, SeriesInput]] = {}
        evaluated = []
        for rule in group.rules:
            try:
                inputs.update(
                    collect_inputs(
                        self.store,
                        [rule],
                        now=now,
                        lag_seconds=self.lag_seconds,
                        row_limit=self.row_limit,
                        timeout_seconds=self.timeout_seconds,
                    )
                )
            except ExprError as exc:
                self.failures.labels(alert=rule.alert).inc()
                log.error("alert rule skipped this time: %s", exc)
                continue
            except Exception:  # a store error: skip this rule, keep the group going
                self.failures.labels(alert=rule.alert).inc()
                log.exception("alert rule %s skipped this time", rule.alert)
                continue
            evaluated.append(rule)
        names = {rule.alert for rule in evaluated}
        with self._lock:
            before = {fp: st for fp, st in self._state.items() if st.alert in names}
            after, notes = evaluate(evaluated, inputs, now, before)
            save(self.store, before, after, notes, now)
            for fp in before:
                self._state.pop(fp, None)
            self._state.update(after)
        for n in notes:
            log.warning("alert %s %s %s", n.alert, n.status.value, n.annotations.get("summary", ""))
        append_log(self.log_path, notes)
        return notes

    def trigger(self, group: RuleGroup) -> BaseTrigger:
        if group.interval_seconds is not None:
            return IntervalTrigger(seconds=group.interval_seconds, timezone=UTC)
        return CronTrigger(second=self.lag_seconds, timezone=UTC)

    def start(self) -> None:
        """Restore the state, then run every group on its schedule in a background thread."""
        if self._scheduler is not None:
            raise RuntimeError("the rule scheduler is already started")
        self.restore()
        scheduler = BackgroundScheduler(timezone=UTC)
        for group in self.rules.groups:
            scheduler.add_job(
                self.run_group,
                self.trigger(group),
                args=(group,),
                id=f"kvscope-rules-{group.name}",
                name=f"kvscope rule group {group.name}",
                max_instances=1,
                coalesce=True,
                misfire_grace_time=30,
            )
        scheduler.start()
        self._scheduler = scheduler

    def shutdown(self) -> None:
        """Stop, waiting for a running evaluation. Idempotent."""
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.shutdown(wait=True)
