"""Alertmanager-shaped routing (issue 7, item 4): a routing tree with matchers and ``continue``,
aggregation groups with ``group_wait`` / ``group_interval`` / ``repeat_interval``, inhibition
rules and silences — pure, with the clock as a parameter.

Semantics follow Alertmanager's documentation ("Configuration: route", "inhibit_rule",
"Silences"):

* **Tree.** The root route matches every alert. An alert descends into the first child whose
  matchers all match (depth first); a child with ``continue: true`` lets later siblings match
  too. A route with no matching child handles the alert itself. Children inherit the parent's
  ``receiver``, ``group_by`` and timers unless they set their own.
* **Groups.** Per route, alerts are grouped by the values of its ``group_by`` labels (``...``:
  all labels). A new group waits ``group_wait`` before its first notification; after that, a
  group whose alerts changed (a new firing alert, a resolve) notifies at most every
  ``group_interval``; an unchanged group with firing alerts is re-notified every
  ``repeat_interval``. A notification carries the group's firing alerts and the alerts resolved
  since the last one; a group with nothing firing and nothing to report is removed.
* **Inhibition.** A firing alert matching an inhibit rule's ``source_matchers`` mutes the alerts
  matching its ``target_matchers`` that have the same values for the ``equal`` labels (an alert
  never inhibits itself, and two alerts that both match both sides do not inhibit each other).
* **Silences.** An alert matching every matcher of a silence active at ``now``
  (``starts_at <= now < ends_at``) is muted; a silence needs a matcher that does not match the
  empty string. Muted firing alerts are left out of notifications; their group, and the resolves
  it owes, are kept — a resolve is never muted.
* **Group keys** are the chain of the routes' matchers plus the grouping labels, so adding or
  reordering routes does not re-key groups. :func:`owed_resolves` tells the caller which resolved
  alerts some group still has to report.

Matchers use Alertmanager's syntax: ``name="value"``, ``name!="value"``, ``name=~"regex"``,
``name!~"regex"`` (regexes anchored at both ends); a missing label matches the empty string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*(?:"((?:[^"\\]|\\.)*)"|([^\s"{},=~!][^\s"{},]*))\s*')


@dataclass(frozen=True, slots=True)
class Matcher:
    """One label matcher; ``op`` is ``=``, ``!=``, ``=~`` or ``!~``."""

    name: str
    op: str
    value: str

    def matches(self, labels: Mapping[str, str]) -> bool:
        actual = labels.get(self.name, "")
        if self.op == "=":
            return actual == self.value
        if self.op == "!=":
            return actual != self.value
        found = re.fullmatch(self.value, actual) is not None
        return found if self.op == "=~" else not found


def parse_matcher(text: str) -> Matcher:
    """``name="value"`` or ``name=value`` (or ``!=``, ``=~``, ``!~``) as a :class:`Matcher`.
    Regexes are Python's ``re`` (close to, not identical with, Alertmanager's RE2).

    Raises:
        ValueError: not a matcher, or a regex that does not compile.
    """
    match = _MATCHER.fullmatch(text)
    if match is None:
        raise ValueError(f'{text!r} is not a matcher like severity="page" or form=~"swa.*"')
    name, op, quoted, bare = match.groups()
    value = quoted.replace('\\"', '"').replace("\\\\", "\\") if quoted is not None else bare
    if op in ("=~", "!~"):
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"bad regex in {text!r}: {exc}") from None
    return Matcher(name, op, value)


def matches_all(matchers: Sequence[Matcher], labels: Mapping[str, str]) -> bool:
    return all(m.matches(labels) for m in matchers)


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """A routing-tree node (``None`` fields inherit from the parent)."""

    receiver: str | None = None
    matchers: tuple[Matcher, ...] = ()
    group_by: tuple[str, ...] | None = None
    group_wait: float | None = None
    group_interval: float | None = None
    repeat_interval: float | None = None
    continue_: bool = False
    routes: tuple[Route, ...] = ()

    def __post_init__(self) -> None:
        if self.group_by is not None and "..." in self.group_by and len(self.group_by) > 1:
            raise ValueError("group_by: '...' (all labels) cannot be combined with other labels")


@dataclass(frozen=True, slots=True)
class _Resolved:
    """A route with everything inherited filled in; ``path`` identifies it in the tree."""

    path: tuple[str, ...]
    """The chain of the routes' matchers from the root: stable when siblings are added or
    reordered (as Alertmanager's route keys)."""
    receiver: str
    group_by: tuple[str, ...]
    group_wait: float
    group_interval: float
    repeat_interval: float


DEFAULT_GROUP_WAIT = 30.0
DEFAULT_GROUP_INTERVAL = 300.0
DEFAULT_REPEAT_INTERVAL = 4 * 3600.0
"""Alertmanager's defaults for the root route (seconds)."""


def route_alert(root: Route, labels: Mapping[str, str]) -> list[_Resolved]:
    """The routes that handle an alert with ``labels`` (one, or several with ``continue``).

    Raises:
        ValueError: the root has no receiver.
    """
    if root.receiver is None:
        raise ValueError("the root route needs a receiver")
    base = _Resolved(
        (),
        root.receiver,
        root.group_by if root.group_by is not None else (),
        root.group_wait if root.group_wait is not None else DEFAULT_GROUP_WAIT,
        root.group_interval if root.group_interval is not None else DEFAULT_GROUP_INTERVAL,
        root.repeat_interval if root.repeat_interval is not None else DEFAULT_REPEAT_INTERVAL,
    )
    return _descend(root, base, labels)


def _descend(route: Route, resolved: _Resolved, labels: Mapping[str, str]) -> list[_Resolved]:
    found: list[_Resolved] = []
    seen: dict[str, int] = {}
    for child in route.routes:
        identity = "{" + ",".join(f"{m.name}{m.op}{json.dumps(m.value)}" for m in child.matchers) + "}"
        seen[identity] = seen.get(identity, 0) + 1
        if seen[identity] > 1:  # siblings with the same matchers: tell them apart by order
            identity += f"#{seen[identity]}"
        if not matches_all(child.matchers, labels):
            continue
        child_resolved = _Resolved(
            (*resolved.path, identity),
            child.receiver or resolved.receiver,
            child.group_by if child.group_by is not None else resolved.group_by,
            child.group_wait if child.group_wait is not None else resolved.group_wait,
            child.group_interval if child.group_interval is not None else resolved.group_interval,
            child.repeat_interval if child.repeat_interval is not None else resolved.repeat_interval,
        )
        found.extend(_descend(child, child_resolved, labels))
        if not child.continue_:
            break
    return found or [resolved]


@dataclass(frozen=True, slots=True, kw_only=True)
class InhibitRule:
    source_matchers: tuple[Matcher, ...]
    target_matchers: tuple[Matcher, ...]
    equal: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Silence:
    """Mutes matching alerts while ``starts_at <= now < ends_at`` (unix seconds)."""

    id: str
    matchers: tuple[Matcher, ...]
    starts_at: float
    ends_at: float
    created_by: str = ""
    comment: str = ""

    def __post_init__(self) -> None:
        if not self.matchers:
            raise ValueError("a silence needs at least one matcher")
        if all(m.matches({}) for m in self.matchers):
            raise ValueError("a silence needs a matcher that does not match the empty string (it would mute everything)")
        if not self.ends_at > self.starts_at:
            raise ValueError("a silence must end after it starts")

    def active(self, now: float) -> bool:
        return self.starts_at <= now < self.ends_at


@dataclass(frozen=True, slots=True, kw_only=True)
class Alert:
    """An alert as the router sees it: its identity, labels and whether it fires now."""

    fingerprint: str
    labels: Mapping[str, str]
    firing: bool
    annotations: Mapping[str, str] = field(default_factory=dict)
    value: float | None = None


def muted(alert: Alert, alerts: Sequence[Alert], inhibit_rules: Sequence[InhibitRule], silences: Sequence[Silence], now: float) -> str | None:
    """Why ``alert`` is muted at ``now`` (``"silenced:<id>"`` or ``"inhibited"``), else None."""
    for silence in silences:
        if silence.active(now) and matches_all(silence.matchers, alert.labels):
            return f"silenced:{silence.id}"
    for rule in inhibit_rules:
        if not matches_all(rule.target_matchers, alert.labels):
            continue
        # an alert matching both sides is not inhibited by sources that also match both sides
        both = matches_all(rule.source_matchers, alert.labels)
        for source in alerts:
            if (
                source.firing
                and source.fingerprint != alert.fingerprint
                and matches_all(rule.source_matchers, source.labels)
                and not (both and matches_all(rule.target_matchers, source.labels))
                and all(source.labels.get(name, "") == alert.labels.get(name, "") for name in rule.equal)
            ):
                return "inhibited"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupState:
    """One aggregation group: when it was created and last notified, and what that notification
    held (firing fingerprints)."""

    created_at: float
    last_sent_at: float | None = None
    last_firing: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class Dispatch:
    """One notification to send: the receiver, the group's key and labels, its firing alerts and
    the alerts resolved since its last notification."""

    receiver: str
    group_key: str
    group_labels: Mapping[str, str]
    firing: tuple[Alert, ...]
    resolved: tuple[Alert, ...]


def group_key(route: _Resolved, labels: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """The aggregation group of an alert on ``route``: (key, the grouping labels)."""
    if route.group_by == ("...",):
        grouping = dict(sorted(labels.items()))
    else:
        grouping = {name: labels[name] for name in route.group_by if name in labels}
    path = "".join(route.path) or "{}"
    key = f"{path}:{{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(grouping.items())) + "}"
    return key, grouping


def owed_resolves(groups: Mapping[str, GroupState]) -> frozenset[str]:
    """Fingerprints some group still has to report resolved: the caller keeps passing these
    alerts (resolved) to :func:`dispatch` until they leave this set (with ``continue``, one alert
    is in several groups, each reporting its resolve at its own time)."""
    return frozenset().union(*(state.last_firing for state in groups.values()))


def dispatch(
    root: Route,
    alerts: Sequence[Alert],
    now: float,
    groups: Mapping[str, GroupState],
    *,
    inhibit_rules: Sequence[InhibitRule] = (),
    silences: Sequence[Silence] = (),
) -> tuple[dict[str, GroupState], list[Dispatch]]:
    """Route ``alerts`` (every alert currently known: firing ones, and resolved ones not yet
    reported) at ``now``; returns the new group states and the notifications due.

    Raises:
        ValueError: the root has no receiver.
    """
    members: dict[str, tuple[_Resolved, dict[str, str], list[Alert]]] = {}
    muted_now = {a.fingerprint for a in alerts if a.firing and muted(a, alerts, inhibit_rules, silences, now) is not None}
    for alert in alerts:
        for route in route_alert(root, alert.labels):
            key, grouping = group_key(route, alert.labels)
            members.setdefault(key, (route, grouping, []))[2].append(alert)
    new_groups: dict[str, GroupState] = {
        key: state for key, state in groups.items() if key not in members and state.last_firing
    }  # groups whose alerts are not passed this time keep what they owe
    sends: list[Dispatch] = []
    for key in sorted(members):
        route, grouping, group_alerts = members[key]
        state = groups.get(key) or GroupState(created_at=now)
        # a muted alert is left out of notifications; a resolve is never muted (it is owed)
        firing_alerts = [a for a in group_alerts if a.firing and a.fingerprint not in muted_now]
        firing = frozenset(a.fingerprint for a in firing_alerts)
        resolved = tuple(a for a in group_alerts if not a.firing and a.fingerprint in state.last_firing)
        still = state.last_firing & frozenset(a.fingerprint for a in group_alerts if a.firing)
        if state.last_sent_at is None:
            due = bool(firing) and now - state.created_at >= route.group_wait
        elif firing - state.last_firing or resolved:  # something new to say
            due = now - state.last_sent_at >= route.group_interval
        else:  # the same firing alerts (or fewer, muted): a reminder
            due = bool(firing) and now - state.last_sent_at >= route.repeat_interval
        if due:
            sends.append(
                Dispatch(
                    receiver=route.receiver,
                    group_key=key,
                    group_labels=grouping,
                    firing=tuple(sorted(firing_alerts, key=lambda a: a.fingerprint)),
                    resolved=tuple(sorted(resolved, key=lambda a: a.fingerprint)),
                )
            )
            # remember muted-but-firing alerts already paged, so their resolve is still owed
            state = GroupState(created_at=state.created_at, last_sent_at=now, last_firing=firing | (still & muted_now))
        if state.last_firing or firing:
            new_groups[key] = state
    return new_groups, sends
