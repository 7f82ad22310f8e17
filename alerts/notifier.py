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
  ``endsAt`` lease of ``lease_intervals`` evaluation intervals, resolved ones with their resolve
  time for ``resolve_resend`` after it. Failures are logged, counted and written to ``alerts``.

Metrics: ``kvscope_alert_notifications_total`` / ``kvscope_alert_notifications_failed_total``
(by receiver and integration) and ``kvscope_alertmanager_alerts_sent_total`` /
``kvscope_alertmanager_errors_total`` (by Alertmanager), after Alertmanager's
``alertmanager_notifications_*`` and Prometheus's ``prometheus_notifications_*``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import httpx
from prometheus_client import CollectorRegistry, Counter

from agent.store import Store
from alerts.alert_store import (
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
from alerts.routing import Alert, Dispatch, GroupState, dispatch, owed_resolves

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
        self._groups: dict[str, GroupState] = {}
        self._notified: dict[str, NotifiedAlert] = {}
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
            return dict(self._groups)

    def restore(self) -> None:
        """Load the notification log from the store."""
        groups, notified = load_groups(self.store)
        with self._lock:
            self._groups, self._notified = groups, notified

    def close(self) -> None:
        if self._own_client:
            self.client.close()

    # -- routed receivers ------------------------------------------------------------------------
    def route(self, alerts: Sequence[OutgoingAlert], now: float, *, budget_seconds: float) -> list[Attempt]:
        """Route every known alert at ``now`` and deliver the notifications due, within
        ``budget_seconds``; returns the attempts. Serialised: one routing pass at a time.

        Raises:
            duckdb.Error: the store failed while saving the log (the deliveries happened; the
                next pass retries them, at-least-once).
        """
        deadline = self.monotonic() + budget_seconds
        with self._lock:
            known = {o.alert.fingerprint: o for o in alerts}
            for fp in owed_resolves(self._groups) - set(known):  # resolves owed for alerts gone from the state
                seen = self._notified.get(fp)
                if seen is not None:
                    alert = Alert(fingerprint=fp, labels=seen.labels, firing=False, annotations=seen.annotations)
                    known[fp] = OutgoingAlert(alert=alert, name=seen.alert, starts_at=seen.starts_at, resolved_at=now)
            silences = load_silences(self.store, ended_after=now)
            before = self._groups
            after, sends = dispatch(
                self.config.route,
                [o.alert for o in known.values()],
                now,
                before,
                inhibit_rules=self.config.inhibit_rules,
                silences=silences,
            )
            attempts = self._deliver_all(sends, known, now, deadline)
            for attempt in attempts:
                if attempt.ok:
                    continue
                key = attempt.dispatch.group_key
                old = before.get(key)
                # not delivered: the group stays as it was (retried at the next pass)
                after[key] = old if old is not None else replace(after[key], last_sent_at=None, last_firing=frozenset())
            notified = dict(self._notified)
            for attempt in attempts:
                if attempt.ok:
                    for a in attempt.dispatch.firing:
                        o = known[a.fingerprint]
                        notified[a.fingerprint] = NotifiedAlert(
                            alert=o.name, labels=a.labels, annotations=a.annotations, starts_at=o.starts_at
                        )
            owed = owed_resolves(after)
            notified = {fp: n for fp, n in notified.items() if fp in owed}
            rows = [row for attempt in attempts for row in self._rows(attempt, known, now)]
            with self.store.transaction() as cur:
                save_groups(cur, before, after, notified, now)
                insert_alert_rows(cur, rows)
            self._groups, self._notified = after, notified
        return attempts

    def _deliver_all(
        self, sends: Sequence[Dispatch], known: Mapping[str, OutgoingAlert], now: float, deadline: float
    ) -> list[Attempt]:
        if not sends:
            return []
        starts = {fp: o.starts_at for fp, o in known.items()}
        with ThreadPoolExecutor(max_workers=min(8, len(sends)), thread_name_prefix="kvscope-notify") as pool:
            futures = [pool.submit(self._deliver_one, d, now, starts, deadline) for d in sends]
            return [f.result() for f in futures]

    def _deliver_one(self, d: Dispatch, now: float, starts: Mapping[str, float], deadline: float) -> Attempt:
        receiver = self.config.receivers[d.receiver]
        errors: dict[str, str] = {}
        for name, integration in receiver.integrations:
            payload_dispatch = d if _sends_resolved(integration) else replace(d, resolved=())
            if not payload_dispatch.firing and not payload_dispatch.resolved:
                continue  # only resolves, and this integration does not send them
            self.sent.labels(receiver=d.receiver, integration=name).inc()
            try:
                self._send(integration, payload_dispatch, now, starts, deadline)
            except (DeliveryError, OSError) as exc:
                self.failed.labels(receiver=d.receiver, integration=name).inc()
                errors[name] = str(exc)
                log.error("notification for %s to %s/%s failed: %s", d.group_key, d.receiver, name, exc)
        return Attempt(d, errors)

    def _send(self, integration: Integration, d: Dispatch, now: float, starts: Mapping[str, float], deadline: float) -> None:
        if isinstance(integration, LogConfig):
            body = webhook_payload(d, now=now, external_url=self.external_url, starts_at=starts)
            append_jsonl(integration.path, [body])
            return
        if isinstance(integration, WebhookConfig):
            body = webhook_payload(
                d, now=now, external_url=self.external_url, starts_at=starts, max_alerts=integration.max_alerts
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
    def push(self, alerts: Sequence[OutgoingAlert], now: float, *, interval_seconds: float, budget_seconds: float) -> int:
        """Send one rule group's alerts to every configured Alertmanager: the firing ones, and
        those resolved within ``resolve_resend``. Returns how many pushes failed.

        Raises:
            duckdb.Error: the store failed while recording a failure.
        """
        d = self.config.delivery
        batch = [o for o in alerts if o.alert.firing or (o.resolved_at is not None and now - o.resolved_at < d.resolve_resend_seconds)]
        if not batch or not self.config.alertmanagers:
            return 0
        body = alertmanager_alerts(
            [o.alert for o in batch],
            now=now,
            starts_at={o.alert.fingerprint: o.starts_at for o in batch},
            ends_at={o.alert.fingerprint: o.resolved_at for o in batch if o.resolved_at is not None},
            lease_seconds=d.lease_intervals * interval_seconds,
            generator_url=self.external_url,
        )
        deadline = self.monotonic() + budget_seconds
        failures = 0
        rows = []
        for target in self.config.alertmanagers:
            try:
                self._post(f"{target.url}/api/v2/alerts", body, deadline)
            except DeliveryError as exc:
                failures += 1
                self.am_errors.labels(alertmanager=target.url).inc()
                log.error("push to Alertmanager %s failed: %s", target.url, exc)
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
                        receiver=f"alertmanager {target.url}",
                        error=str(exc),
                    )
                    for o in batch
                ]
            else:
                self.am_sent.labels(alertmanager=target.url).inc(len(batch))
        if rows:
            with self.store.transaction() as cur:
                insert_alert_rows(cur, rows)
        return failures


def _sends_resolved(integration: Integration) -> bool:
    return integration.send_resolved
