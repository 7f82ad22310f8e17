"""Routing and delivery against a real store (issue 7, items 4 and 5): the notification log in
``alert_groups`` (no re-page after a restart, owed resolves kept), delivery failures retried and
visible in ``alerts`` and the metrics, silences and inhibition, the Alertmanager API v2 push with
its ``endsAt`` lease and repeated resolves, and the notification file's strict loading."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from agent.store import Store
from alerts.alert_store import create_silence, expire_silence, load_silences
from alerts.notifier import Notifier, OutgoingAlert
from alerts.notify_config import NotifyConfigError, load_notify_config, parse_notify_config
from alerts.routing import Alert

T = 1_800_000_000.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = Store.open(tmp_path / "k.duckdb")
    yield opened
    opened.close()


class Receiver:
    """Records every POST; answers with ``status`` (a list: one per request, the last repeats)."""

    def __init__(self, *statuses: int) -> None:
        self.statuses = list(statuses) or [200]
        self.posts: list[tuple[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.posts.append((str(request.url), json.loads(request.content)))
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return httpx.Response(status)

    def bodies(self, url_part: str = "") -> list[Any]:
        return [body for url, body in self.posts if url_part in url]


CONFIG = {
    "route": {
        "receiver": "oncall",
        "group_by": ["alertname", "engine"],
        "group_wait": "30s",
        "group_interval": "5m",
        "repeat_interval": "4h",
        "routes": [{"matchers": ['severity="ticket"'], "receiver": "tickets"}],
    },
    "inhibit_rules": [
        {"source_matchers": ['alertname="EngineSilent"'], "target_matchers": ['alertname=~"Recoverable.*"'], "equal": ["engine"]}
    ],
    "receivers": [
        {
            "name": "oncall",
            "webhook_configs": [{"url": "http://hook.test/alerts"}],
            "pagerduty_configs": [{"routing_key": "rk", "url": "http://pd.test/v2/enqueue"}],
        },
        {"name": "tickets", "slack_configs": [{"api_url": "http://slack.test/hook"}], "log_configs": [{"path": "tickets.jsonl"}]},
    ],
    "alertmanagers": [{"url": "http://am.test:9093/"}],
    "delivery": {"attempts": 2, "backoff": "10ms", "lease_intervals": 4, "resolve_resend": "5m"},
}


def notifier(store: Store, tmp_path: Path, receiver: Receiver, registry: CollectorRegistry | None = None) -> Notifier:
    config = parse_notify_config(CONFIG, source="notify.yaml", data_dir=tmp_path)
    n = Notifier(
        store=store,
        config=config,
        registry=registry or CollectorRegistry(),
        external_url="http://agent.test:9400",
        client=httpx.Client(transport=httpx.MockTransport(receiver)),
        sleep=lambda s: None,
    )
    n.restore()
    return n


def alert(name: str = "RecoverableHitRateDrop", engine: str = "e1", *, firing: bool = True, severity: str = "page", resolved_at: float | None = None) -> OutgoingAlert:
    labels = {"alertname": name, "engine": engine, "severity": severity}
    return OutgoingAlert(
        alert=Alert(fingerprint=f"{name}-{engine}", labels=labels, firing=firing, annotations={"summary": f"{name} on {engine}"}, value=0.4),
        name=name,
        starts_at=T - 120,
        resolved_at=resolved_at,
    )


def rows(store: Store, where: str = "true") -> list[tuple[Any, ...]]:
    with store.cursor() as cur:
        return cur.execute(f"SELECT event, state, alert, receiver, error FROM alerts WHERE {where} ORDER BY ts, receiver, error").fetchall()


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_group_wait_then_one_page_no_repage_after_restart_and_the_resolve(store: Store, tmp_path: Path) -> None:
    hook = Receiver()
    n = notifier(store, tmp_path, hook)
    assert n.route([alert()], T, budget_seconds=5) == []  # group_wait 30 s
    sent = n.route([alert()], T + 30, budget_seconds=5)
    assert [a.dispatch.receiver for a in sent] == ["oncall"] and sent[0].ok
    (body,) = hook.bodies("hook.test")
    assert body["version"] == "4" and body["status"] == "firing" and body["receiver"] == "oncall"
    assert body["groupLabels"] == {"alertname": "RecoverableHitRateDrop", "engine": "e1"}
    assert [a["fingerprint"] for a in body["alerts"]] == ["RecoverableHitRateDrop-e1"]
    assert body["externalURL"] == "http://agent.test:9400"
    (event,) = hook.bodies("pd.test")
    assert (event["event_action"], event["dedup_key"], event["payload"]["severity"]) == ("trigger", "RecoverableHitRateDrop-e1", "critical")
    assert rows(store) == [("notified", "firing", "RecoverableHitRateDrop", "oncall", None)]
    # the agent restarts: the notification log is in the store, so the firing alert is not re-paged
    restarted = notifier(store, tmp_path, hook)
    assert restarted.route([alert()], T + 90, budget_seconds=5) == []
    assert restarted.route([alert()], T + 3600, budget_seconds=5) == []
    assert len(hook.bodies("hook.test")) == 1
    # ... until repeat_interval (4 h) has passed
    assert len(restarted.route([alert()], T + 30 + 4 * 3600, budget_seconds=5)) == 1
    # the alert resolves; its state is gone by the time the group may speak again, and the agent
    # restarted once more: the resolve is still owed, and delivered once
    again = notifier(store, tmp_path, hook)
    assert again.route([], T + 30 + 4 * 3600 + 300, budget_seconds=5)[0].dispatch.resolved
    resolved = hook.bodies("hook.test")[-1]
    assert resolved["status"] == "resolved" and resolved["alerts"][0]["status"] == "resolved"
    assert hook.bodies("pd.test")[-1]["event_action"] == "resolve"
    assert again.route([], T + 5 * 3600, budget_seconds=5) == []
    assert again.groups == {}
    with store.cursor() as cur:
        assert cur.execute("SELECT count(*) FROM alert_groups").fetchall() == [(0,)]


def test_a_failed_delivery_is_counted_recorded_and_retried(store: Store, tmp_path: Path) -> None:
    hook = Receiver(500, 500, 200)  # two attempts fail, the next pass succeeds
    registry = CollectorRegistry()
    n = notifier(store, tmp_path, hook, registry)
    n.route([alert()], T, budget_seconds=5)
    (attempt,) = n.route([alert()], T + 30, budget_seconds=5)
    assert not attempt.ok and set(attempt.errors) == {"webhook[0]"}
    assert "after 2 attempts (HTTP 500" in attempt.errors["webhook[0]"]
    assert rows(store) == [("delivery_failed", "firing", "RecoverableHitRateDrop", "oncall/webhook[0]", attempt.errors["webhook[0]"])]
    assert sample(registry, "kvscope_alert_notifications_failed_total", receiver="oncall", integration="webhook[0]") == 1
    assert sample(registry, "kvscope_alert_notifications_total", receiver="oncall", integration="pagerduty[0]") == 1
    (retry,) = n.route([alert()], T + 40, budget_seconds=5)  # not advanced: retried at once
    assert retry.ok
    assert [r[0] for r in rows(store)] == ["delivery_failed", "notified"]
    assert n.route([alert()], T + 50, budget_seconds=5) == []


def test_send_resolved_false_slack_log_receiver_and_routes(store: Store, tmp_path: Path) -> None:
    hook = Receiver()
    n = notifier(store, tmp_path, hook)
    ticket = alert("FormInvalidationSpike", severity="ticket")
    n.route([ticket], T, budget_seconds=5)
    (sent,) = n.route([ticket], T + 30, budget_seconds=5)
    assert sent.dispatch.receiver == "tickets"
    (slack,) = hook.bodies("slack.test")
    assert slack["text"].startswith("[FIRING] tickets") and "FormInvalidationSpike on e1" in slack["text"]
    logged = [json.loads(line) for line in (tmp_path / "tickets.jsonl").read_text().splitlines()]
    assert [(d["status"], d["receiver"]) for d in logged] == [("firing", "tickets")]
    resolved = alert("FormInvalidationSpike", severity="ticket", firing=False, resolved_at=T + 200)
    n.route([resolved], T + 400, budget_seconds=5)
    assert len(hook.bodies("slack.test")) == 1  # Slack does not send resolves by default
    assert [json.loads(line)["status"] for line in (tmp_path / "tickets.jsonl").read_text().splitlines()] == ["firing", "resolved"]


def test_silences_and_inhibition_mute_pages_but_not_resolves(store: Store, tmp_path: Path) -> None:
    hook = Receiver()
    n = notifier(store, tmp_path, hook)
    silence = create_silence(store, matchers=['engine="e1"'], starts_at=T, ends_at=T + 600, created_by="op", comment="maintenance", now=T)
    assert [s.id for s in load_silences(store)] == [silence.id]
    n.route([alert()], T, budget_seconds=5)
    assert n.route([alert()], T + 60, budget_seconds=5) == []  # silenced
    expire_silence(store, silence.id, now=T + 120)
    assert n.route([alert()], T + 120, budget_seconds=5) == []  # a group forms: group_wait
    assert len(n.route([alert()], T + 150, budget_seconds=5)) == 1  # the silence ended: paged
    # an engine that went silent inhibits its hit-rate alerts (another engine's still page)
    silent = alert("EngineSilent", engine="e3", severity="ticket")
    muted, other = alert(engine="e3"), alert(engine="e2")
    n.route([muted, silent, other], T + 200, budget_seconds=5)
    sent = n.route([muted, silent, other], T + 240, budget_seconds=5)
    assert sorted(a.dispatch.group_key.split(":")[-1] for a in sent) == [
        '{alertname="EngineSilent",engine="e3"}',
        '{alertname="RecoverableHitRateDrop",engine="e2"}',
    ]
    # once the engine is back, its hit-rate alert pages (it was never sent), after group_wait
    assert n.route([muted, other], T + 300, budget_seconds=5) == []
    assert [a.dispatch.group_key.split(":")[-1] for a in n.route([muted, other], T + 330, budget_seconds=5)] == [
        '{alertname="RecoverableHitRateDrop",engine="e3"}'
    ]


def test_bad_silences_are_refused(store: Store) -> None:
    from alerts.alert_store import SilenceError

    for matchers, ends, message in [
        (['engine=~".*"'], T + 60, "does not match the empty string"),
        (["engine"], T + 60, "is not a matcher"),
        (['engine="e1"'], T - 1, "must end after it starts"),
    ]:
        with pytest.raises(SilenceError, match=message):
            create_silence(store, matchers=matchers, starts_at=T, ends_at=ends, created_by="op", comment="c", now=T)
    with pytest.raises(SilenceError, match="already have ended"):
        create_silence(store, matchers=['engine="e1"'], starts_at=T - 100, ends_at=T - 10, created_by="op", comment="c", now=T)
    with pytest.raises(SilenceError, match="no silence with id"):
        expire_silence(store, "nope", now=T)
    assert load_silences(store) == []


def test_alertmanager_push_leases_firing_alerts_and_repeats_resolves(store: Store, tmp_path: Path) -> None:
    am = Receiver()
    registry = CollectorRegistry()
    n = notifier(store, tmp_path, am, registry)
    assert n.push([alert()], T, interval_seconds=60, budget_seconds=5) == 0
    assert n.push([alert()], T + 60, interval_seconds=60, budget_seconds=5) == 0  # every evaluation
    bodies = am.bodies("am.test:9093/api/v2/alerts")
    assert len(bodies) == 2
    assert bodies[1] == [
        {
            "labels": {"alertname": "RecoverableHitRateDrop", "engine": "e1", "severity": "page"},
            "annotations": {"summary": "RecoverableHitRateDrop on e1"},
            "startsAt": "2027-01-15T07:58:00Z",
            "endsAt": "2027-01-15T08:10:00Z",  # now + 4 intervals + the default 5 m restart margin
            "generatorURL": "http://agent.test:9400",
        }
    ]
    gone = alert(firing=False, resolved_at=T + 90)
    for at in (T + 120, T + 300, T + 389):
        n.push([gone], at, interval_seconds=60, budget_seconds=5)
    n.push([gone], T + 390, interval_seconds=60, budget_seconds=5)  # resolve_resend (5 m) is over
    resolves = am.bodies("am.test")[2:]
    assert len(resolves) == 3 and all(b[0]["endsAt"] == "2027-01-15T08:01:30Z" for b in resolves)
    assert sample(registry, "kvscope_alertmanager_alerts_sent_total", alertmanager="http://am.test:9093") == 5


def test_an_alertmanager_that_is_down_is_counted_and_recorded(store: Store, tmp_path: Path) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    registry = CollectorRegistry()
    config = parse_notify_config(CONFIG, source="notify.yaml", data_dir=tmp_path)
    n = Notifier(
        store=store, config=config, registry=registry, external_url="http://agent.test",
        client=httpx.Client(transport=httpx.MockTransport(refuse)), sleep=lambda s: None,
    )  # fmt: skip
    assert n.push([alert()], T, interval_seconds=60, budget_seconds=5) == 1
    assert sample(registry, "kvscope_alertmanager_errors_total", alertmanager="http://am.test:9093") == 1
    ((event, state, name, receiver, error),) = rows(store)
    assert (event, state, name, receiver) == ("delivery_failed", "firing", "RecoverableHitRateDrop", "alertmanager http://am.test:9093")
    assert "ConnectError" in error


def test_deliveries_stay_within_the_budget(store: Store, tmp_path: Path) -> None:
    clock = [0.0]
    waits: list[float] = []

    def wait(seconds: float) -> None:
        waits.append(seconds)
        clock[0] += seconds

    config = parse_notify_config(
        {**CONFIG, "delivery": {"attempts": 10, "backoff": "1s", "max_backoff": "1s"}}, source="n.yaml", data_dir=tmp_path
    )
    n = Notifier(
        store=store, config=config, registry=CollectorRegistry(), external_url="http://a",
        client=httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(503))),
        sleep=wait, monotonic=lambda: clock[0],
    )  # fmt: skip
    n.route([alert()], T, budget_seconds=2.5)
    (attempt,) = n.route([alert()], T + 30, budget_seconds=2.5)
    assert "no time left for another attempt before the next evaluation" in attempt.errors["webhook[0]"]
    assert clock[0] <= 2.5 and len(waits) < 9


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({}, "missing field 'route'"),
        ({"route": {"receiver": "x"}}, "route: field receiver: no receiver named 'x' (receivers: none defined)"),
        ({"route": {"receiver": "a", "matchers": ['a="b"']}, "receivers": [{"name": "a"}]}, "route: unknown field 'matchers'"),
        ({"route": {"receiver": "a", "group_wait": "soon"}, "receivers": [{"name": "a"}]}, "field group_wait: 'soon' is not a duration"),
        ({"route": {"receiver": "a", "routes": [{"matchers": ["bad"]}]}, "receivers": [{"name": "a"}]}, "route.routes[0]: field matchers: 'bad' is not a matcher"),
        ({"route": {"receiver": "a", "group_by": ["a-b"]}, "receivers": [{"name": "a"}]}, "'a-b' is not a label name"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a"}, {"name": "a"}]}, "name 'a' is used twice"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a", "webhook_configs": [{"url": "ftp://x"}]}]}, "'ftp://x' is not an http(s) URL"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a", "email_configs": []}]}, "unknown field 'email_configs'"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a", "webhook_configs": [{"url": "http://x", "max_alerts": -1}]}]}, "max_alerts: expected an integer >= 0"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a"}], "delivery": {"attempts": 0}}, "attempts: expected an integer in [1, 10]"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a"}], "delivery": {"lease_intervals": 1}}, "lease_intervals: expected a number in [2, 100]"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a"}], "delivery": {"restart_margin": "2d"}}, "restart_margin: at most 1d, got '2d'"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a"}], "delivery": {"restart_margin": "soon"}}, "field restart_margin: 'soon' is not a duration"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a"}], "inhibit_rules": [{"source_matchers": [], "target_matchers": ['a="b"']}]}, "need at least one matcher each"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a"}], "alertmanagers": [{"url": "am:9093"}]}, "'am:9093' is not an http(s) URL"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a", "webhook_configs": [{"url": "http://127.0.0.1:abc/hook"}]}]}, "is not a valid URL"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a", "webhook_configs": [{"url": "http://[::1/x"}]}]}, "is not a valid URL"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a", "webhook_configs": [{"url": "http://exa mple.com/x"}]}]}, "URL"),
        ({"route": {"receiver": ["a"]}, "receivers": [{"name": "a"}]}, "route: field receiver: expected a receiver's name, got ['a']"),
        ({"route": {"receiver": "a", "routes": [{"matchers": ['a=~"("']}]}, "receivers": [{"name": "a"}]}, "notify.yaml: route.routes[0]: field matchers: bad regex"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a"}], "delivery": []}, "delivery: expected a mapping, got list"),
        ({"route": {"receiver": "a"}, "receivers": [{"name": "a", "log_configs": [{"path": "/"}]}]}, "is a directory"),
    ],
)
def test_bad_notification_files_name_the_field(tmp_path: Path, document: dict[str, object], message: str) -> None:
    with pytest.raises(NotifyConfigError) as info:
        parse_notify_config(document, source="notify.yaml", data_dir=tmp_path)
    assert str(info.value).startswith("notify.yaml") and message in str(info.value)
    assert str(info.value).count("notify.yaml") == 1


def test_the_shipped_notification_file(tmp_path: Path) -> None:
    from alerts.notify_config import DEFAULT_NOTIFY_PATH, LogConfig

    config = load_notify_config(DEFAULT_NOTIFY_PATH, data_dir=tmp_path)
    assert config.route.receiver == "log" and config.route.group_by == ("alertname", "engine")
    ((name, log),) = config.receivers["log"].integrations
    assert name == "log[0]" and isinstance(log, LogConfig) and log.path == tmp_path / "notifications.jsonl"
    assert len(config.inhibit_rules) == 2 and config.alertmanagers == ()
    with pytest.raises(NotifyConfigError, match="cannot read notification file"):
        load_notify_config(tmp_path / "absent.yaml", data_dir=tmp_path)




def test_one_failing_integration_does_not_repage_the_others(store: Store, tmp_path: Path) -> None:
    """Alertmanager keeps its notification log per receiver integration: while PagerDuty fails,
    the webhook of the same receiver gets the page once, not once per retry."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500 if "pd.test" in str(request.url) else 200)

    posts: list[str] = []
    registry = CollectorRegistry()
    config = parse_notify_config(CONFIG, source="n.yaml", data_dir=tmp_path)

    def record(request: httpx.Request) -> httpx.Response:
        posts.append(request.url.host)
        return answer(request)

    n = Notifier(
        store=store, config=config, registry=registry, external_url="http://a",
        client=httpx.Client(transport=httpx.MockTransport(record)), sleep=lambda s: None,
    )  # fmt: skip
    n.route([alert()], T, budget_seconds=5)
    for k in range(5):  # an evaluation a minute: PagerDuty is retried each time, the webhook is not
        (attempt,) = n.route([alert()], T + 30 + 60 * k, budget_seconds=5)
        assert set(attempt.errors) == {"pagerduty[0]"}
    assert posts.count("hook.test") == 1 and posts.count("pd.test") == 10  # 2 attempts × 5 passes
    # a restart keeps that: the webhook's entry is in the store
    again = Notifier(
        store=store, config=config, registry=CollectorRegistry(), external_url="http://a",
        client=httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200))), sleep=lambda s: None,
    )  # fmt: skip
    again.restore()
    (ok,) = again.route([alert()], T + 400, budget_seconds=5)
    assert ok.ok and ok.took == ("pagerduty[0]",)
    assert again.route([alert()], T + 460, budget_seconds=5) == []  # the group advanced


def test_a_group_whose_routing_changed_still_delivers_its_resolve(store: Store, tmp_path: Path) -> None:
    hook = Receiver()
    n = notifier(store, tmp_path, hook)
    n.route([alert()], T, budget_seconds=5)
    n.route([alert()], T + 30, budget_seconds=5)  # paged under group_by [alertname, engine]
    regrouped = {**CONFIG, "route": {**CONFIG["route"], "group_by": ["engine"]}}  # type: ignore[dict-item]
    config = parse_notify_config(regrouped, source="n.yaml", data_dir=tmp_path)
    after = Notifier(
        store=store, config=config, registry=CollectorRegistry(), external_url="http://a",
        client=httpx.Client(transport=httpx.MockTransport(hook)), sleep=lambda s: None,
    )  # fmt: skip
    after.restore()
    after.route([alert()], T + 60, budget_seconds=5)
    after.route([alert()], T + 90, budget_seconds=5)  # the new group pages once
    pages = [b for b in hook.bodies("hook.test") if b["status"] == "firing"]
    assert [p["groupLabels"] for p in pages] == [{"alertname": "RecoverableHitRateDrop", "engine": "e1"}, {"engine": "e1"}]
    sent = after.route([alert(firing=False, resolved_at=T + 100)], T + 400, budget_seconds=5)
    resolves = [b for b in hook.bodies("hook.test") if b["status"] == "resolved"]
    assert sorted(json.dumps(r["groupLabels"]) for r in resolves) == [
        '{"alertname": "RecoverableHitRateDrop", "engine": "e1"}', '{"engine": "e1"}'
    ]  # fmt: skip
    assert all(r["alerts"][0]["endsAt"] == "2027-01-15T08:01:40Z" for r in resolves)  # when it resolved
    assert len(sent) == 2 and after.groups == {}
    with store.cursor() as cur:
        assert cur.execute("SELECT count(*) FROM alert_groups").fetchall() == [(0,)]


def test_silences_keep_their_matchers_exactly(store: Store) -> None:
    odd = ['model="llama-é\\"x"', 'engine!="a\\\\b"', 'alertname=~"Rec.*"']
    created = create_silence(store, matchers=odd, starts_at=T, ends_at=T + 60, created_by="op", comment="c", now=T)
    (loaded,) = load_silences(store)
    assert loaded.matchers == created.matchers
    assert loaded.matchers[0].value == 'llama-é"x' and loaded.matchers[1].value == "a\\b"
    from alerts.alert_store import matcher_text
    from alerts.routing import parse_matcher

    assert [parse_matcher(matcher_text(m)) for m in loaded.matchers] == list(loaded.matchers)


def test_expiring_a_pending_silence(store: Store) -> None:
    from alerts.alert_store import silence_json

    later = create_silence(store, matchers=['engine="e1"'], starts_at=T + 600, ends_at=T + 900, created_by="op", comment="c", now=T)
    assert silence_json(later, T)["state"] == "pending"
    expired = expire_silence(store, later.id, now=T + 10)
    assert silence_json(expired, T + 10)["state"] == "expired" and not expired.active(T + 600)


def test_a_url_httpx_refuses_is_a_counted_failure_not_a_crash() -> None:
    from alerts.receivers import DeliveryError, deliver

    with httpx.Client() as client, pytest.raises(DeliveryError, match="cannot send there"):
        deliver(client, "http://127.0.0.1:abc/hook", {"a": 1}, attempts=3, sleep=lambda s: None)


def test_unreadable_files_say_so(tmp_path: Path) -> None:
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\x00\xff\xfe\x89PNG")
    with pytest.raises(NotifyConfigError, match=r"bin\.yaml: cannot read notification file: it is not UTF-8 text"):
        load_notify_config(binary, data_dir=tmp_path)
