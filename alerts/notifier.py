"""Sends what the evaluator decided: :class:`Notifier` (issue 7, items 4 and 5).

Two paths, both run by the rule scheduler after each evaluation:

* :meth:`Notifier.route` — Alertmanager's job, done in the agent: every known alert (firing, or
  resolved and not yet reported) goes through the routing tree, grouping, inhibition and the
  stored silences (:func:`alerts.routing.dispatch`); each notification due is delivered to its
  receiver's integrations (webhook v4, PagerDuty Events v2, Slack-style, JSONL log) in parallel,
  within a deadline before the next evaluation. A group's notification log entry (when it last
  notified, which alerts it held firing) advances only when every integration of its receiver
  took the notification, so a failed one is retried at the next evaluation (at-least-once, as
  Alertmanager). The log lives in ``alert_groups`` with the ``alerts`` rows of the attempt
  (``notified`` or ``delivery_failed`` with the error), written in one transaction: a restart
  neither re-pages nor forgets an owed resolve.
* :meth:`Notifier.push` — Prometheus's job: the alerts of the evaluated rule group go to every
  configured Alertmanager (``POST /api/v2/alerts``) at each evaluation, firing ones with an
  ``endsAt`` lease of ``lease_intervals`` evaluation intervals plus ``restart_margin``
  (:meth:`alerts.notify_config.Delivery.lease_seconds`), resolved ones with their resolve time
  for ``resolve_resend`` after it. Failures are logged, counted and written to ``alerts``.

Metrics: ``kvscope_alert_notifications_total`` / ``kvscope_alert_notifications_failed_total``
(by receiver and integration) and ``kvscope_alertmanager_alerts_sent_total`` /
``kvscope_alertmanager_errors_total`` (by Alertmanager), after Alertmanager's
``alertmanager_notifications_*`` and Prometheus's ``prometheus_notifications_*``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import httpx
from prometheus_client import CollectorRegistry, Counter

from agent.store import Store
from alerts.alert_store import (
    GroupLog,
    NotifiedAlert,
    alert_row,
    append_jsonl,
    insert_alert_rows,
    load_groups,
    load_silences,
    save_groups,
)
from alerts.notify_config import (
    Integration,
    LogConfig,
    NotifyConfig,
    PagerDutyConfig,
    SlackConfig,
    WebhookConfig,
)
from alerts.receivers import (
    DeliveryError,
    alertmanager_alerts,
    deliver,
    pagerduty_events,
    slack_payload,
    webhook_payload,
)
from alerts.routing import (
    Alert,
    Dispatch,
    GroupState,
    dispatch,
    group_key,
    owed_resolves,
    route_alert,
)

log = logging.getLogger(__name__)

MIN_ATTEMPT_TIMEOUT_SECONDS = 0.1


@dataclass(frozen=True, slots=True, kw_only=True)
class OutgoingAlert:
    """An alert as the scheduler hands it over: the router's view plus its alert name and times."""

    alert: Alert
    name: str
    starts_at: float
    resolved_at: float | None = None


@dataclass(frozen=True, slots=True)
class Attempt:
    """One notification's delivery to one receiver: which integrations failed, and why."""

    dispatch: Dispatch
    errors: Mapping[str, str]
    took: tuple[str, ...] = ()
    """Integrations that have the notification (sent now, or with nothing for them to send)."""

    @property
    def ok(self) -> bool:
        return not self.errors


class Notifier:
    """Routes and delivers alerts (module docstring).

    Args:
        store: the agent's store (notification log, silences, ``alerts`` rows).
        config: the notification file.
        registry: where the delivery counters are registered.
        external_url: the agent's URL, put in payloads (``externalURL``, ``generatorURL``).
        client: the HTTP client for every delivery (default: a new ``httpx.Client``).
        clock: unix seconds; ``sleep``: backoff waits; ``monotonic``: the clock of delivery
            deadlines (all injectable for tests).
    """

    def __init__(
        self,
        *,
        store: Store,
        config: NotifyConfig,
        registry: CollectorRegistry,
        external_url: str,
        client: httpx.Client | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.config = config
        self.external_url = external_url
        self.client = client if client is not None else httpx.Client(timeout=config.delivery.timeout_seconds)
        self._own_client = client is None
        self.clock = clock
        self.sleep = sleep
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._log: dict[str, GroupLog] = {}
        self._notified: dict[str, NotifiedAlert] = {}
        self._last_now: float | None = None
        self.sent = Counter(
            "kvscope_alert_notifications_total",
            "Notifications attempted, by receiver and integration.",
            ("receiver", "integration"),
            registry=registry,
        )
        self.failed = Counter(
            "kvscope_alert_notifications_failed_total",
            "Notifications not delivered after every attempt, by receiver and integration.",
            ("receiver", "integration"),
            registry=registry,
        )
        self.am_sent = Counter(
            "kvscope_alertmanager_alerts_sent_total",
            "Alerts sent to an Alertmanager (POST /api/v2/alerts), by Alertmanager URL.",
            ("alertmanager",),
            registry=registry,
        )
        self.am_errors = Counter(
            "kvscope_alertmanager_errors_total",
            "Pushes to an Alertmanager that failed after every attempt, by Alertmanager URL.",
            ("alertmanager",),
            registry=registry,
        )
        for name, receiver in config.receivers.items():
            for integration, _ in receiver.integrations:
                self.sent.labels(receiver=name, integration=integration)
                self.failed.labels(receiver=name, integration=integration)
        for target in config.alertmanagers:
            self.am_sent.labels(alertmanager=target.url)
            self.am_errors.labels(alertmanager=target.url)

    @property
    def groups(self) -> dict[str, GroupState]:
        with self._lock:
            return {key: log.state for key, log in self._log.items()}

    def restore(self) -> None:
        """Load the notification log from the store."""
        log_, notified = load_groups(self.store)
        with self._lock:
            self._log, self._notified = log_, notified

    def close(self) -> None:
        """Close the HTTP client (when the notifier made it); no delivery works after this."""
        if self._own_client:
            self.client.close()

    # -- routed receivers ------------------------------------------------------------------------
    def route(
        self,
        alerts: Sequence[OutgoingAlert] | Callable[[], Sequence[OutgoingAlert]],
        now: float,
        *,
        deadline: float | None = None,
        budget_seconds: float = 10.0,
    ) -> list[Attempt]:
        """Route every known alert at ``now`` and deliver the notifications due before
        ``deadline`` (``monotonic`` seconds; default: ``budget_seconds`` from now); returns the
        attempts. Serialised: one routing pass at a time; ``alerts`` may be a callable, read once
        the pass holds the lock (so a pass never routes an older view than the one before it).

        Raises:
            duckdb.Error: the store failed while saving the log (the deliveries happened; the
                next pass retries them, at-least-once).
        """
        with self._lock:
            if deadline is None:
                deadline = self.monotonic() + budget_seconds
            current = alerts() if callable(alerts) else alerts
            if self._last_now is not None:
                now = max(now, self._last_now)  # passes from different rule groups never go back in time
            self._last_now = now
            known = {o.alert.fingerprint: o for o in current}
            for fp in owed_resolves(self.groups_state()) - set(known):  # owed resolves of alerts gone from the state
                seen = self._notified.get(fp)
                if seen is not None:
                    alert = Alert(fingerprint=fp, labels=seen.labels, firing=False, annotations=seen.annotations)
                    known[fp] = OutgoingAlert(alert=alert, name=seen.alert, starts_at=seen.starts_at, resolved_at=now)
            silences = load_silences(self.store, ended_after=now)
            before = self._log
            states, sends = dispatch(
                self.config.route,
                [o.alert for o in known.values()],
                now,
                self.groups_state(),
                inhibit_rules=self.config.inhibit_rules,
                silences=silences,
            )
            groups_of = self._groups_of(known.values())
            orphan_sends, orphans = self._orphan_resolves(states, known, groups_of)
            sends += orphan_sends
            attempts = self._deliver_all(sends, known, now, deadline)
            after = self._next_log(before, states, groups_of, attempts, orphans, now)
            notified = dict(self._notified)
            for attempt in attempts:
                if attempt.ok:
                    for a in attempt.dispatch.firing:
                        o = known[a.fingerprint]
                        notified[a.fingerprint] = NotifiedAlert(
                            alert=o.name, labels=a.labels, annotations=a.annotations, starts_at=o.starts_at
                        )
            owed = owed_resolves({key: log.state for key, log in after.items()})
            notified = {fp: n for fp, n in notified.items() if fp in owed}
            rows = [row for attempt in attempts for row in self._rows(attempt, known, now)]
            with self.store.transaction() as cur:
                save_groups(cur, before, after, notified, now)
                insert_alert_rows(cur, rows)
            self._log, self._notified = after, notified
        return attempts

    def groups_state(self) -> dict[str, GroupState]:
        """The routing state of every group (call with the lock held)."""
        return {key: log.state for key, log in self._log.items()}

    def _groups_of(self, alerts: Iterable[OutgoingAlert]) -> dict[str, tuple[str, dict[str, str]]]:
        """The aggregation groups the alerts route to now: key → (receiver, grouping labels)."""
        out: dict[str, tuple[str, dict[str, str]]] = {}
        for o in alerts:
            for route in route_alert(self.config.route, o.alert.labels):
                key, labels = group_key(route, o.alert.labels)
                out[key] = (route.receiver, labels)
        return out

    def _orphan_resolves(
        self, states: dict[str, GroupState], known: Mapping[str, OutgoingAlert], groups_of: Mapping[str, object]
    ) -> tuple[list[Dispatch], set[str]]:
        """Groups that still owe resolves but that no alert routes to any more (the route or its
        ``group_by`` changed since they notified): once their alerts are all resolved, the
        resolves go to the receiver they paged, with the labels they paged with, and the group is
        dropped (as soon as that delivery succeeds). Returns those notifications and the groups'
        keys."""
        sends: list[Dispatch] = []
        orphans: set[str] = set()
        for key, state in states.items():
            log_ = self._log.get(key)
            if key in groups_of or not state.last_firing or log_ is None:
                continue
            if any(fp in known and known[fp].alert.firing for fp in state.last_firing):
                continue  # still firing under the new routing: resolved here later
            orphans.add(key)
            if log_.receiver not in self.config.receivers:
                log.warning("group %s paged receiver %s, which the notification file no longer has: its resolves are dropped", key, log_.receiver)
                continue
            resolved = tuple(
                Alert(fingerprint=fp, labels=known[fp].alert.labels, firing=False, annotations=known[fp].alert.annotations)
                for fp in sorted(state.last_firing)
                if fp in known
            )
            if resolved:
                sends.append(Dispatch(receiver=log_.receiver, group_key=key, group_labels=log_.group_labels, firing=(), resolved=resolved))
        return sends, orphans

    def _next_log(
        self,
        before: Mapping[str, GroupLog],
        states: dict[str, GroupState],
        groups_of: Mapping[str, tuple[str, dict[str, str]]],
        attempts: Sequence[Attempt],
        orphans: set[str],
        now: float,
    ) -> dict[str, GroupLog]:
        """The log after this pass: a group advances only when every integration of its receiver
        took the notification (now or in an earlier pass of the same notification); otherwise it
        stays as it was and is retried, and each integration that took it remembers so."""
        by_key = {a.dispatch.group_key: a for a in attempts}
        after: dict[str, GroupLog] = {}
        for key, state in states.items():
            old = before.get(key)
            attempt = by_key.get(key)
            if key in orphans and (attempt is None or attempt.ok):
                continue  # its resolves went out (or have nowhere to go): the group is done
            if attempt is None:
                if old is not None:
                    after[key] = replace(old, state=state)
                else:
                    receiver, labels = groups_of[key]
                    after[key] = GroupLog(state=state, receiver=receiver, group_labels=labels, delivered={})
                continue
            d = attempt.dispatch
            delivered = dict(old.delivered) if old is not None else {}
            firing = frozenset(a.fingerprint for a in d.firing)
            for name in attempt.took:
                delivered[name] = (firing, now)
            if attempt.ok:
                after[key] = GroupLog(state=state, receiver=d.receiver, group_labels=d.group_labels, delivered=delivered)
            elif old is not None:
                after[key] = replace(old, delivered=delivered)
            else:
                after[key] = GroupLog(
                    state=replace(state, last_sent_at=None, last_firing=frozenset()),
                    receiver=d.receiver,
                    group_labels=d.group_labels,
                    delivered=delivered,
                )
        return after

    def _deliver_all(
        self, sends: Sequence[Dispatch], known: Mapping[str, OutgoingAlert], now: float, deadline: float
    ) -> list[Attempt]:
        if not sends:
            return []
        starts = {fp: o.starts_at for fp, o in known.items()}
        ends = {fp: o.resolved_at for fp, o in known.items() if o.resolved_at is not None}
        with ThreadPoolExecutor(max_workers=min(8, len(sends)), thread_name_prefix="kvscope-notify") as pool:
            futures = [pool.submit(self._deliver_one, d, now, starts, ends, deadline) for d in sends]
            return [f.result() for f in futures]

    def _deliver_one(
        self, d: Dispatch, now: float, starts: Mapping[str, float], ends: Mapping[str, float], deadline: float
    ) -> Attempt:
        receiver = self.config.receivers[d.receiver]
        log_ = self._log.get(d.group_key)
        errors: dict[str, str] = {}
        took: list[str] = []
        firing = frozenset(a.fingerprint for a in d.firing)
        for name, integration in receiver.integrations:
            if log_ is not None and name in log_.delivered:
                had, at = log_.delivered[name]
                last_full = log_.state.last_sent_at
                already = had == firing and not ({a.fingerprint for a in d.resolved} & had)
                if already and (last_full is None or at > last_full):
                    continue  # it took this notification in an earlier pass; another integration failed
            payload_dispatch = d if integration.send_resolved else replace(d, resolved=())
            if not payload_dispatch.firing and not payload_dispatch.resolved:
                took.append(name)  # only resolves, and this integration does not send them
                continue
            self.sent.labels(receiver=d.receiver, integration=name).inc()
            try:
                self._send(integration, payload_dispatch, now, starts, ends, deadline)
            except (DeliveryError, OSError) as exc:
                self.failed.labels(receiver=d.receiver, integration=name).inc()
                errors[name] = str(exc)
                log.error("notification for %s to %s/%s failed: %s", d.group_key, d.receiver, name, exc)
            else:
                took.append(name)
        return Attempt(d, errors, tuple(took))

    def _send(
        self,
        integration: Integration,
        d: Dispatch,
        now: float,
        starts: Mapping[str, float],
        ends: Mapping[str, float],
        deadline: float,
    ) -> None:
        if isinstance(integration, LogConfig):
            body = webhook_payload(d, now=now, external_url=self.external_url, starts_at=starts, ends_at=ends)
            append_jsonl(integration.path, [body])
            return
        if isinstance(integration, WebhookConfig):
            body = webhook_payload(
                d, now=now, external_url=self.external_url, starts_at=starts, ends_at=ends, max_alerts=integration.max_alerts
            )
            self._post(integration.url, body, deadline)
        elif isinstance(integration, PagerDutyConfig):
            for event in pagerduty_events(d, routing_key=integration.routing_key, source=integration.source):
                self._post(integration.url, event, deadline)
        elif isinstance(integration, SlackConfig):
            self._post(integration.api_url, slack_payload(d), deadline)
        else:  # pragma: no cover - the config types are closed
            raise TypeError(f"unknown integration {integration!r}")

    def _post(self, url: str, payload: object, deadline: float) -> None:
        d = self.config.delivery
        left = max(deadline - self.monotonic(), MIN_ATTEMPT_TIMEOUT_SECONDS)
        timeout = max(min(d.timeout_seconds, left / d.attempts), MIN_ATTEMPT_TIMEOUT_SECONDS)
        deliver(
            self.client,
            url,
            payload,
            attempts=d.attempts,
            backoff_seconds=d.backoff_seconds,
            max_backoff_seconds=d.max_backoff_seconds,
            timeout_seconds=timeout,
            deadline=deadline,
            sleep=self.sleep,
            clock=self.monotonic,
        )

    def _rows(self, attempt: Attempt, known: Mapping[str, OutgoingAlert], now: float) -> list[dict[str, object]]:
        d = attempt.dispatch
        rows = []
        for a in (*d.firing, *d.resolved):
            base = {
                "at": now,
                "alert": known[a.fingerprint].name,
                "fingerprint": a.fingerprint,
                "state": "firing" if a.firing else "resolved",
                "value": a.value,
                "labels": a.labels,
                "summary": a.annotations.get("summary", ""),
                "description": a.annotations.get("description", ""),
            }
            if attempt.ok:
                rows.append(alert_row(**base, event="notified", receiver=d.receiver))  # type: ignore[arg-type]
            for integration, error in sorted(attempt.errors.items()):
                rows.append(
                    alert_row(**base, event="delivery_failed", receiver=f"{d.receiver}/{integration}", error=error)  # type: ignore[arg-type]
                )
        return rows

    # -- Alertmanager API v2 ----------------------------------------------------------------------
    def push(
        self,
        alerts: Sequence[OutgoingAlert],
        now: float,
        *,
        interval_seconds: float,
        deadline: float | None = None,
        budget_seconds: float = 10.0,
    ) -> int:
        """Send one rule group's alerts to every configured Alertmanager, in parallel, before
        ``deadline`` (``monotonic`` seconds; default ``budget_seconds`` from now): the firing
        ones, and those resolved within ``resolve_resend``. Returns how many pushes failed.

        Raises:
            duckdb.Error: the store failed while recording a failure.
        """
        d = self.config.delivery
        batch = [o for o in alerts if o.alert.firing or (o.resolved_at is not None and now - o.resolved_at < d.resolve_resend_seconds)]
        if not batch or not self.config.alertmanagers:
            return 0
        if deadline is None:
            deadline = self.monotonic() + budget_seconds
        body = alertmanager_alerts(
            [o.alert for o in batch],
            now=now,
            starts_at={o.alert.fingerprint: o.starts_at for o in batch},
            ends_at={o.alert.fingerprint: o.resolved_at for o in batch if o.resolved_at is not None},
            lease_seconds=d.lease_seconds(interval_seconds),
            generator_url=self.external_url,
        )

        def one(url: str) -> str | None:
            try:
                self._post(f"{url}/api/v2/alerts", body, deadline)
            except DeliveryError as exc:
                return str(exc)
            return None

        targets = [t.url for t in self.config.alertmanagers]
        with ThreadPoolExecutor(max_workers=min(8, len(targets)), thread_name_prefix="kvscope-push") as pool:
            errors = list(pool.map(one, targets))
        rows = []
        for url, error in zip(targets, errors, strict=True):
            if error is None:
                self.am_sent.labels(alertmanager=url).inc(len(batch))
                continue
            self.am_errors.labels(alertmanager=url).inc()
            log.error("push to Alertmanager %s failed: %s", url, error)
            rows += [
                alert_row(
                    at=now,
                    alert=o.name,
                    fingerprint=o.alert.fingerprint,
                    state="firing" if o.alert.firing else "resolved",
                    value=o.alert.value,
                    labels=o.alert.labels,
                    summary=o.alert.annotations.get("summary", ""),
                    description=o.alert.annotations.get("description", ""),
                    event="delivery_failed",
                    receiver=f"alertmanager {url}",
                    error=error,
                )
                for o in batch
            ]
        if rows:
            with self.store.transaction() as cur:
                insert_alert_rows(cur, rows)
        return sum(e is not None for e in errors)
