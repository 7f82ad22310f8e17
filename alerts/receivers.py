"""Alert receivers (issue 7, item 5): the payloads of each peer's API, and delivery with a
timeout, retries with capped exponential backoff and counted failures.

Payloads (pure functions of a :class:`alerts.routing.Dispatch` or of alerts):

* **Alertmanager API v2** (``POST /api/v2/alerts``): a list of alerts with ``labels``,
  ``annotations``, ``startsAt``, ``endsAt``, ``generatorURL``. A firing alert is sent with an
  ``endsAt`` lease of several evaluation intervals (re-sent every evaluation while it fires, so
  Alertmanager keeps it); a resolved one with ``endsAt`` = now, an explicit resolve.
* **Webhook** in Alertmanager's webhook format, version 4: ``receiver``, ``status``, ``alerts``
  (each with ``fingerprint``), ``groupLabels``, ``commonLabels``, ``commonAnnotations``,
  ``externalURL``, ``groupKey``, ``truncatedAlerts``.
* **PagerDuty Events API v2**: one event per alert, ``routing_key``, ``event_action``
  (``trigger``/``resolve``), ``dedup_key`` (the alert's fingerprint: stable across
  evaluations), ``payload.summary/source/severity``.
* **Slack-style incoming webhook**: ``{"text": ...}`` with one line per alert.

Timestamps are RFC 3339 in UTC.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime

import httpx

from alerts.routing import Alert, Dispatch

log = logging.getLogger(__name__)

PAGERDUTY_SEVERITY = {"page": "critical", "ticket": "warning", "info": "info"}
"""kvscope severity label → PagerDuty's ``payload.severity``."""


def rfc3339(unix_seconds: float) -> str:
    return datetime.fromtimestamp(unix_seconds, UTC).isoformat().replace("+00:00", "Z")


def alertmanager_alerts(
    alerts: Sequence[Alert],
    *,
    now: float,
    starts_at: Mapping[str, float],
    lease_seconds: float,
    generator_url: str,
    ends_at: Mapping[str, float] | None = None,
) -> list[dict[str, object]]:
    """The body of ``POST /api/v2/alerts``: firing alerts leased until ``now + lease_seconds``,
    resolved ones ended when they resolved (``ends_at``, default ``now``). ``starts_at`` maps
    fingerprints to when they became active (default ``now``)."""
    ended = ends_at or {}
    return [
        {
            "labels": dict(alert.labels),
            "annotations": dict(alert.annotations),
            "startsAt": rfc3339(starts_at.get(alert.fingerprint, now)),
            "endsAt": rfc3339(now + lease_seconds if alert.firing else ended.get(alert.fingerprint, now)),
            "generatorURL": generator_url,
        }
        for alert in alerts
    ]


def _common(maps: Sequence[Mapping[str, str]]) -> dict[str, str]:
    if not maps:
        return {}
    first = maps[0]
    return {k: v for k, v in first.items() if all(other.get(k) == v for other in maps[1:])}


def webhook_payload(
    d: Dispatch,
    *,
    now: float,
    external_url: str,
    starts_at: Mapping[str, float],
    max_alerts: int = 0,
    ends_at: Mapping[str, float] | None = None,
) -> dict[str, object]:
    """Alertmanager's webhook payload (version 4) for one group notification; with
    ``max_alerts`` > 0 only the first that many alerts are listed (``truncatedAlerts`` counts
    the rest). A resolved alert's ``endsAt`` is when it resolved (``ends_at``, default ``now``)."""
    ended = ends_at or {}
    everything = [*d.firing, *d.resolved]
    alerts = everything[:max_alerts] if max_alerts else everything
    return {
        "version": "4",
        "groupKey": d.group_key,
        "truncatedAlerts": len(everything) - len(alerts),
        "status": "firing" if d.firing else "resolved",
        "receiver": d.receiver,
        "groupLabels": dict(d.group_labels),
        "commonLabels": _common([a.labels for a in everything]),
        "commonAnnotations": _common([a.annotations for a in everything]),
        "externalURL": external_url,
        "alerts": [
            {
                "status": "firing" if a.firing else "resolved",
                "labels": dict(a.labels),
                "annotations": dict(a.annotations),
                "startsAt": rfc3339(starts_at.get(a.fingerprint, now)),
                "endsAt": "0001-01-01T00:00:00Z" if a.firing else rfc3339(ended.get(a.fingerprint, now)),
                "generatorURL": external_url,
                "fingerprint": a.fingerprint,
            }
            for a in alerts
        ],
    }


def pagerduty_events(d: Dispatch, *, routing_key: str, source: str) -> list[dict[str, object]]:
    """One PagerDuty Events v2 event per alert of the notification."""
    events: list[dict[str, object]] = []
    for a in (*d.firing, *d.resolved):
        event: dict[str, object] = {
            "routing_key": routing_key,
            "event_action": "trigger" if a.firing else "resolve",
            "dedup_key": a.fingerprint,
        }
        if a.firing:
            event["payload"] = {
                "summary": a.annotations.get("summary") or a.labels.get("alertname", "kvscope alert"),
                "source": source,
                "severity": PAGERDUTY_SEVERITY.get(a.labels.get("severity", ""), "error"),
                "custom_details": {"labels": dict(a.labels), "value": a.value},
            }
        events.append(event)
    return events


def slack_payload(d: Dispatch) -> dict[str, object]:
    """A Slack-style incoming-webhook message."""
    lines = [f"[{'FIRING' if d.firing else 'RESOLVED'}] {d.receiver} {d.group_key}"]
    for a in (*d.firing, *d.resolved):
        summary = a.annotations.get("summary") or ", ".join(f"{k}={v}" for k, v in sorted(a.labels.items()))
        lines.append(f"{'🔥' if a.firing else '✅'} {summary}")
    return {"text": "\n".join(lines)}


class DeliveryError(RuntimeError):
    """A receiver did not accept a notification after every attempt."""


def deliver(
    client: httpx.Client,
    url: str,
    payload: object,
    *,
    attempts: int = 3,
    backoff_seconds: float = 0.5,
    max_backoff_seconds: float = 5.0,
    timeout_seconds: float | None = None,
    deadline: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """POST ``payload`` as JSON, retrying connection errors, timeouts, 408, 429 and 5xx with
    capped exponential backoff (a ``Retry-After`` in seconds lengthens the wait, up to
    ``max_backoff_seconds``). ``timeout_seconds`` (default: the client's) bounds each attempt;
    no retry starts that could not end before ``deadline`` (``clock`` seconds), so a delivery
    stays within the evaluation interval.

    Raises:
        DeliveryError: every attempt failed, the receiver refused the payload (another 4xx: not
            retried), or the payload is not JSON (non-finite numbers).
    """
    try:
        body = json.dumps(payload, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise DeliveryError(f"the notification for {url} is not JSON: {exc}") from None
    delay = backoff_seconds
    reason = "no attempt"
    for attempt in range(1, attempts + 1):
        wait = delay
        try:
            response = client.post(
                url,
                content=body,
                headers={"content-type": "application/json"},
                timeout=timeout_seconds if timeout_seconds is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}"
        except (httpx.InvalidURL, ValueError, TypeError) as exc:  # a URL or header httpx refuses: not retried
            raise DeliveryError(f"{url}: cannot send there ({type(exc).__name__}: {exc})") from None
        else:
            if response.status_code < 300:
                return
            reason = f"HTTP {response.status_code}: {response.text[:200]}"
            if response.status_code < 500 and response.status_code not in (408, 429):
                raise DeliveryError(f"{url} refused the notification ({reason})")
            retry_after = response.headers.get("retry-after", "")
            if retry_after.isdigit():
                wait = min(max(wait, float(retry_after)), max_backoff_seconds)
        if attempt == attempts:
            break
        if deadline is not None and clock() + wait + (timeout_seconds or 0.0) > deadline:
            reason += "; no time left for another attempt before the next evaluation"
            break
        log.warning("delivery to %s failed (attempt %d of %d): %s", url, attempt, attempts, reason)
        sleep(wait)
        delay = min(delay * 2, max_backoff_seconds)
    raise DeliveryError(f"{url} did not accept the notification after {attempt} {'attempt' if attempt == 1 else 'attempts'} ({reason})")
