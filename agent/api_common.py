"""What the agent's routes share: the uniform error body, the bearer-token middleware, reading a
bounded body, and result answers (:mod:`agent.app` builds the app from them)."""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from agent import sql
from agent.config import AgentConfig

OPEN_PATHS = frozenset({"/healthz"})
"""Paths that never need the token."""


def error_response(status: int, reason: str, **extra: Any) -> JSONResponse:
    """The uniform error body ``{"error": {"reason": ..., **extra}}``."""
    return JSONResponse({"error": {"reason": reason, **extra}}, status_code=status)


class ApiError(Exception):
    """An error answer raised from a route: ``status``, ``reason`` and extra keys of the body."""

    def __init__(self, status: int, reason: str, **extra: Any) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.extra = extra


def resolve_token(config: AgentConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The bearer token in force: ``config.token``, else ``KVSCOPE_TOKEN``, else none."""
    return config.token or environ.get("KVSCOPE_TOKEN") or None


class BearerAuth:
    """ASGI middleware: every HTTP path but ``open_paths`` needs ``Authorization: Bearer``."""

    def __init__(self, app: ASGIApp, *, token: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()
        self._open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        response = error_response(401, "missing or wrong bearer token")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) anything over ``max_bytes`` without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"body of {declared} bytes exceeds the limit of {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def retry_later(reason: str) -> JSONResponse:
    response = error_response(503, reason)
    response.headers["Retry-After"] = "1"
    return response


def result_response(result: sql.ResultSet, fmt: sql.ResultFormat) -> Response:
    return Response(
        sql.render(result, fmt),
        media_type=sql.MEDIA_TYPES[fmt],
        headers={"X-KVScope-Truncated": "true" if result.truncated else "false"},
    )
