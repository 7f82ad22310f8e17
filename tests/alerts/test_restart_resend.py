"""Alerts across agent restarts (issue 19): the restored firing alerts are re-pushed to the
Alertmanagers at start-up, before any evaluation, with a fresh lease of ``lease_intervals``
intervals plus the restart margin; an alert whose rule was removed is resolved explicitly."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from agent.store import Store
from alerts.notifier import Notifier
from alerts.notify_config import parse_notify_config
from alerts.rule_scheduler import RESEND_JOIN_SECONDS, RuleScheduler
from alerts.rulefile import parse_rule_file

T = 1_800_000_000.0
"""2027-01-15T08:00:00Z."""
ALWAYS = {"alert": "Always", "expr": "SELECT 'e1' AS engine, 1.0 AS value", "labels": {"severity": "page"}}
GONE = {"alert": "Gone", "expr": "SELECT 'e1' AS engine, 2.0 AS value", "labels": {"severity": "ticket"}}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store.open(tmp_path / "k.duckdb")
    yield opened
    opened.close()


class Alertmanager:
    """Records every ``POST /api/v2/alerts`` body."""

    def __init__(self) -> None:
        self.bodies: list[list[dict[str, Any]]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v2/alerts", request.url
        self.bodies.append(json.loads(request.content))
        return httpx.Response(200)


def scheduler(store: Store, tmp_path: Path, am: Alertmanager, rules: list[dict[str, Any]], now: float) -> RuleScheduler:
    notify = parse_notify_config(
        {
            "route": {"receiver": "null"},
            "receivers": [{"name": "null"}],
            "alertmanagers": [{"url": "http://am.test"}],
            "delivery": {"lease_intervals": 4, "restart_margin": "10m"},
        },
        source="notify.yaml",
        data_dir=tmp_path,
    )
    registry = CollectorRegistry()
    client = httpx.Client(transport=httpx.MockTransport(am))
    notifier = Notifier(store=store, config=notify, registry=registry, external_url="http://agent", client=client, clock=lambda: now)
    rule_file = parse_rule_file({"groups": [{"name": "g", "interval": "1h", "rules": rules}]})
    return RuleScheduler(
        store=store, rules=rule_file, log_path=tmp_path / "alerts.log", registry=registry, notifier=notifier, clock=lambda: now
    )


def test_start_re_pushes_restored_alerts_before_any_evaluation(store: Store, tmp_path: Path) -> None:
    am = Alertmanager()
    before = scheduler(store, tmp_path, am, [ALWAYS, GONE], T)
    before.restore(T)
    fired = before.run_group(before.rules.groups[0], T)
    assert sorted((n.alert, n.status.value) for n in fired) == [("Always", "firing"), ("Gone", "firing")]
    [first] = am.bodies
    # the lease: 4 intervals of 1 h plus the 10 min restart margin
    assert {a["labels"]["alertname"]: a["endsAt"] for a in first} == {"Always": "2027-01-15T12:10:00Z", "Gone": "2027-01-15T12:10:00Z"}
    transitions = (tmp_path / "alerts.log").read_text()

    # the agent is killed and comes back 3 h later with the rule Gone removed; the group's next
    # evaluation is an hour after the start, so what reaches Alertmanager now is the re-push
    after = scheduler(store, tmp_path, am, [ALWAYS], T + 3 * 3600)
    after.start()
    try:
        deadline = time.monotonic() + 20
        while len(am.bodies) < 3:
            assert time.monotonic() < deadline, f"no re-push at start: {am.bodies}"
            time.sleep(0.02)
    finally:
        after.shutdown()
    repushed, resolved = am.bodies[1:]
    assert repushed == [
        {
            "labels": {"alertname": "Always", "engine": "e1", "severity": "page"},
            "annotations": {},
            "startsAt": "2027-01-15T08:00:00Z",  # the same alert: it fires on, not anew
            "endsAt": "2027-01-15T15:10:00Z",  # leased again from the restart: 11:00 + 4 h + 10 m
            "generatorURL": "http://agent",
        }
    ]
    assert [(a["labels"], a["endsAt"]) for a in resolved] == [
        ({"alertname": "Gone", "engine": "e1", "severity": "ticket"}, "2027-01-15T11:00:00Z")  # resolved at the restart
    ]
    lines = (tmp_path / "alerts.log").read_text()[len(transitions) :].splitlines()
    assert [(json.loads(x)["alert"], json.loads(x)["status"]) for x in lines] == [("Gone", "resolved")]  # no evaluation ran


def test_resend_without_alertmanagers_or_firing_alerts_sends_nothing(store: Store, tmp_path: Path) -> None:
    am = Alertmanager()
    idle = scheduler(store, tmp_path, am, [ALWAYS], T)
    idle.restore(T)
    assert idle.resend(T) == 0 and am.bodies == []  # nothing restored, nothing pushed
    quiet = RuleScheduler(store=store, rules=idle.rules, log_path=tmp_path / "alerts.log", registry=CollectorRegistry())
    assert quiet.resend(T) == 0  # no notifier at all


class SilentAlertmanager:
    """A loopback socket that accepts connections and never answers (a hung Alertmanager);
    :meth:`close` ends it, resetting the connections it holds."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closing.is_set():
            try:
                self.accepted.append(self.listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self.closing.set()
        self.thread.join(5)
        self.listener.close()
        for conn in self.accepted:
            conn.close()


def test_shutdown_does_not_wait_for_a_re_push_that_an_alertmanager_never_answers(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # two 2-minute groups: each re-push may take 80% of 2 min; a SIGTERM soon after the start
    # must still stop the agent (and checkpoint the store) at once
    groups = [{"name": name, "interval": "2m", "rules": [{**ALWAYS, "alert": f"Always{name}"}]} for name in ("a", "b")]
    rule_file = parse_rule_file({"groups": groups})
    first = RuleScheduler(store=store, rules=rule_file, log_path=tmp_path / "alerts.log", registry=CollectorRegistry(), clock=lambda: T)
    first.restore(T)
    for group in rule_file.groups:
        assert [n.status.value for n in first.run_group(group, T)] == ["firing"]

    hung = SilentAlertmanager()
    notify = parse_notify_config(
        {"route": {"receiver": "null"}, "receivers": [{"name": "null"}], "alertmanagers": [{"url": hung.url}]},
        source="notify.yaml", data_dir=tmp_path,
    )  # fmt: skip
    registry = CollectorRegistry()
    notifier = Notifier(store=store, config=notify, registry=registry, external_url="http://agent", clock=lambda: T + 60)
    after = RuleScheduler(
        store=store, rules=rule_file, log_path=tmp_path / "alerts.log", registry=registry, notifier=notifier, clock=lambda: T + 60
    )
    stopper = threading.Thread(target=after.shutdown, daemon=True)
    try:
        with caplog.at_level(logging.INFO, logger="alerts.rule_scheduler"):
            after.start()
            deadline = time.monotonic() + 10
            while not hung.accepted:  # the re-push of group a is waiting for an answer
                assert time.monotonic() < deadline, "the re-push never reached the Alertmanager"
                time.sleep(0.01)
            [resender] = [t for t in threading.enumerate() if t.name == "kvscope-alert-resend"]
            stopper.start()
            stopper.join(RESEND_JOIN_SECONDS + 5)  # without the stop: 2 × 30 s of attempts
            assert not stopper.is_alive(), "shutdown waited for the hung re-push"
            assert resender.is_alive()  # it did not wait for the push to end
            hung.close()  # the push of group a fails now; the re-push stops before group b
            resender.join(10)
            assert not resender.is_alive()
    finally:
        hung.close()
        stopper.join(10)
    assert len(hung.accepted) == 1  # group b was never pushed
    assert "start-up re-push stopped (the agent is stopping); not re-pushed: rule group(s) [b]" in caplog.text
    assert "stopping without waiting for the start-up re-push" in caplog.text
