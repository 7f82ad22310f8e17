"""Runs rule files on a schedule: :class:`RuleScheduler` (issue 7, item 3).

One APScheduler 3.x ``BackgroundScheduler`` job per rule group: every ``interval`` when the group
sets one (or the agent's ``alert_interval_seconds`` override), else at every minute boundary plus
the ingest lag (``CronTrigger(second=lag)``, UTC); ``max_instances=1`` and coalescing, so a slow
run is never doubled up. A run of a group:

1. collects each rule's inputs (:func:`alerts.inputs.collect_inputs`; a drop rule's baseline
   anchored where its pending or firing alert turned active); a rule whose query fails (a bad
   expr value, a truncated result, a store error), or whose previous query still runs
   (:class:`alerts.inputs.RunningQueries`), is skipped this time with its state unchanged
   (logged, counted in ``kvscope_alert_rule_failures_total``); the series a rule could not judge
   are noted with their volume (:class:`alerts.rule_health.RuleHealth`: logged, and served);
2. evaluates the group (:func:`alerts.rule_eval.evaluate`) against its own alerts' state;
3. in one transaction: writes the changed states to ``alert_state`` (deleting the dropped ones)
   and the transitions (firing, resolved) to ``alerts``;
4. appends each transition as one JSON line to the transition log (``alerts.log``);
5. hands every firing or recently resolved alert to the :class:`alerts.notifier.Notifier`: the
   group's alerts are pushed to the configured Alertmanagers, and all alerts are routed to the
   receivers (grouping, inhibition, silences), within 80% of the group's interval.

:meth:`RuleScheduler.start` first restores the state from ``alert_state`` and the notification
log from ``alert_groups``, so a restart neither re-pages nor loses pending time; alerts the file
can no longer produce (a rule removed, or its labels or burn windows changed) are resolved then.
Then a thread (:meth:`RuleScheduler.resend`, at once, before any group can have evaluated) pushes
every restored firing alert to the Alertmanagers with a fresh lease, and those resolves, so an
alert whose last lease was about to run out while the agent was down is not resolved by
Alertmanager and then fired again (issue 19). A group's pushes are serialised, so that re-push
never lands after a newer evaluation's. The re-push has one deadline (80% of the longest group
interval) and stops between groups when :meth:`RuleScheduler.shutdown` asks, which waits for it
at most :data:`RESEND_JOIN_SECONDS`: an Alertmanager that never answers cannot hold the agent's
stop (and the store's last checkpoint). Evaluations due and not run (misfired, overrun,
coalesced) are counted by :class:`alerts.missed_evaluations.MissedEvaluations`.

Exactly one scheduler per agent: :func:`agent.server.serve` starts it next to uvicorn (not in
the ASGI app, so no server worker or reload can start a second), and the agent holds the DuckDB
file's write lock, so no second agent can run on the same state.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC
from pathlib import Path

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.store import Store
from alerts.alert_store import load_rule_state
from alerts.alert_view import active_view, outgoing_of, resolve_of
from alerts.inputs import ExprError, RunningQueries, activation_anchors, collect_inputs
from alerts.missed_evaluations import MissedEvaluations
from alerts.notifier import Notifier, OutgoingAlert
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
from alerts.rule_health import RuleHealth
from alerts.rulefile import HitRateBelow, Rule, RuleFile, RuleGroup
from alerts.transitions import append_log, save

log = logging.getLogger(__name__)


def job_id(group: RuleGroup) -> str:
    """The APScheduler job id of ``group``'s evaluations."""
    return f"kvscope-rules-{group.name}"


DEFAULT_INTERVAL_SECONDS = 60.0
"""A group without ``interval`` (and no override) runs every minute, at the boundary plus the lag."""
RESEND_JOIN_SECONDS = 2.0
"""How long :meth:`RuleScheduler.shutdown` waits for a start-up re-push still under way."""
LOCK_POLL_SECONDS = 0.1
"""How often a push waiting for its group's earlier push checks for a shutdown."""


class RuleScheduler:
    """Evaluates a rule file's groups against ``store`` on their schedules and hands the result
    to the notifier (module docstring).

    Args:
        store: the agent's store.
        rules: the loaded rule file.
        log_path: the transition log's file (one JSON line per firing or resolve).
        registry: where ``kvscope_alert_rule_failures_total``, ``kvscope_alerts`` and
            ``kvscope_alert_evaluations_missed_total`` are registered.
        notifier: routes and delivers the alerts after each evaluation (None: transitions are
            only stored and logged).
        lag_seconds: the ingest lag: windows end this long before now; minute runs happen this
            many seconds after each minute boundary (0..59).
        interval_seconds: run groups without their own ``interval`` every N seconds instead of
            at minute boundaries (tests, demos).
        clock: unix seconds, injectable for tests.
    """

    def __init__(
        self,
        *,
        store: Store,
        rules: RuleFile,
        log_path: Path,
        registry: CollectorRegistry,
        notifier: Notifier | None = None,
        lag_seconds: int = 5,
        interval_seconds: float | None = None,
        clock: Callable[[], float] = time.time,
        row_limit: int = 10_000,
        timeout_seconds: float = 10.0,
    ) -> None:
        if not 0 <= lag_seconds <= 59:
            raise ValueError(f"lag_seconds must be in [0, 59], got {lag_seconds}")
        if interval_seconds is not None and not interval_seconds > 0:
            raise ValueError(f"interval_seconds must be positive, got {interval_seconds}")
        self.store = store
        self.rules = rules
        self.log_path = log_path
        self.notifier = notifier
        self.lag_seconds = lag_seconds
        self.interval_seconds = interval_seconds
        self.clock = clock
        self.row_limit = row_limit
        self.timeout_seconds = timeout_seconds
        self.failures = Counter(
            "kvscope_alert_rule_failures_total",
            "Rule evaluations skipped because the rule's query failed or its previous one still runs, by alert.",
            ("alert",),
            registry=registry,
        )
        self.active = Gauge(
            "kvscope_alerts",
            "Alerts pending or firing now, by alert name and state (as Prometheus's ALERTS).",
            ("alertname", "alertstate"),
            registry=registry,
        )
        self.missed = MissedEvaluations(registry)
        self.health = RuleHealth()
        for group in rules.groups:
            self.missed.track(job_id(group), group=group.name, interval_seconds=self.interval_of(group))
        self._rules_by_name: dict[str, Rule] = {rule.alert: rule for rule in rules.rules}
        self._lock = threading.Lock()
        self._push_locks = {group.name: threading.Lock() for group in rules.groups}
        self._stopping = threading.Event()
        self._running_queries = RunningQueries()
        self._state: dict[str, AlertState] = {}
        self._dropped: list[OutgoingAlert] = []
        self._scheduler: BackgroundScheduler | None = None
        self._resender: threading.Thread | None = None

    @property
    def state(self) -> dict[str, AlertState]:
        with self._lock:
            return dict(self._state)

    def interval_of(self, group: RuleGroup) -> float:
        """The group's evaluation interval in seconds."""
        if group.interval_seconds is not None:
            return group.interval_seconds
        return self.interval_seconds if self.interval_seconds is not None else DEFAULT_INTERVAL_SECONDS

    def restore(self, now: float | None = None) -> list[Notification]:
        """Load the state and the notification log; resolve (and forget) the alerts of rules no
        longer in the file."""
        now = self.clock() if now is None else now
        loaded = load_rule_state(self.store)
        current = {fp for st in loaded.values() for fp in self._fingerprints(st)}
        orphans = {fp: st for fp, st in loaded.items() if fp not in current}
        _, notes = evaluate([], {}, now, orphans)
        save(self.store, orphans, {}, notes, now)
        append_log(self.log_path, notes)
        with self._lock:
            self._state = {fp: st for fp, st in loaded.items() if fp not in orphans}
            self._dropped = [resolve_of(orphans[n.fingerprint], n.at) for n in notes if n.fingerprint in orphans]
        if self.notifier is not None:
            self.notifier.restore()
        self._set_gauge()
        return notes

    def resend(self, now: float | None = None) -> int:
        """Push every group's alerts as restored (firing ones leased from the time of the push,
        read under the group's push lock; recent resolves), each group within 80% of its
        interval, then the resolves of the alerts :meth:`restore` dropped, to every Alertmanager;
        :meth:`start` runs it at once. All of it within one deadline, 80% of the longest interval
        (groups and :data:`DEFAULT_INTERVAL_SECONDS`) from the start; it stops between groups at
        that deadline or when :meth:`shutdown` asks, and logs what it did not re-push (the
        groups' evaluations push it). ``now`` (unix seconds) fixes every push's time (tests).
        Returns how many pushes failed (logged and recorded as at every evaluation)."""
        if self.notifier is None:
            return 0
        deadline = time.monotonic() + 0.8 * max([DEFAULT_INTERVAL_SECONDS, *map(self.interval_of, self.rules.groups)])
        failed, done = 0, set[str]()
        for group in self.rules.groups:
            if self._stopping.is_set() or time.monotonic() >= deadline:
                break
            names, interval = {rule.alert for rule in group.rules}, self.interval_of(group)
            group_deadline = min(time.monotonic() + 0.8 * interval, deadline)
            with self._hold_push(group, group_deadline) as held:  # not held: its evaluation pushed
                if held:
                    pushed = [o for o in (self.outgoing(st) for st in self.state.values() if st.alert in names) if o is not None]
                    failed += self._push(pushed, self.clock() if now is None else now, interval, group_deadline)
                    done.add(group.name)
                    if pushed:
                        log.info("rule group %s: %d restored alert(s) re-pushed to the Alertmanagers", group.name, len(pushed))
        dropped, self._dropped = self._dropped, []
        if self._stopping.is_set() or time.monotonic() >= deadline:
            log.warning(
                "start-up re-push stopped (%s); not re-pushed: rule group(s) [%s] and %d resolve(s) of alerts whose rules are gone",
                "the agent is stopping" if self._stopping.is_set() else "its deadline passed",
                ", ".join(g.name for g in self.rules.groups if g.name not in done), len(dropped),
            )  # fmt: skip
            return failed
        return failed + self._push(dropped, self.clock() if now is None else now, DEFAULT_INTERVAL_SECONDS, deadline)

    @contextlib.contextmanager
    def _hold_push(self, group: RuleGroup, deadline: float) -> Iterator[bool]:
        """Hold ``group``'s push lock, waiting for it until ``deadline`` (monotonic seconds) or a
        shutdown; yields whether it is held."""
        lock = self._push_locks[group.name]
        held = lock.acquire(blocking=False)
        while not held and not self._stopping.is_set() and time.monotonic() < deadline:
            held = lock.acquire(timeout=min(LOCK_POLL_SECONDS, max(deadline - time.monotonic(), 0.0)))
        try:
            yield held
        finally:
            if held:
                lock.release()

    def _push(self, alerts: list[OutgoingAlert], now: float, interval: float, deadline: float) -> int:
        assert self.notifier is not None
        try:
            return self.notifier.push(alerts, now, interval_seconds=interval, deadline=deadline)
        except Exception:  # the store failed while recording a failure: the evaluations push again
            log.exception("re-pushing the restored alerts failed")
            return 1

    def _fingerprints(self, st: AlertState) -> set[str]:
        """The fingerprints the file's rules can give ``st``'s series now (none when its rule is
        gone): a rule whose labels or burn windows changed no longer reaches the old alert, which
        is then resolved like a removed rule's."""
        rule = self._rules_by_name.get(st.alert)
        if rule is None:
            return set()
        extras: list[dict[str, str]] = [{}]
        if isinstance(rule.settings, HitRateBelow):
            extras = [labels for labels, _ in burn_verdicts(rule.settings, None)]
        return {fingerprint(rule.alert, {**dict(st.series), **rule.labels, **extra}) for extra in extras}

    def run_group(self, group: RuleGroup, now: float | None = None) -> list[Notification]:
        """Evaluate one group at ``now`` (default: the clock), then notify; returns the group's
        transitions (firing, resolved)."""
        now = self.clock() if now is None else now
        started = time.monotonic()
        inputs: dict[str, Mapping[Labels, SeriesInput]] = {}
        evaluated = []
        for rule in group.rules:
            try:
                anchors = {rule.alert: activation_anchors(self.state.values(), rule.alert)}
                collected = collect_inputs(
                    self.store, [rule], now=now, lag_seconds=self.lag_seconds, row_limit=self.row_limit,
                    timeout_seconds=self.timeout_seconds, running=self._running_queries, anchors=anchors,
                )  # fmt: skip
                inputs.update(collected)
                self.health.observe(rule, collected.get(rule.alert, {}), now)
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
        group_names = {rule.alert for rule in group.rules}
        with self._lock:
            before = {fp: st for fp, st in self._state.items() if st.alert in names}
            after, notes = evaluate(evaluated, inputs, now, before)
            save(self.store, before, after, notes, now)
            for fp in before:
                self._state.pop(fp, None)
            self._state.update(after)
            mine = [st for st in self._state.values() if st.alert in group_names]
        for n in notes:
            log.warning("alert %s %s %s", n.alert, n.status.value, n.annotations.get("summary", ""))
        try:
            append_log(self.log_path, notes)
        except OSError as exc:  # the transitions are in the store; do not hold back the pages
            log.error("cannot append to the transition log %s: %s", self.log_path, exc)
        self._set_gauge()
        if self.notifier is not None:
            self._notify(group, mine, now, started)
        return notes

    def _notify(self, group: RuleGroup, mine: list[AlertState], now: float, started: float) -> None:
        """Push the group's alerts to the Alertmanagers, then route every alert, all within 80%
        of the group's interval from the start of its evaluation."""
        interval = self.interval_of(group)
        deadline = started + 0.8 * interval
        assert self.notifier is not None
        try:
            pushed = [o for o in (self.outgoing(st) for st in mine) if o is not None]
            push_deadline = time.monotonic() + max(deadline - time.monotonic(), 0.0) / 2
            with self._hold_push(group, push_deadline) as held:
                if held:
                    self.notifier.push(pushed, now, interval_seconds=interval, deadline=push_deadline)
                else:
                    log.error("rule group %s: not pushed to the Alertmanagers this time: its previous push still runs or the agent stops", group.name)
            self.notifier.route(self._everything, now, deadline=deadline)
        except Exception:  # the store failed while logging: the next evaluation retries
            log.exception("notifying after rule group %s failed", group.name)

    def _everything(self) -> list[OutgoingAlert]:
        """Every alert the notifier should know now (read under its lock)."""
        return [o for o in (self.outgoing(st) for st in self.state.values()) if o is not None]

    def outgoing(self, st: AlertState) -> OutgoingAlert | None:
        """``st`` as the notifier sees it (:func:`alerts.alert_view.outgoing_of`)."""
        return outgoing_of(st, self._rules_by_name.get(st.alert))

    def active_alerts(self) -> list[dict[str, object]]:
        """The alerts pending or firing now, with their annotations rendered (``GET /v1/alerts``),
        firing first, then by name and labels."""
        out = [
            active_view(st, self._rules_by_name.get(st.alert))
            for st in self.state.values()
            if st.status in (Status.PENDING, Status.FIRING)
        ]
        return sorted(out, key=lambda a: (a["state"] != "firing", a["alertname"], sorted(dict(a["labels"]).items())))  # type: ignore[call-overload]

    def _set_gauge(self) -> None:
        counts: dict[tuple[str, str], int] = {(rule.alert, s): 0 for rule in self.rules.rules for s in ("pending", "firing")}
        for st in self.state.values():
            if st.status in (Status.PENDING, Status.FIRING):
                counts[(st.alert, st.status.value)] = counts.get((st.alert, st.status.value), 0) + 1
        for (name, state), n in counts.items():
            self.active.labels(alertname=name, alertstate=state).set(n)

    def trigger(self, group: RuleGroup) -> BaseTrigger:
        if group.interval_seconds is not None or self.interval_seconds is not None:
            return IntervalTrigger(seconds=self.interval_of(group), timezone=UTC)
        return CronTrigger(second=self.lag_seconds, timezone=UTC)

    def start(self) -> None:
        """Restore the state, then re-push the restored alerts (:meth:`resend`, in a thread of
        its own, at once) and run every group on its schedule in a background thread.

        Raises:
            RuntimeError: already started (one scheduler per agent).
        """
        if self._scheduler is not None:
            raise RuntimeError("the rule scheduler is already started")
        self._stopping.clear()
        self.restore()
        scheduler = BackgroundScheduler(timezone=UTC)
        self.missed.listen(scheduler)
        # not an APScheduler date job: a job removed after its one run races shutdown in 3.x
        self._resender = threading.Thread(target=self.resend, name="kvscope-alert-resend", daemon=True)
        self._resender.start()
        for group in self.rules.groups:
            scheduler.add_job(
                self.run_group,
                self.trigger(group),
                args=(group,),
                id=job_id(group),
                name=f"kvscope rule group {group.name}",
                max_instances=1,
                coalesce=True,
                misfire_grace_time=max(1, int(self.interval_of(group) // 2)),
            )
        scheduler.start()
        self._scheduler = scheduler

    def shutdown(self) -> None:
        """Stop, waiting for a running evaluation; the start-up re-push stops before its next
        group and is waited for at most :data:`RESEND_JOIN_SECONDS` (a push to an Alertmanager
        that does not answer goes on in its daemon thread until its deadline). Idempotent."""
        scheduler, self._scheduler = self._scheduler, None
        resender, self._resender = self._resender, None
        self._stopping.set()
        if resender is not None:
            resender.join(RESEND_JOIN_SECONDS)
            if resender.is_alive():
                log.warning("stopping without waiting for the start-up re-push: an Alertmanager has not answered it")
        if scheduler is not None:
            scheduler.shutdown(wait=True)
