"""The Alerts page: what is firing or pending now, what happened, and the silences.

* **Firing and pending** (``GET /v1/alerts``, refreshed every :data:`REFRESH_SECONDS`): state,
  alert, labels, value, since when, summary and the runbook link; below it the rule-group
  evaluations that were due and did not run since the agent started
  (``GET /v1/alerts/missed-evaluations``: misfired, overrun, coalesced), and each rule's last
  evaluation (``GET /v1/alerts/rules``): "no data" with the volume a series saw against the
  volume the rule needs, so a drill that never pages says why;
* **Silences** (``GET/POST /v1/silences``, ``DELETE /v1/silences/{id}``): the list with states,
  a form to create one (matchers in Alertmanager's syntax, one per line) and a button to expire
  one;
* **History** (the ``alerts_recent`` named query): transitions, and with "deliveries" also the
  notifications sent and the failed deliveries (receiver, error).

The sidebar's engine filter narrows the firing, pending and history tables to that engine.
"""

from __future__ import annotations

import getpass
import json
from datetime import UTC, datetime

import pandas as pd
import streamlit as st

from dashboard.agent_status import agent_status_badge
from dashboard.client import AgentClient, AgentError
from dashboard.common import REFRESH_SECONDS, Filters, current_client, query, sidebar_filters

HISTORY_LIMIT = 500


def render() -> None:
    """The page body (called by ``st.navigation``)."""
    st.title("Alerts")
    client = current_client()
    agent_status_badge(client)
    filters = sidebar_filters(client)
    active_panel(client, filters)
    missed_panel(client)
    rules_panel(client)
    silences_panel(client)
    history_panel(client, filters)


def _when(unix: float | None) -> str:
    if unix is None or pd.isna(unix):
        return ""
    return datetime.fromtimestamp(float(unix), UTC).strftime("%Y-%m-%d %H:%M:%S")


@st.fragment(run_every=REFRESH_SECONDS)
def active_panel(client: AgentClient, filters: Filters) -> None:
    """Firing and pending alerts, live."""
    st.subheader("Firing and pending")
    try:
        alerts = client.active_alerts()
    except AgentError as exc:
        st.error(str(exc))
        return
    if filters.engine is not None:
        alerts = [a for a in alerts if a["labels"].get("engine") == filters.engine]
    if not alerts:
        st.success("Nothing is firing or pending.")
        return
    firing = sum(a["state"] == "firing" for a in alerts)
    st.metric("Firing", firing)
    rows = pd.DataFrame(
        [
            {
                "state": a["state"],
                "alert": a["alertname"],
                "labels": ", ".join(f"{k}={v}" for k, v in sorted(a["labels"].items())),
                "value": a["value"],
                "since (UTC)": _when(a["firing_since"] if a["state"] == "firing" else a["active_at"]),
                "summary": a["annotations"].get("summary", ""),
                "runbook": a["annotations"].get("runbook_url") or None,
            }
            for a in alerts
        ]
    )
    st.dataframe(
        rows,
        hide_index=True,
        column_config={"runbook": st.column_config.LinkColumn("runbook", display_text="runbook")},
    )


@st.fragment(run_every=REFRESH_SECONDS)
def rules_panel(client: AgentClient) -> None:
    """Each rule's last evaluation, live: "no data" per series without enough volume, and what it saw."""
    st.subheader("Rules")
    try:
        rules = client.rule_health()
    except AgentError as exc:
        st.caption(f"Rule evaluations: unknown ({exc})")
        return
    rows = []
    for r in rules:
        base = {"alert": r["alert"], "kind": r["kind"], "evaluated (UTC)": _when(r["evaluated_at"]), "series": r["series"]}
        if r["evaluated_at"] is None:
            rows.append({**base, "state": "not evaluated yet", "labels": "", "detail": ""})
        for entry in r["no_data"]:
            labels = ", ".join(f"{k}={v}" for k, v in sorted(entry["labels"].items()))
            rows.append({**base, "state": "no data", "labels": labels, "detail": f"{entry['detail']} (since {_when(entry['since'])})"})
        if r["evaluated_at"] is not None and not r["no_data"]:
            rows.append({**base, "state": "ok", "labels": "", "detail": ""})
    without = sum(1 for r in rules if r["no_data"])
    if without:
        st.warning(f"{without} rule(s) lack the volume to judge some series: they can neither fire nor resolve those (no data, never 0 %).")
    st.dataframe(pd.DataFrame(rows, columns=["state", "alert", "labels", "detail", "kind", "series", "evaluated (UTC)"]), hide_index=True)


@st.fragment(run_every=REFRESH_SECONDS)
def missed_panel(client: AgentClient) -> None:
    """Evaluations due and not run, live: a caption when none, else a warning and the counts."""
    try:
        missed = [m for m in client.missed_evaluations() if m["count"]]
    except AgentError as exc:
        st.caption(f"Missed rule evaluations: unknown ({exc})")
        return
    if not missed:
        st.caption("No rule evaluation was missed since the agent started.")
        return
    total = sum(int(m["count"]) for m in missed)
    st.warning(
        f"{total} rule evaluation(s) were due and did not run since the agent started: alerts may "
        "fire or resolve late (kvscope_alert_evaluations_missed_total)."
    )
    st.dataframe(
        pd.DataFrame(
            [
                {"group": m["group"], "reason": m["reason"], "missed": m["count"], "last due (UTC)": _when(m["last_due_at"])}
                for m in missed
            ]
        ),
        hide_index=True,
    )


def silences_panel(client: AgentClient) -> None:
    """The silences, and forms to create and expire them."""
    st.subheader("Silences")
    try:
        silences = client.silences()
    except AgentError as exc:
        st.error(str(exc))
        return
    if silences:
        st.dataframe(
            pd.DataFrame(
                [
                    {
                        "state": s["state"],
                        "matchers": " ".join(s["matchers"]),
                        "starts (UTC)": _when(s["starts_at"]),
                        "ends (UTC)": _when(s["ends_at"]),
                        "created by": s["created_by"],
                        "comment": s["comment"],
                        "id": s["id"],
                    }
                    for s in silences
                ]
            ),
            hide_index=True,
        )
    else:
        st.caption("No silences.")
    with st.form("new_silence", clear_on_submit=False):
        st.markdown("**New silence** — alerts matching every matcher are not notified")
        matchers = st.text_area("Matchers, one per line", placeholder='engine="e1"\nalertname=~"RecoverableHitRate.*"')
        duration = st.text_input("Duration", value="1h")
        comment = st.text_input("Comment")
        author = st.text_input("Created by", value=_user())
        if st.form_submit_button("Create silence"):
            try:
                created = client.create_silence(
                    matchers=[line.strip() for line in matchers.splitlines() if line.strip()],
                    duration=duration.strip(),
                    comment=comment,
                    created_by=author,
                )
            except AgentError as exc:
                st.error(f"The silence was not created: {exc}")
            else:
                st.success(f"Silence {created['id']} created, until {_when(created['ends_at'])} UTC.")
    live = [s for s in silences if s["state"] != "expired"]
    if live:
        chosen = st.selectbox(
            "Expire a silence", [s["id"] for s in live], format_func=lambda i: _label(i, live), key="expire_silence"
        )
        if st.button("Expire"):
            try:
                client.expire_silence(chosen)
            except AgentError as exc:
                st.error(f"The silence was not expired: {exc}")
            else:
                st.success(f"Silence {chosen} expired.")


def _label(silence_id: str, silences: list[dict[str, object]]) -> str:
    found = next(s for s in silences if s["id"] == silence_id)
    return f"{' '.join(found['matchers'])} — {found['comment']} ({silence_id[:8]})"  # type: ignore[arg-type]


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""


def history_panel(client: AgentClient, filters: Filters) -> None:
    """Transitions, optionally with deliveries, newest first."""
    st.subheader("History")
    deliveries = st.toggle("Show deliveries (notifications sent and failed)", key="alerts_deliveries")
    try:
        rows = query(client, "alerts_recent", limit=HISTORY_LIMIT)
    except AgentError as exc:
        st.error(str(exc))
        return
    if not deliveries:
        rows = rows[rows["event"] == "transition"]
    if filters.engine is not None:
        rows = rows[[json.loads(labels).get("engine") == filters.engine for labels in rows["labels"]]]
    if rows.empty:
        st.caption("No alerts yet.")
        return
    columns = ["ts", "alert", "state", "value", "labels", "summary"]
    if deliveries:
        columns += ["event", "receiver", "error"]
    st.dataframe(rows[columns], hide_index=True)
