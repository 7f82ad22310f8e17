"""A rule's alert state as the outside sees it: what the notifier pushes and routes
(:func:`outgoing_of`, :func:`resolve_of`) and what ``GET /v1/alerts`` lists (:func:`active_view`).

Pure functions of one :class:`alerts.rule_eval.AlertState` and its rule (``None`` when the rule
left the file); :class:`alerts.rule_scheduler.RuleScheduler` calls them.
"""

from __future__ import annotations

from alerts.notifier import OutgoingAlert
from alerts.routing import Alert
from alerts.rule_eval import AlertState, Status
from alerts.rulefile import Rule, render_template


def _starts(st: AlertState, default: float) -> float:
    # as Prometheus: an alert starts when it became active (pending), kept while it fires
    return next((t for t in (st.active_since, st.firing_since, st.evaluated_at) if t is not None), default)


def outgoing_of(st: AlertState, rule: Rule | None) -> OutgoingAlert | None:
    """``st`` as the notifier sees it (None while pending or inactive): labels with ``alertname``
    added, annotations rendered with the last value."""
    if st.status not in (Status.FIRING, Status.RESOLVED):
        return None
    templates = rule.annotations if rule is not None else {}
    labels = {**dict(st.labels), "alertname": st.alert}
    annotations = {k: render_template(t, st.labels, st.value) for k, t in templates.items()}
    alert = Alert(fingerprint=st.fingerprint, labels=labels, firing=st.status == Status.FIRING, annotations=annotations, value=st.value)
    return OutgoingAlert(alert=alert, name=st.alert, starts_at=_starts(st, 0.0), resolved_at=st.resolved_at)


def resolve_of(st: AlertState, at: float) -> OutgoingAlert:
    """The explicit resolve at ``at`` (unix seconds) of a dropped alert, as its pushes labelled it."""
    alert = Alert(fingerprint=st.fingerprint, labels={**dict(st.labels), "alertname": st.alert}, firing=False, value=st.value)
    return OutgoingAlert(alert=alert, name=st.alert, starts_at=_starts(st, at), resolved_at=at)


def active_view(st: AlertState, rule: Rule | None) -> dict[str, object]:
    """One pending or firing alert as ``GET /v1/alerts`` lists it, annotations rendered."""
    templates = rule.annotations if rule is not None else {}
    return {
        "alertname": st.alert,
        "state": st.status.value,
        "labels": dict(st.labels),
        "annotations": {k: render_template(t, st.labels, st.value) for k, t in templates.items()},
        "value": st.value,
        "active_at": st.active_since,
        "firing_since": st.firing_since,
    }
