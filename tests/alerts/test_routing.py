"""Alertmanager-shaped routing (issue 7, item 4): tree and ``continue``, grouping timers,
inhibition, silences — with the clock as a parameter."""

from __future__ import annotations

import pytest

from alerts.routing import (
    Alert,
    Dispatch,
    InhibitRule,
    Route,
    Silence,
    dispatch,
    group_key,
    parse_matcher,
    route_alert,
)


def m(*texts: str) -> tuple:
    return tuple(parse_matcher(t) for t in texts)


TREE = Route(
    receiver="default-log",
    group_by=("alertname",),
    group_wait=30,
    group_interval=300,
    repeat_interval=3600,
    routes=(
        Route(receiver="pagerduty", matchers=m('severity="page"'), group_by=("alertname", "engine"), continue_=True),
        Route(receiver="slack", matchers=m('severity=~"page|ticket"')),
        Route(receiver="never", matchers=m('severity="page"')),  # shadowed by slack
    ),
)


def alert(fp: str, firing: bool = True, **labels: str) -> Alert:
    return Alert(fingerprint=fp, labels={"alertname": "Drop", **labels}, firing=firing)


def test_matchers() -> None:
    assert parse_matcher('form=~"swa.*"').matches({"form": "swa_window"})
    assert not parse_matcher('form=~"swa"').matches({"form": "swa_window"})  # anchored
    assert parse_matcher('tier!="host"').matches({})  # a missing label is ""
    assert parse_matcher('x="a\\"b"').value == 'a"b'
    assert parse_matcher('engine!~"e[0-9]+"').matches({"engine": "replay-1"})
    assert parse_matcher("severity=page") == parse_matcher('severity="page"')  # unquoted, as Alertmanager
    for bad in ("severity", 'sev-erity="x"', 'x=~"("', "x=a b", "engine==e1", "engine=~~x"):
        with pytest.raises(ValueError):
            parse_matcher(bad)


def test_tree_first_match_continue_and_inheritance() -> None:
    routes = route_alert(TREE, {"alertname": "Drop", "severity": "page", "engine": "e1"})
    assert [(r.receiver, r.group_by, r.group_wait) for r in routes] == [
        ("pagerduty", ("alertname", "engine"), 30),
        ("slack", ("alertname",), 30),
    ]
    assert [r.receiver for r in route_alert(TREE, {"severity": "ticket"})] == ["slack"]
    assert [r.receiver for r in route_alert(TREE, {"severity": "info"})] == ["default-log"]
    with pytest.raises(ValueError, match="root route needs a receiver"):
        route_alert(Route(), {})


def sends(notes: list[Dispatch]) -> list[tuple[str, str, list[str], list[str]]]:
    return [(d.receiver, d.group_key, [a.fingerprint for a in d.firing], [a.fingerprint for a in d.resolved]) for d in notes]


def test_group_wait_group_interval_repeat_and_resolve() -> None:
    tree = Route(receiver="r", group_by=("alertname",), group_wait=30, group_interval=300, repeat_interval=3600)
    groups: dict = {}
    a1, a2 = alert("a1", engine="e1"), alert("a2", engine="e2")
    groups, notes = dispatch(tree, [a1], 0, groups)
    assert notes == []  # group_wait
    groups, notes = dispatch(tree, [a1, a2], 30, groups)
    assert sends(notes) == [("r", '{}:{alertname="Drop"}', ["a1", "a2"], [])]  # both, batched
    groups, notes = dispatch(tree, [a1, a2], 60, groups)
    assert notes == []  # nothing new
    a3 = alert("a3", engine="e3")
    groups, notes = dispatch(tree, [a1, a2, a3], 100, groups)
    assert notes == []  # new alert, but within group_interval
    groups, notes = dispatch(tree, [a1, a2, a3], 330, groups)
    assert sends(notes) == [("r", '{}:{alertname="Drop"}', ["a1", "a2", "a3"], [])]
    groups, notes = dispatch(tree, [a1, a2, a3], 330 + 3599, groups)
    assert notes == []
    groups, notes = dispatch(tree, [a1, a2, a3], 330 + 3600, groups)
    assert len(notes) == 1  # repeat_interval reminder
    resolved = [alert("a1", firing=False, engine="e1"), alert("a2", firing=False, engine="e2"), alert("a3", firing=False, engine="e3")]
    groups, notes = dispatch(tree, resolved, 330 + 3600 + 300, groups)
    assert sends(notes) == [("r", '{}:{alertname="Drop"}', [], ["a1", "a2", "a3"])]
    assert groups == {}  # nothing firing, everything reported
    groups, notes = dispatch(tree, resolved, 10_000, groups)
    assert notes == [] and groups == {}  # a resolve is reported once


def test_an_alert_resolved_before_its_first_notification_is_never_sent() -> None:
    tree = Route(receiver="r", group_wait=30)
    groups, _ = dispatch(tree, [alert("a1")], 0, {})
    groups, notes = dispatch(tree, [alert("a1", firing=False)], 10, groups)
    groups, notes2 = dispatch(tree, [alert("a1", firing=False)], 60, groups)
    assert notes == notes2 == [] and groups == {}


def test_inhibition_and_silences() -> None:
    tree = Route(receiver="r", group_by=("alertname", "engine"), group_wait=0)
    silent = Alert(fingerprint="s", labels={"alertname": "EngineSilent", "engine": "e1"}, firing=True)
    drop_e1, drop_e2 = alert("d1", engine="e1"), alert("d2", engine="e2")
    rule = InhibitRule(source_matchers=m('alertname="EngineSilent"'), target_matchers=m('alertname="Drop"'), equal=("engine",))
    _, notes = dispatch(tree, [silent, drop_e1, drop_e2], 0, {}, inhibit_rules=[rule])
    assert sorted(fp for d in notes for fp in (a.fingerprint for a in d.firing)) == ["d2", "s"]  # d1 inhibited
    window = Silence(id="maint", matchers=m('engine="e2"'), starts_at=0, ends_at=100)
    _, notes = dispatch(tree, [drop_e2], 50, {}, silences=[window])
    assert notes == []
    _, notes = dispatch(tree, [drop_e2], 100, {}, silences=[window])  # expired
    assert [a.fingerprint for d in notes for a in d.firing] == ["d2"]


def test_group_by_all_labels() -> None:
    tree = Route(receiver="r", group_by=("...",), group_wait=0)
    _, notes = dispatch(tree, [alert("a1", engine="e1"), alert("a2", engine="e2")], 0, {})
    assert [d.group_labels for d in notes] == [{"alertname": "Drop", "engine": "e1"}, {"alertname": "Drop", "engine": "e2"}]


# -- regressions from the review --------------------------------------------------------------------
from alerts.routing import owed_resolves  # noqa: E402


def test_alerts_matching_both_sides_of_an_inhibit_rule_do_not_mute_each_other() -> None:
    tree = Route(receiver="r", group_by=("alertname",), group_wait=0)
    rule = InhibitRule(source_matchers=m('severity="page"'), target_matchers=m('severity=~"page|ticket"'), equal=("engine",))
    a = Alert(fingerprint="a", labels={"alertname": "Drop", "severity": "page", "engine": "e1"}, firing=True)
    b = Alert(fingerprint="b", labels={"alertname": "Silent", "severity": "page", "engine": "e1"}, firing=True)
    t = Alert(fingerprint="t", labels={"alertname": "Spike", "severity": "ticket", "engine": "e1"}, firing=True)
    _, notes = dispatch(tree, [a, b, t], 0, {}, inhibit_rules=[rule])
    assert sorted(x.fingerprint for d in notes for x in d.firing) == ["a", "b"]  # the ticket is inhibited


def test_a_muted_group_keeps_its_state_and_its_resolve_is_delivered() -> None:
    tree = Route(receiver="r", group_by=("alertname", "engine"), group_wait=30, group_interval=300, repeat_interval=3600)
    drop = alert("drop", engine="e1")
    groups, notes = dispatch(tree, [drop], 0, {})
    groups, notes = dispatch(tree, [drop], 30, groups)
    assert len(notes) == 1
    window = Silence(id="s", matchers=m('engine="e1"'), starts_at=40, ends_at=1000)
    groups, notes = dispatch(tree, [drop], 100, groups, silences=[window])
    groups, notes = dispatch(tree, [drop], 400, groups, silences=[window])
    assert notes == [] and groups  # silenced: no page, the group is kept
    groups, notes = dispatch(tree, [alert("drop", firing=False, engine="e1")], 500, groups, silences=[window])
    assert [(list(d.firing), [x.fingerprint for x in d.resolved]) for d in notes] == [([], ["drop"])]  # resolves are never muted
    groups, notes = dispatch(tree, [drop], 1100, groups)
    assert notes == []  # a new group: group_wait first, no double page


def test_with_continue_each_group_reports_its_resolve() -> None:
    tree = Route(receiver="r", group_wait=0, group_interval=50, routes=(
        Route(receiver="pd", matchers=m('severity="page"'), continue_=True, group_interval=50),
        Route(receiver="slack", matchers=m('severity="page"'), group_interval=300),
    ))  # fmt: skip
    a = alert("a", severity="page")
    groups, notes = dispatch(tree, [a], 0, {})
    assert sorted(d.receiver for d in notes) == ["pd", "slack"]
    gone = alert("a", firing=False, severity="page")
    groups, notes = dispatch(tree, [gone], 100, groups)
    assert [d.receiver for d in notes] == ["pd"] and owed_resolves(groups) == {"a"}
    groups, notes = dispatch(tree, [gone], 300, groups)
    assert [d.receiver for d in notes] == ["slack"] and owed_resolves(groups) == frozenset()


def test_group_keys_survive_reordered_routes_and_are_escaped() -> None:
    first = Route(receiver="r", routes=(Route(receiver="pd", matchers=m('severity="page"')),))
    second = Route(receiver="r", routes=(Route(receiver="db", matchers=m('team="db"')), Route(receiver="pd", matchers=m('severity="page"'))))
    a = alert("a", severity="page")
    assert [group_key(r, a.labels)[0] for r in route_alert(first, a.labels)] == [group_key(r, a.labels)[0] for r in route_alert(second, a.labels)]
    tree = Route(receiver="r", group_by=("a", "b"), group_wait=0)
    x = Alert(fingerprint="x", labels={"a": '1",b="2', "b": "3"}, firing=True)
    y = Alert(fingerprint="y", labels={"a": "1", "b": '2",b="3'}, firing=True)
    _, notes = dispatch(tree, [x, y], 0, {})
    assert len(notes) == 2  # distinct groups
    assert group_key(route_alert(Route(receiver="r", group_by=("cluster", "alertname")), {"alertname": "A"})[0], {"alertname": "A"})[1] == {"alertname": "A"}
    with pytest.raises(ValueError, match="cannot be combined"):
        Route(receiver="r", group_by=("...", "engine"))


def test_silences_are_validated() -> None:
    for matchers, message in ((() , "at least one matcher"), (m('x=~".*"'), "empty string"), (m('x=""'), "empty string")):
        with pytest.raises(ValueError, match=message):
            Silence(id="s", matchers=matchers, starts_at=0, ends_at=10)
    with pytest.raises(ValueError, match="must end after it starts"):
        Silence(id="s", matchers=m('x="1"'), starts_at=10, ends_at=5)
