"""Is the agent answering? The "stale since" badge of every page, and the agent's ``/readyz``.

Every page calls :func:`agent_status_badge` under its title: a small fragment that asks the
agent's ``/readyz`` every :data:`~dashboard.common.REFRESH_SECONDS` (on its own, like the live
panels) and, when that call failed, shows an orange badge with the time of the agent's last
answer in this session — ``stale since 14:03:07 UTC`` (24-hour clock, UTC, as every time the
dashboard shows; with the date when it was another day) — so figures still on screen are not
taken for current ones. Any HTTP answer counts as an answer; only no answer at all (refused
connection, timeout) makes the page stale.

:func:`check_agent` is the call itself; the Overview's ingest health shows the ``/readyz``
status it returns (degraded with each condition's reason and detail, not ready with the reasons:
:func:`readiness_notice`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import streamlit as st

from dashboard.client import AgentClient, AgentError
from dashboard.common import REFRESH_SECONDS, remember_limits

ANSWERED_KEY = "kvscope_agent_answered_at"
"""Session state: agent URL → unix seconds of that agent's last answer in this session."""
PROBE_TIMEOUT_SECONDS = 2.0
"""The ``/readyz`` call's timeout, in seconds (shorter than the queries': a hung agent must not
hold the page)."""


@dataclass(frozen=True, slots=True)
class AgentStatus:
    """One ``/readyz`` call's outcome.

    Attributes:
        readiness: the ``/readyz`` body (``status`` ready, degraded or not_ready); ``None`` when
            the call got no answer.
        answered_at: unix seconds of the agent's last answer in this session (this call's, when
            it answered); ``None`` when it never answered.
        error: why the call failed (``None`` when it answered).
    """

    readiness: dict[str, Any] | None
    answered_at: float | None
    error: str | None = None

    @property
    def stale(self) -> bool:
        """The latest call got no answer."""
        return self.readiness is None


def check_agent(client: AgentClient, *, now: float | None = None) -> AgentStatus:
    """Ask the agent's ``/readyz`` (timeout :data:`PROBE_TIMEOUT_SECONDS`) and note the answer's
    time in the session, and the query timeout its limits imply
    (:func:`dashboard.common.remember_limits`). Never raises for an unreachable agent."""
    answered: dict[str, float] = st.session_state.setdefault(ANSWERED_KEY, {})
    probe = dataclasses.replace(client, timeout_seconds=min(client.timeout_seconds, PROBE_TIMEOUT_SECONDS))
    try:
        body = probe.readyz()
    except AgentError as exc:
        return AgentStatus(readiness=None, answered_at=answered.get(client.base_url), error=str(exc))
    answered[client.base_url] = time.time() if now is None else now
    remember_limits(client, body)
    return AgentStatus(readiness=body, answered_at=answered[client.base_url])


def utc_text(unix: float, *, now: float) -> str:
    """``14:03:07 UTC``, or ``2026-05-01 14:03:07 UTC`` when ``unix`` is not on ``now``'s UTC day."""
    when, today = datetime.fromtimestamp(unix, UTC), datetime.fromtimestamp(now, UTC)
    return when.strftime("%H:%M:%S UTC" if when.date() == today.date() else "%Y-%m-%d %H:%M:%S UTC")


def stale_label(status: AgentStatus, *, now: float) -> str | None:
    """The badge's text, or ``None`` when the agent answered."""
    if not status.stale:
        return None
    if status.answered_at is None:
        return "Stale: the agent has not answered since this page opened"
    return f"Stale since {utc_text(status.answered_at, now=now)}: the agent stopped answering"


@st.fragment(run_every=REFRESH_SECONDS)
def agent_status_badge(client: AgentClient) -> None:
    """The "stale since" badge (nothing while the agent answers); reruns on its own."""
    status = check_agent(client)
    label = stale_label(status, now=time.time())
    if label is not None:
        st.badge(label, icon=":material/history:", color="orange", help=status.error)


def readiness_notice(status: AgentStatus) -> None:
    """The agent's ``/readyz`` status, when it is not plain ready: a warning listing each
    degraded condition (reason, detail, since when), an error listing why it is not ready."""
    body = status.readiness
    if body is None or body.get("status") == "ready":
        return
    now = time.time()
    conditions = [
        f"- **{item.get('reason')}** (since {utc_text(float(item.get('since') or 0), now=now)}): {item.get('detail')}"
        for item in body.get("degraded") or []
    ]
    if body.get("status") == "not_ready":
        reasons = "\n".join(f"- {reason}" for reason in body.get("reasons") or [])
        extra = "\n\nAlso degraded:\n" + "\n".join(conditions) if conditions else ""
        st.error(f"Agent not ready: it cannot store new batches.\n\n{reasons}{extra}", icon=":material/error:")
    else:
        st.warning("Agent degraded: it stores and answers, but an operator must look.\n\n" + "\n".join(conditions), icon=":material/warning:")
