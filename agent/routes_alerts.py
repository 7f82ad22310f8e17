"""The alert routes: ``GET /v1/alerts``, ``GET /v1/alerts/missed-evaluations``,
``GET /v1/alerts/rules`` (each rule's last evaluation and its series without data, with the
volume they saw: :mod:`alerts.rule_health`) (from the rule scheduler :func:`agent.server.serve` runs beside the app) and the silences
(``GET``/``POST /v1/silences``, ``DELETE /v1/silences/{id}``). Contracts: :mod:`agent.app`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from agent.api_common import ApiError, read_body
from agent.config import AgentConfig
from agent.store import Store
from alerts import alert_store
from alerts.rulefile import parse_duration


class SilenceRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /v1/silences``."""

    matchers: list[str]
    created_by: str
    comment: str
    ends_at: float | None = None
    duration: str | None = None
    starts_at: float | None = None


SILENCE_MAX_SECONDS = 100 * 365 * 86_400.0
SILENCE_MAX_MATCHERS = 64
SILENCE_MAX_TEXT = 2048
SILENCE_LIST_GRACE_SECONDS = 86_400.0
"""``GET /v1/silences`` lists silences that ended at most this long ago."""


def alert_routes(*, config: AgentConfig, state: Any, current_store: Callable[[], Store]) -> APIRouter:
    """The alert and silence routes; ``state`` is the app's ``state`` (its ``active_alerts`` and
    ``missed_evaluations`` are set by :func:`agent.server.serve`)."""
    router = APIRouter()

    def scheduler_source(name: str) -> Callable[[], Any]:
        """The rule scheduler's ``name`` view, set on ``state`` by :func:`agent.server.serve`."""
        source = getattr(state, name)
        if source is None:
            raise ApiError(503, "no rule scheduler runs in this process")
        return source

    @router.get("/v1/alerts")
    async def active_alerts() -> JSONResponse:
        return JSONResponse({"alerts": await run_in_threadpool(scheduler_source("active_alerts"))})

    @router.get("/v1/alerts/missed-evaluations")
    async def missed_evaluations() -> JSONResponse:
        return JSONResponse({"missed": scheduler_source("missed_evaluations")()})

    @router.get("/v1/alerts/rules")
    async def rule_health() -> JSONResponse:
        return JSONResponse({"rules": scheduler_source("rule_health")()})

    @router.get("/v1/silences")
    async def list_silences() -> JSONResponse:
        target = current_store()
        now = time.time()
        found = await run_in_threadpool(lambda: alert_store.load_silences(target, ended_after=now - SILENCE_LIST_GRACE_SECONDS))
        return JSONResponse({"silences": [alert_store.silence_json(s, now) for s in found]})

    @router.post("/v1/silences")
    async def create_silence(request: Request) -> JSONResponse:
        body = await read_body(request, config.max_body_bytes)
        try:
            req = msgspec.json.decode(body, type=SilenceRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ApiError(400, f"invalid request body: {exc}") from None
        now = time.time()
        starts = req.starts_at if req.starts_at is not None else now
        if (req.ends_at is None) == (req.duration is None):
            raise ApiError(400, "give exactly one of ends_at (unix seconds) and duration (such as 2h)")
        if req.duration is not None:
            try:
                ends = starts + parse_duration(req.duration)
            except ValueError as exc:
                raise ApiError(400, f"duration: {exc}") from None
        else:
            assert req.ends_at is not None
            ends = req.ends_at
        if not (math.isfinite(starts) and math.isfinite(ends)) or not (starts >= 0 and ends <= now + SILENCE_MAX_SECONDS):
            raise ApiError(400, "starts_at and ends_at must be unix seconds from 1970 up to 100 years from now")
        if not req.created_by.strip() or not req.comment.strip():
            raise ApiError(400, "created_by and comment must not be empty (who silenced what, and why)")
        if len(req.matchers) > SILENCE_MAX_MATCHERS or max(len(req.created_by), len(req.comment)) > SILENCE_MAX_TEXT:
            raise ApiError(
                400, f"a silence takes at most {SILENCE_MAX_MATCHERS} matchers and {SILENCE_MAX_TEXT} characters of created_by and comment"
            )
        if any(ch < " " and ch not in "\t\n" for ch in req.created_by + req.comment):
            raise ApiError(400, "created_by and comment must not contain control characters")
        target = current_store()
        try:
            silence = await run_in_threadpool(
                lambda: alert_store.create_silence(
                    target,
                    matchers=req.matchers,
                    starts_at=starts,
                    ends_at=ends,
                    created_by=req.created_by,
                    comment=req.comment,
                    now=now,
                )
            )
        except alert_store.SilenceError as exc:
            raise ApiError(400, str(exc)) from None
        return JSONResponse({"silence": alert_store.silence_json(silence, now)})

    @router.delete("/v1/silences/{silence_id}")
    async def expire_silence(silence_id: str) -> JSONResponse:
        target = current_store()
        now = time.time()
        try:
            silence = await run_in_threadpool(lambda: alert_store.expire_silence(target, silence_id, now=now))
        except alert_store.SilenceError as exc:
            raise ApiError(404, str(exc)) from None
        return JSONResponse({"silence": alert_store.silence_json(silence, now)})

    return router

