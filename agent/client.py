"""A client of the agent's HTTP API, shared by the CLI and the dashboard.

Named queries (``GET /v1/query/{name}``) are fetched as Arrow streams so column types
(timestamps, integers) survive; ``POST /v1/sql`` answers are returned as they came. Failures
become :class:`AgentError` with a message fit to show a user: "agent unreachable at URL" when
nothing answers, the agent's own reason otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import pyarrow as pa

DEFAULT_AGENT_URL = "http://127.0.0.1:9400"
AGENT_URL_ENV = "KVSCOPE_AGENT_URL"
TOKEN_ENV = "KVSCOPE_TOKEN"
DEFAULT_QUERY_TIMEOUT_SECONDS = 30.0
"""How long :meth:`AgentClient.sql` and :meth:`AgentClient.query_table` wait for an answer. It must
exceed the agent's ``sql_timeout_seconds`` + ``sql_queue_timeout_seconds`` (+ 0.1 s for an
interrupt to land): then the agent's own 408 or 429, with its reason, arrives before the client
gives up. The agent's defaults (10 s + 2 s) leave 18 s for transfer; an agent whose limits were
raised says so in its ``/readyz`` body, and :func:`query_timeout_for` derives the timeout from
them (pass it as ``query_timeout_seconds``; the dashboard does)."""
QUERY_TIMEOUT_MARGIN_SECONDS = 18.0
"""Added to the agent's published limits by :func:`query_timeout_for`: the interrupt's grace and
the transfer (the agent's defaults then give :data:`DEFAULT_QUERY_TIMEOUT_SECONDS`)."""


class AgentError(Exception):
    """The agent could not answer; ``str(error)`` is a message for the user."""


def query_timeout_for(readiness: Mapping[str, Any]) -> float | None:
    """The query timeout, seconds, fit for the agent whose ``/readyz`` body is ``readiness``:
    its ``limits.sql_timeout_seconds`` + ``limits.sql_queue_timeout_seconds`` +
    :data:`QUERY_TIMEOUT_MARGIN_SECONDS`; ``None`` when the body names no such limits (an older
    agent) or they are not non-negative finite numbers."""
    limits = readiness.get("limits")
    if not isinstance(limits, Mapping):
        return None
    parts: list[float] = []
    for value in (limits.get("sql_timeout_seconds"), limits.get("sql_queue_timeout_seconds")):
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < float("inf"):
            return None
        parts.append(float(value))
    return sum(parts) + QUERY_TIMEOUT_MARGIN_SECONDS


def default_agent_url(environ: Mapping[str, str] = os.environ) -> str:
    """``KVSCOPE_AGENT_URL``, else :data:`DEFAULT_AGENT_URL`."""
    return environ.get(AGENT_URL_ENV) or DEFAULT_AGENT_URL


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentClient:
    """Talks to one agent.

    Attributes:
        base_url: the agent's root URL, e.g. ``http://127.0.0.1:9400``.
        token: bearer token, when the agent requires one (default: ``KVSCOPE_TOKEN``).
        timeout_seconds: per request (connect and read), except queries.
        query_timeout_seconds: per ``/v1/sql`` or ``/v1/query`` request (``timeout_seconds`` when
            that is larger); see :data:`DEFAULT_QUERY_TIMEOUT_SECONDS` for how it relates to the
            agent's limits.

    Raises:
        ValueError: a URL that is not http(s) or a non-positive timeout.
    """

    base_url: str = DEFAULT_AGENT_URL
    token: str | None = field(default_factory=lambda: os.environ.get(TOKEN_ENV) or None)
    timeout_seconds: float = 5.0
    query_timeout_seconds: float = DEFAULT_QUERY_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"agent URL must start with http:// or https://, got {self.base_url!r}")
        if not self.timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0, got {self.timeout_seconds}")
        if not self.query_timeout_seconds > 0:
            raise ValueError(f"query_timeout_seconds must be > 0, got {self.query_timeout_seconds}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))

    def _request(self, method: str, path: str, *, timeout: float | None = None, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        seconds = self.timeout_seconds if timeout is None else timeout
        try:
            return httpx.request(method, f"{self.base_url}{path}", headers=headers, timeout=seconds, **kwargs)
        except httpx.TimeoutException:
            raise AgentError(f"agent at {self.base_url} did not answer within {seconds:g} s") from None
        except httpx.TransportError as exc:
            raise AgentError(f"agent unreachable at {self.base_url} ({exc})") from None
        except httpx.InvalidURL as exc:
            raise AgentError(f"{self.base_url}{path} is not a valid URL ({exc})") from None

    def query_table(self, name: str, **params: object) -> pa.Table:
        """Run the named query ``name`` (``None`` parameters are left out).

        Raises:
            AgentError: the agent is unreachable, or refused the query (its reason included).
        """
        args = {k: str(v) for k, v in {**params, "format": "arrow"}.items() if v is not None}
        response = self._request("GET", f"/v1/query/{name}", params=args, timeout=max(self.timeout_seconds, self.query_timeout_seconds))
        if response.status_code != 200:
            raise AgentError(
                f"agent at {self.base_url} refused query {name} (HTTP {response.status_code}): {_reason(response)}"
            )
        try:
            return pa.ipc.open_stream(response.content).read_all()
        except pa.ArrowInvalid as exc:
            raise AgentError(f"agent at {self.base_url} sent an unreadable answer: {exc}") from None

    def query(self, name: str, **params: object) -> list[dict[str, Any]]:
        """The named query's rows as dicts."""
        return self.query_table(name, **params).to_pylist()

    def sql(self, sql: str, fmt: str = "json") -> httpx.Response:
        """The answer of ``POST /v1/sql`` in ``fmt`` (json, csv or arrow).

        Raises:
            AgentError: unreachable, or the query was refused (the agent's reason included).
        """
        response = self._request("POST", "/v1/sql", json={"sql": sql, "format": fmt}, timeout=max(self.timeout_seconds, self.query_timeout_seconds))
        if response.status_code != 200:
            raise AgentError(f"HTTP {response.status_code}: {_reason(response)}")
        return response

    def active_alerts(self) -> list[dict[str, Any]]:
        """``GET /v1/alerts``: the alerts pending or firing now.

        Raises:
            AgentError: unreachable, or no rule scheduler runs in the agent.
        """
        return list(self._json("GET", "/v1/alerts")["alerts"])

    def missed_evaluations(self) -> list[dict[str, Any]]:
        """``GET /v1/alerts/missed-evaluations``: per rule group and reason, the evaluations due
        and not run since the agent started.

        Raises:
            AgentError: unreachable, or no rule scheduler runs in the agent.
        """
        return list(self._json("GET", "/v1/alerts/missed-evaluations")["missed"])

    def rule_health(self) -> list[dict[str, Any]]:
        """``GET /v1/alerts/rules``: per rule, its last evaluation and the series it had no data
        for, each with the volume it saw (``detail``).

        Raises:
            AgentError: unreachable, or no rule scheduler runs in the agent.
        """
        return list(self._json("GET", "/v1/alerts/rules")["rules"])

    def silences(self) -> list[dict[str, Any]]:
        """``GET /v1/silences``.

        Raises:
            AgentError: unreachable or refused.
        """
        return list(self._json("GET", "/v1/silences")["silences"])

    def create_silence(self, **body: object) -> dict[str, Any]:
        """``POST /v1/silences`` with ``body`` (see :mod:`agent.app`); returns the silence.

        Raises:
            AgentError: unreachable, or refused (a bad matcher or bad times: the reason included).
        """
        return dict(self._json("POST", "/v1/silences", json=body)["silence"])

    def expire_silence(self, silence_id: str) -> dict[str, Any]:
        """``DELETE /v1/silences/{id}``; returns the silence.

        Raises:
            AgentError: unreachable, or no such silence.
        """
        return dict(self._json("DELETE", f"/v1/silences/{quote(silence_id, safe='')}")["silence"])

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self._request(method, path, **kwargs)
        if response.status_code != 200:
            raise AgentError(f"agent at {self.base_url}: HTTP {response.status_code}: {_reason(response)}")
        try:
            doc = response.json()
        except ValueError:
            raise AgentError(f"agent at {self.base_url} sent an answer that is not JSON") from None
        if not isinstance(doc, dict):
            raise AgentError(f"agent at {self.base_url} sent an unexpected answer")
        return doc

    def readyz(self) -> dict[str, Any]:
        """``GET /readyz``'s body, whatever its status code: ``{"status": "ready" | "degraded" |
        "not_ready", "schema_version", "degraded": [{"reason", "detail", "since"}], "limits",
        "reasons" (not_ready only)}`` (see :func:`agent.readiness.readiness`). An answer that is not such
        an object (an older agent's 503, a 401 for a wrong token) comes back as ``{"status":
        "not_ready", "reasons": [its reason], "degraded": []}``.

        Raises:
            AgentError: nothing answered (unreachable, or no answer within the timeout).
        """
        response = self._request("GET", "/readyz")
        try:
            doc = response.json()
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or doc.get("status") not in ("ready", "degraded", "not_ready"):
            return {"status": "not_ready", "reasons": [f"HTTP {response.status_code}: {_reason(response)}"], "degraded": []}
        return doc

    def ready(self) -> bool:
        """Whether the agent answers ``/readyz`` with 200 (never raises)."""
        try:
            return self._request("GET", "/readyz").status_code == 200
        except AgentError:
            return False


def _reason(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["reason"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase
