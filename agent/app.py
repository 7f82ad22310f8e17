"""The agent's HTTP API (DESIGN.md §6), a FastAPI application.

Endpoints:

* ``POST /v1/events`` — one event batch, ``application/json`` or ``application/msgpack``
  (``application/x-msgpack``). 200 ``{"status": "stored"|"duplicate", "events": n}``, sent only
  after the batch's transaction committed (:mod:`agent.pipeline`); 415 for another content type;
  413 above ``max_body_bytes``; 422 ``{"error": {"path", "reason"}}`` for a batch that breaks
  the contract (nothing of it is stored); 409 for a seq already stored with other events; 503
  with ``Retry-After`` when the ingest queue is full or the store failed (nothing stored: send
  it again).
* ``POST /v1/sql`` — ``{"sql": str, "format": "json"|"csv"|"arrow", "limit": int?}`` through the
  read-only sandbox (:mod:`agent.sql`). 400 bad SQL or request, 403 not a single SELECT, 408 time
  limit. ``limit`` is capped by ``sql_row_limit``. 429 with ``Retry-After`` when
  ``sql_max_concurrent_queries`` queries (this and named ones) run and none ends within
  ``sql_queue_timeout_seconds`` (:mod:`agent.query_gate`).
* ``GET /v1/query/{name}`` — a named query (:mod:`agent.queries`), parameters in the query
  string plus ``format``. 404 unknown query, 400 bad parameter, 408 and 429 as for ``/v1/sql``.
* ``GET /v1/alerts`` — the alerts pending or firing now (as Prometheus's ``/api/v1/alerts``):
  ``{"alerts": [{"alertname", "state", "labels", "annotations", "value", "active_at",
  "firing_since"}]}``; 503 when no rule scheduler runs beside the app.
* ``GET /v1/alerts/missed-evaluations`` — rule-group evaluations that were due and did not run
  since the agent started (:mod:`alerts.missed_evaluations`): ``{"missed": [{"group",
  "reason", "count", "last_due_at"}]}``; 503 when no rule scheduler runs beside the app.
* ``GET /v1/silences`` — every silence not expired more than a day ago, with its ``state``
  (pending, active, expired); ``POST /v1/silences`` — ``{"matchers": ["engine=\"e1\""],
  "ends_at": unix s | "duration": "2h", "starts_at": unix s?, "created_by": str, "comment": str}``
  creates one (200 with it, 400 for a bad matcher or bad times); ``DELETE /v1/silences/{id}``
  expires one (404 unknown id). Silences mute matching alerts in the agent's routing
  (:mod:`alerts.notifier`), as Alertmanager's do.
* ``GET /metrics`` — Prometheus text exposition of the agent's own registry, rendered in a worker
  thread (never on the event loop); free-form labels are capped (:mod:`agent.label_cap`).
* ``GET /healthz`` — 200 while the process runs (never needs the token).
* ``GET /readyz`` — 200 ``{"status": "ready"|"degraded", "schema_version", "degraded"}`` once
  the store is open and migrated and the data directory can be written (degraded: conditions of
  :class:`agent.health.Health`, such as a quarantined WAL); else 503 ``{"status": "not_ready",
  "reasons": [...]}`` (:func:`agent.readiness.readiness`).

Errors are JSON ``{"error": {"reason": str, ...}}`` with extra keys where useful (``path`` for
events, ``param`` for query parameters, ``known`` for unknown queries). For CSV and Arrow answers
the ``X-KVScope-Truncated`` header carries ``truncated``.

Authentication: with a token (``config.token``, else ``KVSCOPE_TOKEN``), every path but
``/healthz`` needs ``Authorization: Bearer <token>`` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import hmac
import math
import os
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures.process import BrokenProcessPool
from contextlib import asynccontextmanager
from typing import Any, Literal, cast

import duckdb
import msgspec
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from agent import queries, sql
from agent.config import AgentConfig
from agent.decode import BatchDecoder, Invalid
from agent.durability import Durability
from agent.health import Health
from agent.ingest import record_rejected
from agent.metrics import AgentMetrics
from agent.pipeline import FullPolicy, Ingestor, IngestorClosed, QueueFull, StoreWriteError
from agent.process_metrics import duckdb_memory_bytes
from agent.query_gate import QueryBusy, QueryGate
from agent.readiness import DataDirProbe, readiness
from agent.store import Store, StoreClosedError, utc_now
from alerts import alert_store
from alerts.rulefile import parse_duration
from engine.events import ContentFormat

EVENT_MEDIA_TYPES: dict[str, ContentFormat] = {
    "application/json": "json",
    "application/msgpack": "msgpack",
    "application/x-msgpack": "msgpack",
}
OPEN_PATHS = frozenset({"/healthz"})


def error_response(status: int, reason: str, **extra: Any) -> JSONResponse:
    """The uniform error body ``{"error": {"reason": ..., **extra}}``."""
    return JSONResponse({"error": {"reason": reason, **extra}}, status_code=status)


class _ApiError(Exception):
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


class SqlRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /v1/sql``."""

    sql: str
    format: Literal["json", "csv", "arrow"] = "json"
    limit: int | None = None


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


def create_app(
    config: AgentConfig,
    store: Store | None = None,
    *,
    metrics: AgentMetrics | None = None,
    health: Health | None = None,
    durability: Durability | None = None,
    environ: Mapping[str, str] = os.environ,
) -> FastAPI:
    """Build the agent's application.

    Args:
        config: the agent's settings (limits, token).
        store: an open store the caller owns (and closes). ``None``: the app opens
            ``config.db_path`` at startup and closes it at shutdown (its lifespan).
        metrics: the metrics to update and expose; ``None`` creates a fresh registry. Pass the
            same instance to the alert scheduler so its gauge is exposed here.
        health: the degraded conditions ``/readyz`` reports (``None``: a fresh, healthy
            :class:`agent.health.Health`); :func:`agent.server.serve` passes its own.
        durability: the acknowledgement log and durable watermarks (:mod:`agent.durability`)
            over ``store``; with it every flush is logged, answers carry the engine's
            ``durable_seq`` and the ``agent_instance``, and ``GET /v1/ingest/watermark`` answers.
            ``None`` (tests, an app that opens its own store): answers carry neither, and
            clients treat an acknowledged batch as durable.
        environ: where ``KVSCOPE_TOKEN`` is read from.

    ``app.state.store``, ``app.state.metrics`` and ``app.state.ingestor`` (the ingest pipeline
    over the store; closed — queued batches flushed — when the app shuts down) hold what the app
    uses.
    """
    metrics = metrics if metrics is not None else AgentMetrics(label_max_values=config.metric_label_max_values)
    owns_store = store is None

    def new_ingestor(target: Store) -> Ingestor:
        return Ingestor(
            target,
            metrics,
            max_queue_events=config.ingest_queue_max_events,
            full_policy=cast(FullPolicy, config.ingest_full_policy),
            block_timeout_seconds=config.ingest_block_timeout_seconds,
            flush_max_events=config.flush_max_events,
            on_committed=durability.record if durability is not None else None,
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if owns_store:
            app.state.store = await run_in_threadpool(
                lambda: Store.open(
                    config.db_path,
                    wal_autocheckpoint_bytes=config.checkpoint_wal_bytes,
                    memory_limit_bytes=config.duckdb_memory_limit_bytes,
                    threads=config.duckdb_threads,
                )
            )
            app.state.ingestor = await run_in_threadpool(new_ingestor, app.state.store)
        try:
            yield
        finally:
            ingestor: Ingestor | None = app.state.ingestor
            if ingestor is not None:
                await run_in_threadpool(ingestor.close)
            await run_in_threadpool(decoder.shutdown)
            if owns_store and app.state.store is not None:
                opened, app.state.store = app.state.store, None
                await run_in_threadpool(opened.close)

    app = FastAPI(title="kvscope agent", version="1", lifespan=lifespan)
    app.state.store = store
    app.state.metrics = metrics
    metrics.set_duckdb_memory_source(lambda: duckdb_memory_bytes(app.state.store))
    app.state.config = config
    app.state.health = health if health is not None else Health()
    app.state.data_dir_probe = DataDirProbe(config.data_dir)
    """Whether ``config.data_dir`` can be written: cached, run off the event loop by ``/readyz``."""
    app.state.ingestor = new_ingestor(store) if store is not None else None
    app.state.durability = durability
    if durability is not None and app.state.ingestor is not None:
        durability.attach(app.state.ingestor.tracker)
    decoder = BatchDecoder(config.decode_processes)
    app.state.decoder = decoder
    query_gate = QueryGate(config.sql_max_concurrent_queries, config.sql_queue_timeout_seconds)
    app.state.query_gate = query_gate
    """Caps ``/v1/sql`` and ``/v1/query`` queries running at once (429 past the queue timeout)."""
    app.state.active_alerts = None
    """Set by :func:`agent.server.serve`: the rule scheduler's pending and firing alerts."""
    app.state.missed_evaluations = None
    """Set by :func:`agent.server.serve`: the rule scheduler's missed-evaluation counts."""

    token = resolve_token(config, environ)
    if token is not None:
        app.add_middleware(BearerAuth, token=token, open_paths=OPEN_PATHS)

    def current_store() -> Store:
        current: Store | None = app.state.store
        if current is None or not current.is_open:
            raise _ApiError(503, "the store is not open")
        return current

    def current_ingestor() -> Ingestor:
        current: Ingestor | None = app.state.ingestor
        if current is None:
            raise _ApiError(503, "the ingest pipeline is not running")
        return current

    @app.exception_handler(QueryBusy)
    async def _query_busy(request: Request, exc: QueryBusy) -> JSONResponse:
        response = error_response(exc.status, exc.reason)
        response.headers["Retry-After"] = str(exc.retry_after_seconds)
        return response

    @app.exception_handler(_ApiError)
    async def _api_error(request: Request, exc: _ApiError) -> JSONResponse:
        return error_response(exc.status, exc.reason, **exc.extra)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, "invalid request", details=jsonable_encoder(exc.errors()))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        current: Store | None = app.state.store
        probe: DataDirProbe = app.state.data_dir_probe
        is_open = current is not None and current.is_open
        cached = probe.cached()
        if not is_open:
            disk_problem = None  # no store to write to yet: that is the reason
        elif cached is not None:
            disk_problem = cached.problem
        else:
            disk_problem = await run_in_threadpool(probe.problem)
        status, body = readiness(
            schema_version=current.schema_version if current is not None and is_open else None,
            store_open=is_open,
            disk_problem=disk_problem,
            degraded=app.state.health.degraded,
        )
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        # rendered in a worker thread: a large or slow scrape never holds the event loop
        return Response(await run_in_threadpool(metrics.exposition), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    @app.post("/v1/events")
    async def post_events(request: Request) -> JSONResponse:
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        fmt = EVENT_MEDIA_TYPES.get(media_type)
        if fmt is None:
            metrics.observe_rejected("content_type")
            raise _ApiError(
                415,
                f"unsupported content type {media_type or '(none)'!r}; "
                f"send one of {', '.join(EVENT_MEDIA_TYPES)}",
            )
        try:
            body = await _read_body(request, config.max_body_bytes)
        except _ApiError as exc:
            if exc.status == 413:
                metrics.observe_rejected("too_large")
            raise
        target = current_store()
        ingestor = current_ingestor()
        try:
            decoded = await decoder.decode(body, fmt)
        except BrokenProcessPool:
            metrics.observe_rejected("decode_error")
            return _retry_later("a decode worker died twice in a row; send the batch again")
        if isinstance(decoded, Invalid):
            error = decoded.error()
            filed = await run_in_threadpool(
                lambda: record_rejected(
                    target, body, fmt, error, received_at=utc_now(), tracker=ingestor.tracker
                )
            )
            if isinstance(filed, tuple):
                metrics.seq_gaps.inc()
            metrics.observe_rejected("invalid")
            return error_response(422, error.reason, path=error.path)
        prepared = decoded.batch
        try:
            if config.ingest_full_policy == "block":
                future = await run_in_threadpool(ingestor.submit, prepared)
            else:
                future = ingestor.submit(prepared)
        except QueueFull as exc:
            metrics.observe_rejected("queue_full")
            return _retry_later(str(exc))
        except IngestorClosed as exc:
            return _retry_later(str(exc))
        try:
            # shielded: a cancelled request must not cancel the flush's future, whose batch may
            # already be committed together with others
            outcome = await asyncio.shield(asyncio.wrap_future(future))
        except (duckdb.Error, StoreClosedError, StoreWriteError) as exc:
            return _retry_later(f"the store could not write this batch ({type(exc).__name__}); send it again")
        metrics.observe_ingest(outcome, decoded.summary)
        if outcome.status == "conflict":
            return error_response(
                409,
                f"seq {outcome.seq} of engine {outcome.engine_id!r} was already stored with other "
                "events; give each engine run its own engine_id",
                path="$.seq",
            )
        answer: dict[str, object] = {"status": outcome.status, "events": outcome.events}
        if durability is not None:
            answer["seq"] = outcome.seq
            answer["durable_seq"] = durability.durable_seq(outcome.engine_id)
            answer["agent_instance"] = durability.instance
        return JSONResponse(answer)

    def current_durability() -> Durability:
        if durability is None:
            raise _ApiError(404, "this agent keeps no durable watermarks (no acknowledgement log)")
        return durability

    def watermark_answer(engine_id: str) -> JSONResponse:
        current = current_durability()
        return JSONResponse({"engine_id": engine_id, "durable_seq": current.durable_seq(engine_id), "agent_instance": current.instance})

    @app.get("/v1/ingest/watermark")
    async def ingest_watermark(engine_id: str) -> JSONResponse:
        return watermark_answer(engine_id)

    @app.post("/v1/ingest/checkpoint")
    async def ingest_checkpoint(engine_id: str) -> JSONResponse:
        current = current_durability()
        asked = time.monotonic()
        try:
            await run_in_threadpool(current.sync, asked)
        except (duckdb.Error, StoreClosedError) as exc:
            return _retry_later(f"the checkpoint failed ({type(exc).__name__}); ask again")
        return watermark_answer(engine_id)

    @app.post("/v1/sql")
    async def post_sql(request: Request) -> Response:
        body = await _read_body(request, config.max_body_bytes)
        try:
            req = msgspec.json.decode(body, type=SqlRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _ApiError(400, f"invalid request body: {exc}") from None
        if req.limit is not None and req.limit < 1:
            raise _ApiError(400, f"limit must be >= 1, got {req.limit}")
        limit = min(req.limit or config.sql_row_limit, config.sql_row_limit)
        target = current_store()

        try:
            result = await query_gate.run(
                lambda release: sql.run_read_query(
                    target,
                    req.sql,
                    row_limit=limit,
                    timeout_seconds=config.sql_timeout_seconds,
                    on_done=release,
                    untrusted=True,  # checked by check_read_only inside its slot
                )
            )
        except sql.SqlError as exc:
            raise _ApiError(exc.status, exc.reason) from None
        return _result_response(result, req.format)

    @app.get("/v1/query/{name}")
    async def get_named_query(name: str, request: Request) -> Response:
        params = dict(request.query_params)
        fmt = params.pop("format", "json")
        if fmt not in sql.RESULT_FORMATS:
            raise _ApiError(
                400, f"format must be one of {', '.join(sql.RESULT_FORMATS)}", param="format"
            )
        try:
            query = queries.get_query(name)
            bound = query.bind(params, now=utc_now())
        except queries.UnknownQuery as exc:
            raise _ApiError(exc.status, exc.reason, known=exc.known) from None
        except queries.BadParam as exc:
            raise _ApiError(exc.status, exc.reason, param=exc.param) from None
        target = current_store()
        try:
            result = await query_gate.run(
                lambda release: sql.run_read_query(
                    target,
                    query.sql,
                    bound,
                    row_limit=config.sql_row_limit,
                    timeout_seconds=config.sql_timeout_seconds,
                    on_done=release,
                )
            )
        except sql.SqlError as exc:
            raise _ApiError(exc.status, exc.reason) from None
        return _result_response(result, fmt)

    @app.get("/v1/alerts")
    async def active_alerts() -> JSONResponse:
        source = app.state.active_alerts
        if source is None:
            raise _ApiError(503, "no rule scheduler runs in this process")
        return JSONResponse({"alerts": await run_in_threadpool(source)})

    @app.get("/v1/alerts/missed-evaluations")
    async def missed_evaluations() -> JSONResponse:
        source = app.state.missed_evaluations
        if source is None:
            raise _ApiError(503, "no rule scheduler runs in this process")
        return JSONResponse({"missed": source()})

    @app.get("/v1/silences")
    async def list_silences() -> JSONResponse:
        target = current_store()
        now = time.time()
        found = await run_in_threadpool(lambda: alert_store.load_silences(target, ended_after=now - SILENCE_LIST_GRACE_SECONDS))
        return JSONResponse({"silences": [alert_store.silence_json(s, now) for s in found]})

    @app.post("/v1/silences")
    async def create_silence(request: Request) -> JSONResponse:
        body = await _read_body(request, config.max_body_bytes)
        try:
            req = msgspec.json.decode(body, type=SilenceRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _ApiError(400, f"invalid request body: {exc}") from None
        now = time.time()
        starts = req.starts_at if req.starts_at is not None else now
        if (req.ends_at is None) == (req.duration is None):
            raise _ApiError(400, "give exactly one of ends_at (unix seconds) and duration (such as 2h)")
        if req.duration is not None:
            try:
                ends = starts + parse_duration(req.duration)
            except ValueError as exc:
                raise _ApiError(400, f"duration: {exc}") from None
        else:
            assert req.ends_at is not None
            ends = req.ends_at
        if not (math.isfinite(starts) and math.isfinite(ends)) or not (starts >= 0 and ends <= now + SILENCE_MAX_SECONDS):
            raise _ApiError(400, "starts_at and ends_at must be unix seconds from 1970 up to 100 years from now")
        if not req.created_by.strip() or not req.comment.strip():
            raise _ApiError(400, "created_by and comment must not be empty (who silenced what, and why)")
        if len(req.matchers) > SILENCE_MAX_MATCHERS or max(len(req.created_by), len(req.comment)) > SILENCE_MAX_TEXT:
            raise _ApiError(
                400, f"a silence takes at most {SILENCE_MAX_MATCHERS} matchers and {SILENCE_MAX_TEXT} characters of created_by and comment"
            )
        if any(ch < " " and ch not in "\t\n" for ch in req.created_by + req.comment):
            raise _ApiError(400, "created_by and comment must not contain control characters")
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
            raise _ApiError(400, str(exc)) from None
        return JSONResponse({"silence": alert_store.silence_json(silence, now)})

    @app.delete("/v1/silences/{silence_id}")
    async def expire_silence(silence_id: str) -> JSONResponse:
        target = current_store()
        now = time.time()
        try:
            silence = await run_in_threadpool(lambda: alert_store.expire_silence(target, silence_id, now=now))
        except alert_store.SilenceError as exc:
            raise _ApiError(404, str(exc)) from None
        return JSONResponse({"silence": alert_store.silence_json(silence, now)})

    return app


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) anything over ``max_bytes`` without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _ApiError(413, f"body of {declared} bytes exceeds the limit of {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _ApiError(413, f"body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _retry_later(reason: str) -> JSONResponse:
    response = error_response(503, reason)
    response.headers["Retry-After"] = "1"
    return response


def _result_response(result: sql.ResultSet, fmt: sql.ResultFormat) -> Response:
    return Response(
        sql.render(result, fmt),
        media_type=sql.MEDIA_TYPES[fmt],
        headers={"X-KVScope-Truncated": "true" if result.truncated else "false"},
    )
