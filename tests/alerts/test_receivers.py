"""Receiver payloads (Alertmanager API v2 and webhook v4, PagerDuty Events v2, Slack) and
delivery with retries (issue 7, item 5)."""

from __future__ import annotations

import json

import httpx
import pytest

from alerts.receivers import (
    DeliveryError,
    alertmanager_alerts,
    deliver,
    pagerduty_events,
    slack_payload,
    webhook_payload,
)
from alerts.routing import Alert, Dispatch

T = 1_800_000_000.0
FIRING = Alert(fingerprint="f1", labels={"alertname": "Drop", "engine": "e1", "severity": "page"}, firing=True, annotations={"summary": "e1 dropped"}, value=0.3)
RESOLVED = Alert(fingerprint="f2", labels={"alertname": "Drop", "engine": "e2", "severity": "page"}, firing=False, annotations={"summary": "e2 dropped"}, value=0.7)
GROUP = Dispatch(receiver="oncall", group_key='root:{alertname="Drop"}', group_labels={"alertname": "Drop"}, firing=(FIRING,), resolved=(RESOLVED,))


def test_alertmanager_v2_leases_firing_and_resolves_explicitly() -> None:
    body = alertmanager_alerts([FIRING, RESOLVED], now=T, starts_at={"f1": T - 120}, lease_seconds=300, generator_url="http://agent/")
    assert body == [
        {"labels": dict(FIRING.labels), "annotations": {"summary": "e1 dropped"}, "startsAt": "2027-01-15T07:58:00Z", "endsAt": "2027-01-15T08:05:00Z", "generatorURL": "http://agent/"},
        {"labels": dict(RESOLVED.labels), "annotations": {"summary": "e2 dropped"}, "startsAt": "2027-01-15T08:00:00Z", "endsAt": "2027-01-15T08:00:00Z", "generatorURL": "http://agent/"},
    ]  # fmt: skip


def test_webhook_v4_payload() -> None:
    body = webhook_payload(GROUP, now=T, external_url="http://agent/", starts_at={"f1": T - 60, "f2": T - 600})
    assert body["version"] == "4" and body["status"] == "firing" and body["receiver"] == "oncall"
    assert body["groupKey"] == 'root:{alertname="Drop"}' and body["truncatedAlerts"] == 0
    assert body["commonLabels"] == {"alertname": "Drop", "severity": "page"}
    assert body["commonAnnotations"] == {}
    assert [(a["status"], a["fingerprint"], a["endsAt"]) for a in body["alerts"]] == [  # type: ignore[union-attr]
        ("firing", "f1", "0001-01-01T00:00:00Z"),
        ("resolved", "f2", "2027-01-15T08:00:00Z"),
    ]
    json.dumps(body)  # serialisable


def test_pagerduty_events_v2() -> None:
    events = pagerduty_events(GROUP, routing_key="R0UT1NG", source="kvscope-agent")
    assert events == [
        {
            "routing_key": "R0UT1NG", "event_action": "trigger", "dedup_key": "f1",
            "payload": {"summary": "e1 dropped", "source": "kvscope-agent", "severity": "critical",
                        "custom_details": {"labels": dict(FIRING.labels), "value": 0.3}},
        },
        {"routing_key": "R0UT1NG", "event_action": "resolve", "dedup_key": "f2"},
    ]  # fmt: skip


def test_slack_payload() -> None:
    assert slack_payload(GROUP) == {"text": '[FIRING] oncall root:{alertname="Drop"}\n🔥 e1 dropped\n✅ e2 dropped'}


def test_deliver_retries_5xx_and_timeouts_then_succeeds() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 1:
            raise httpx.ReadTimeout("slow", request=request)
        if len(calls) == 2:
            return httpx.Response(503)
        assert json.loads(request.content) == {"text": "hi"}
        return httpx.Response(200)

    slept: list[float] = []
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        deliver(client, "http://receiver/", {"text": "hi"}, attempts=3, backoff_seconds=0.5, sleep=slept.append)
    assert len(calls) == 3 and slept == [0.5, 1.0]


def test_deliver_gives_up_and_does_not_retry_a_refusal() -> None:
    failing = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    with failing as client, pytest.raises(DeliveryError, match="after 2 attempts"):
        deliver(client, "http://receiver/", {}, attempts=2, sleep=lambda s: None)
    calls: list[int] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(400, text="bad payload")

    refusing = httpx.Client(transport=httpx.MockTransport(refuse))
    with refusing as client, pytest.raises(DeliveryError, match="refused the notification"):
        deliver(client, "http://receiver/", {}, attempts=3, sleep=lambda s: None)
    assert calls == [1]


def test_deliver_honours_retry_after_retries_408_and_refuses_non_json() -> None:
    answers = iter([httpx.Response(429, headers={"retry-after": "3"}), httpx.Response(408), httpx.Response(204)])
    slept: list[float] = []
    with httpx.Client(transport=httpx.MockTransport(lambda r: next(answers))) as client:
        deliver(client, "http://receiver/", {"ok": 1}, attempts=3, backoff_seconds=0.5, max_backoff_seconds=5, sleep=slept.append)
    assert slept == [3.0, 1.0]
    with httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200))) as client, pytest.raises(DeliveryError, match="not JSON"):
        deliver(client, "http://receiver/", {"value": float("inf")})
