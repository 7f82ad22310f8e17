"""Where alerts go: the notification file, shaped like Alertmanager's configuration, loaded
strictly.

Five top-level keys; ``route`` (with its ``receiver``) is required, the others are optional::

    route:                      # Alertmanager's routing tree (alerts.routing)
      receiver: log
      group_by: [alertname, engine]
      group_wait: 30s
      group_interval: 5m
      repeat_interval: 4h
      routes:
        - matchers: ['severity="page"']
          receiver: oncall
          continue: true
    inhibit_rules:
      - source_matchers: ['alertname="EngineSilent"']
        target_matchers: ['alertname=~"RecoverableHitRate.*"']
        equal: [engine]
    receivers:
      - name: log
        log_configs: [{path: notifications.jsonl}]     # relative to the agent's data_dir
      - name: oncall
        webhook_configs: [{url: "http://127.0.0.1:5001/hook", send_resolved: true, max_alerts: 0}]
        pagerduty_configs: [{routing_key: KEY}]       # url: PagerDuty's Events API v2 by default
        slack_configs: [{api_url: "https://hooks.slack.com/services/...", send_resolved: false}]
    alertmanagers:              # Prometheus-style: every evaluation, POST {url}/api/v2/alerts
      - url: http://127.0.0.1:9093
    delivery:
      timeout: 10s              # per attempt; capped below the evaluation interval
      attempts: 3
      backoff: 500ms            # doubled per retry, capped at max_backoff
      max_backoff: 5s
      lease_intervals: 4        # Alertmanager API: a firing alert's endsAt = now + 4 intervals
      restart_margin: 5m        # ... + this, so an agent restart cannot lapse the lease
      resolve_resend: 5m        # ... and a resolve is re-sent for this long

Routed receivers (``receivers``) get Alertmanager's grouping, timers, inhibition and silences;
``alertmanagers`` get every alert of each evaluated rule group, as Prometheus sends them, and do
their own routing. Loading is strict: an unknown key, a bad duration, a bad matcher, a receiver
that does not exist or a URL that is not http(s) is a :class:`NotifyConfigError` naming the file
and the field. Peers: Alertmanager's ``alertmanager.yml`` (route, receivers, inhibit_rules) and
Prometheus's ``alerting.alertmanagers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from agent.config import read_yaml
from alerts import strict
from alerts.routing import InhibitRule, Matcher, Route, parse_matcher
from alerts.rulefile import LABEL_NAME, parse_duration

DEFAULT_NOTIFY_PATH = Path(__file__).with_name("default_notify.yaml")
"""The notification file that ships with kvscope (a JSONL log receiver, the default inhibitions)."""


class NotifyConfigError(ValueError):
    """A notification file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    url: str
    send_resolved: bool = True
    max_alerts: int = 0
    """Most alerts in one payload (0: all); the rest are counted in ``truncatedAlerts``."""


PAGERDUTY_EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"


@dataclass(frozen=True, slots=True)
class PagerDutyConfig:
    routing_key: str
    url: str = PAGERDUTY_EVENTS_URL
    send_resolved: bool = True
    source: str = "kvscope"


@dataclass(frozen=True, slots=True)
class SlackConfig:
    api_url: str
    send_resolved: bool = False


@dataclass(frozen=True, slots=True)
class LogConfig:
    path: Path
    send_resolved: bool = True


Integration = WebhookConfig | PagerDutyConfig | SlackConfig | LogConfig


@dataclass(frozen=True, slots=True)
class Receiver:
    name: str
    integrations: tuple[tuple[str, Integration], ...] = ()
    """(integration name such as ``webhook[0]``, its config); none: notifications are dropped
    (Alertmanager's "null" receiver)."""


@dataclass(frozen=True, slots=True)
class AlertmanagerTarget:
    url: str
    """Base URL; alerts go to ``{url}/api/v2/alerts``."""


MAX_RESTART_MARGIN_SECONDS = 86400.0
"""Longest ``restart_margin`` accepted (a day: beyond it a dead agent's alerts linger too long)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    timeout_seconds: float = 10.0
    attempts: int = 3
    backoff_seconds: float = 0.5
    max_backoff_seconds: float = 5.0
    lease_intervals: float = 4.0
    restart_margin_seconds: float = 300.0
    """Added to every Alertmanager lease: the longest agent restart (stop to the re-push at
    start-up) that must not resolve a firing alert. 5 minutes is the cap of Kubernetes'
    crash-loop back-off (kubelet doubles a restarting container's delay from 10 s up to 300 s);
    a systemd ``Restart=`` takes well under that. The price: an agent that stops for good leaves
    its firing alerts in Alertmanager this much longer before they resolve."""
    resolve_resend_seconds: float = 300.0

    def lease_seconds(self, interval_seconds: float) -> float:
        """A firing alert's ``endsAt`` lease in seconds for a rule group evaluated every
        ``interval_seconds``: ``lease_intervals`` intervals (Prometheus sends 4 × the resend
        delay) plus ``restart_margin_seconds``. An agent that dies just before an evaluation and
        re-pushes at start-up (:meth:`alerts.rule_scheduler.RuleScheduler.start`) keeps its
        alerts if it is back within ``(lease_intervals − 1) × interval + restart_margin``."""
        return self.lease_intervals * interval_seconds + self.restart_margin_seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class NotifyConfig:
    source: str
    route: Route
    receivers: Mapping[str, Receiver]
    inhibit_rules: tuple[InhibitRule, ...] = ()
    alertmanagers: tuple[AlertmanagerTarget, ...] = ()
    delivery: Delivery = field(default_factory=Delivery)


def load_notify_config(path: str | Path, *, data_dir: Path) -> NotifyConfig:
    """Read and check a notification file; relative log paths are taken under ``data_dir``.

    Raises:
        NotifyConfigError: unreadable file, bad YAML, or a field that breaks the format.
    """
    path = Path(path)
    return parse_notify_config(read_yaml(path, "notification file", NotifyConfigError), source=str(path), data_dir=data_dir)


NOTIFY_KEYS = frozenset({"route", "receivers", "inhibit_rules", "alertmanagers", "delivery"})
"""The top-level keys of a notification file."""


def parse_notify_config(raw: object, *, source: str, data_dir: Path) -> NotifyConfig:
    """Check an already parsed notification file (see :func:`load_notify_config`)."""
    if raw is None:
        raw = {}
    top = _mapping(raw, source, set(NOTIFY_KEYS))
    receivers: dict[str, Receiver] = {}
    for i, item in enumerate(_list(top.get("receivers", []), f"{source}: receivers")):
        receiver = _receiver(item, f"{source}: receivers[{i}]", data_dir)
        if receiver.name in receivers:
            raise NotifyConfigError(f"{source}: receivers[{i}]: name {receiver.name!r} is used twice")
        receivers[receiver.name] = receiver
    if "route" not in top:
        raise NotifyConfigError(f"{source}: missing field 'route' (the routing tree's root, with its receiver)")
    route = _route(top["route"], f"{source}: route", receivers, root=True)
    inhibit = tuple(
        _inhibit(item, f"{source}: inhibit_rules[{i}]") for i, item in enumerate(_list(top.get("inhibit_rules", []), f"{source}: inhibit_rules"))
    )
    managers = []
    for i, item in enumerate(_list(top.get("alertmanagers", []), f"{source}: alertmanagers")):
        where = f"{source}: alertmanagers[{i}]"
        doc = _mapping(item, where, {"url"}, required={"url"})
        managers.append(AlertmanagerTarget(url=_url(doc["url"], f"{where}: field url").rstrip("/")))
    delivery = _delivery(top.get("delivery", {}), f"{source}: delivery")
    return NotifyConfig(
        source=source, route=route, receivers=receivers, inhibit_rules=inhibit, alertmanagers=tuple(managers), delivery=delivery
    )


_ROUTE_KEYS = {"receiver", "matchers", "group_by", "group_wait", "group_interval", "repeat_interval", "continue", "routes"}


def _route(raw: object, where: str, receivers: Mapping[str, Receiver], *, root: bool = False) -> Route:
    doc = _mapping(raw, where, _ROUTE_KEYS - ({"matchers", "continue"} if root else set()), required={"receiver"} if root else set())
    receiver = doc.get("receiver")
    if receiver is not None and not isinstance(receiver, str):
        raise NotifyConfigError(f"{where}: field receiver: expected a receiver's name, got {receiver!r}")
    if receiver is not None and receiver not in receivers:
        known = ", ".join(sorted(receivers)) or "none defined"
        raise NotifyConfigError(f"{where}: field receiver: no receiver named {receiver!r} (receivers: {known})")
    group_by = None
    if "group_by" in doc:
        names = _list(doc["group_by"], f"{where}: field group_by")
        for name in names:
            if name != "..." and not (isinstance(name, str) and LABEL_NAME.fullmatch(name)):
                raise NotifyConfigError(f"{where}: field group_by: {name!r} is not a label name (or '...')")
        group_by = tuple(names)
    timers = {name: _duration(doc, name, where) for name in ("group_wait", "group_interval", "repeat_interval") if name in doc}
    for name in ("group_interval", "repeat_interval"):
        if name in timers and timers[name] <= 0:
            raise NotifyConfigError(f"{where}: field {name}: must be positive")
    cont = doc.get("continue", False)
    if not isinstance(cont, bool):
        raise NotifyConfigError(f"{where}: field continue: expected true or false, got {cont!r}")
    children = tuple(
        _route(child, f"{where}.routes[{i}]", receivers) for i, child in enumerate(_list(doc.get("routes", []), f"{where}: field routes"))
    )
    matchers = _matchers(doc.get("matchers", []), f"{where}: field matchers")
    try:
        return Route(
            receiver=receiver,
            matchers=matchers,
            group_by=group_by,
            group_wait=timers.get("group_wait"),
            group_interval=timers.get("group_interval"),
            repeat_interval=timers.get("repeat_interval"),
            continue_=cont,
            routes=children,
        )
    except ValueError as exc:
        raise NotifyConfigError(f"{where}: {exc}") from None


def _inhibit(raw: object, where: str) -> InhibitRule:
    doc = _mapping(raw, where, {"source_matchers", "target_matchers", "equal"}, required={"source_matchers", "target_matchers"})
    equal = _list(doc.get("equal", []), f"{where}: field equal")
    for name in equal:
        if not (isinstance(name, str) and LABEL_NAME.fullmatch(name)):
            raise NotifyConfigError(f"{where}: field equal: {name!r} is not a label name")
    source = _matchers(doc["source_matchers"], f"{where}: field source_matchers")
    target = _matchers(doc["target_matchers"], f"{where}: field target_matchers")
    if not source or not target:
        raise NotifyConfigError(f"{where}: source_matchers and target_matchers need at least one matcher each")
    return InhibitRule(source_matchers=source, target_matchers=target, equal=tuple(equal))


_INTEGRATIONS: dict[str, tuple[str, set[str], set[str]]] = {
    "webhook_configs": ("webhook", {"url", "send_resolved", "max_alerts"}, {"url"}),
    "pagerduty_configs": ("pagerduty", {"routing_key", "url", "send_resolved", "source"}, {"routing_key"}),
    "slack_configs": ("slack", {"api_url", "send_resolved"}, {"api_url"}),
    "log_configs": ("log", {"path", "send_resolved"}, {"path"}),
}


def _receiver(raw: object, where: str, data_dir: Path) -> Receiver:
    doc = _mapping(raw, where, {"name", *_INTEGRATIONS}, required={"name"})
    name = doc["name"]
    if not isinstance(name, str) or not name:
        raise NotifyConfigError(f"{where}: field name: expected a non-empty string, got {name!r}")
    where = f"{where} ({name})"
    integrations: list[tuple[str, Integration]] = []
    for key, (kind, allowed, required) in _INTEGRATIONS.items():
        for i, item in enumerate(_list(doc.get(key, []), f"{where}: field {key}")):
            at = f"{where}: {key}[{i}]"
            cfg = _mapping(item, at, allowed, required=required)
            send_resolved = cfg.get("send_resolved", kind != "slack")
            if not isinstance(send_resolved, bool):
                raise NotifyConfigError(f"{at}: field send_resolved: expected true or false, got {send_resolved!r}")
            integration: Integration
            if kind == "webhook":
                max_alerts = cfg.get("max_alerts", 0)
                if type(max_alerts) is not int or max_alerts < 0:
                    raise NotifyConfigError(f"{at}: field max_alerts: expected an integer >= 0, got {max_alerts!r}")
                integration = WebhookConfig(_url(cfg["url"], f"{at}: field url"), send_resolved, max_alerts)
            elif kind == "pagerduty":
                key_text = _text(cfg["routing_key"], f"{at}: field routing_key")
                integration = PagerDutyConfig(
                    key_text,
                    _url(cfg.get("url", PAGERDUTY_EVENTS_URL), f"{at}: field url"),
                    send_resolved,
                    _text(cfg.get("source", "kvscope"), f"{at}: field source"),
                )
            elif kind == "slack":
                integration = SlackConfig(_url(cfg["api_url"], f"{at}: field api_url"), send_resolved)
            else:
                path = Path(_text(cfg["path"], f"{at}: field path"))
                path = path if path.is_absolute() else data_dir / path
                if path.is_dir():
                    raise NotifyConfigError(f"{at}: field path: {str(path)!r} is a directory, not a file to append to")
                integration = LogConfig(path, send_resolved)
            integrations.append((f"{kind}[{i}]", integration))
    return Receiver(name=name, integrations=tuple(integrations))


def _delivery(raw: object, where: str) -> Delivery:
    keys = {"timeout", "attempts", "backoff", "max_backoff", "lease_intervals", "restart_margin", "resolve_resend"}
    doc = _mapping(raw if raw is not None else {}, where, keys)
    d = Delivery()
    attempts = doc.get("attempts", d.attempts)
    if type(attempts) is not int or not 1 <= attempts <= 10:
        raise NotifyConfigError(f"{where}: field attempts: expected an integer in [1, 10], got {attempts!r}")
    lease = doc.get("lease_intervals", d.lease_intervals)
    if isinstance(lease, bool) or not isinstance(lease, int | float) or not 2 <= lease <= 100:
        raise NotifyConfigError(f"{where}: field lease_intervals: expected a number in [2, 100], got {lease!r}")
    durations = ("timeout", "backoff", "max_backoff", "restart_margin", "resolve_resend")
    values = {name: _duration(doc, name, where) for name in durations if name in doc}
    if values.get("timeout", 1) <= 0:
        raise NotifyConfigError(f"{where}: field timeout: must be positive")
    if values.get("restart_margin", 0) > MAX_RESTART_MARGIN_SECONDS:
        raise NotifyConfigError(f"{where}: field restart_margin: at most 1d, got {doc['restart_margin']!r}")
    return Delivery(
        timeout_seconds=values.get("timeout", d.timeout_seconds),
        attempts=attempts,
        backoff_seconds=values.get("backoff", d.backoff_seconds),
        max_backoff_seconds=values.get("max_backoff", d.max_backoff_seconds),
        lease_intervals=float(lease),
        restart_margin_seconds=values.get("restart_margin", d.restart_margin_seconds),
        resolve_resend_seconds=values.get("resolve_resend", d.resolve_resend_seconds),
    )


def _matchers(raw: object, where: str) -> tuple[Matcher, ...]:
    out = []
    for item in _list(raw, where):
        if not isinstance(item, str):
            raise NotifyConfigError(f"{where}: expected matcher strings like 'severity=\"page\"', got {item!r}")
        try:
            out.append(parse_matcher(item))
        except ValueError as exc:
            raise NotifyConfigError(f"{where}: {exc}") from None
    return tuple(out)


def _duration(doc: Mapping[str, Any], name: str, where: str) -> float:
    return strict.parsed(f"{where}: field {name}", lambda: parse_duration(doc[name]), error=NotifyConfigError)


def _url(value: object, where: str) -> str:
    text = _text(value, where)
    try:
        url = httpx.URL(text)  # the client that will post to it must accept it, port included
        parts = urlsplit(text)
    except (httpx.InvalidURL, ValueError) as exc:
        raise NotifyConfigError(f"{where}: {text!r} is not a valid URL ({exc})") from None
    if url.scheme not in ("http", "https") or not url.host or not parts.netloc or any(c.isspace() for c in text):
        raise NotifyConfigError(f"{where}: {text!r} is not an http(s) URL")
    return text


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise NotifyConfigError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _list(value: object, where: str) -> list[Any]:
    return strict.items(value, where, error=NotifyConfigError)


def _mapping(value: object, where: str, allowed: set[str], *, required: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
    return strict.mapping(value, where, allowed, required, error=NotifyConfigError)
