"""The agent's HTTP API (DESIGN.md §6), a FastAPI application.

Endpoints:

The routes live in :mod:`agent.routes_events` (ingest), :mod:`agent.routes_alerts` (alerts and
silences) and here (health, metrics, SQL and named queries); :mod:`agent.api_common` holds what
they share.

* ``POST /v1/events`` — one event batch, ``application/json`` or ``application/msgpack``
  (``application/x-msgpack``). 200 ``{"status": "stored"|"duplicate", "events": n}`` (plus
  ``seq``, ``durable_seq`` and ``agent_instance`` with a :class:`~agent.durability.Durability`),
  sent only after the batch's transaction committed (:mod:`agent.pipeline`); 415 for another content type;
  413 above ``max_body_bytes``; 422 ``{"error": {"path", "reason"}}`` for a batch that breaks
  the contract (nothing of it is stored); 409 for a seq already stored with other events; 503
  with ``Retry-After`` when the ingest queue is full or the store failed (nothing stored: send
  it again).
* ``GET /v1/ingest/watermark?engine_id=E`` — ``{"engine_id", "durable_seq", "agent_instance"}``;
  ``POST /v1/ingest/checkpoint?engine_id=E`` checkpoints first (concurrent calls share one); 404
  without a :class:`~agent.durability.Durability`.
* ``GET /v1/ingest/next-seq?engine_id=E`` — ``{"engine_id", "next_seq"}``: one above the highest
  seq received from E (stored or rejected), 0 for an engine never heard of — where a restarted
  engine keeping its id continues its seqs (:mod:`engine.run_seq`).
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
* ``GET /v1/alerts/rules`` — each rule's last evaluation (:mod:`alerts.rule_health`):
  ``{"rules": [{"alert", "kind", "evaluated_at", "series", "no_data": [{"labels", "detail",
  "since"}]}]}`` — a series without enough volume to judge, with the volume it saw; 503 when no
  rule scheduler runs beside the app.
* ``GET /v1/silences`` — every silence not expired more than a day ago, with its ``state``
  (pending, active, expired); ``POST /v1/silences`` — ``{"matchers": ["engine=\"e1\""],
  "ends_at": unix s | "duration": "2h", "starts_at": unix s?, "created_by": str, "comment": str}``
  creates one (200 with it, 400 for a bad matcher or bad times); ``DELETE /v1/silences/{id}``
  expires one (404 unknown id). Silences mute matching alerts in the agent's routing
  (:mod:`alerts.notifier`), as Alertmanager's do.
* ``GET /metrics`` — Prometheus text exposition of the agent's own registry, rendered in a worker
  thread (never on the event loop); free-form labels are capped (:mod:`agent.label_cap`).
* ``GET /healthz`` — 200 while the process runs (never needs the token).
* ``GET /readyz`` — 200 ``{"status": "ready"|"degraded", "schema_version", "degraded", "limits"}`` once
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

import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Literal, cast

import msgspec
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent import queries, sql
from agent.api_common import (
    OPEN_PATHS,
    ApiError,
    BearerAuth,
    error_response,
    read_body,
    resolve_token,
    result_response,
)
from agent.config import AgentConfig
from agent.decode import BatchDecoder
from agent.durability import Durability
from agent.health import Health
from agent.metrics import AgentMetrics
from agent.pipeline import FullPolicy, Ingestor
from agent.process_metrics import duckdb_memory_bytes
from agent.query_gate import QueryBusy, QueryGate
from agent.readiness import DataDirProbe, readiness
from agent.routes_alerts import alert_routes
from agent.routes_events import event_routes
from agent.store import Store, utc_now


class SqlRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /v1/sql``."""

    sql: str
    format: Literal["json", "csv", "arrow"] = "json"
    limit: int | None = None


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
    metrics = metrics if metrics is not None else AgentMetrics(
        label_max_values=config.metric_label_max_values, label_idle_seconds=config.metric_label_idle_seconds
    )
    owns_store = store is None

    def new_ingestor(target: Store) -> Ingestor:
        return Ingestor(
            target,
            metrics,
            max_queue_events=config.ingest_queue_max_events,
            full_policy=cast(FullPolicy, config.ingest_full_policy),
            block_timeout_seconds=config.ingest_block_timeout_seconds,
            flush_max_events=config.flush_max_events,
            flush_wait_seconds=config.flush_wait_seconds,
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
    query_gate = QueryGate(config.query_concurrency, config.sql_queue_timeout_seconds)
    app.state.query_gate = query_gate
    """Caps ``/v1/sql`` and ``/v1/query`` queries running at once (429 past the queue timeout)."""
    app.state.active_alerts = None
    """Set by :func:`agent.server.serve`: the rule scheduler's pending and firing alerts."""
    app.state.missed_evaluations = None
    app.state.rule_health = None
    """Set by :func:`agent.server.serve`: the rule scheduler's missed-evaluation counts."""

    token = resolve_token(config, environ)
    if token is not None:
        app.add_middleware(BearerAuth, token=token, open_paths=OPEN_PATHS)

    def current_store() -> Store:
        current: Store | None = app.state.store
        if current is None or not current.is_open:
            raise ApiError(503, "the store is not open")
        return current

    def current_ingestor() -> Ingestor:
        current: Ingestor | None = app.state.ingestor
        if current is None:
            raise ApiError(503, "the ingest pipeline is not running")
        return current

    @app.exception_handler(QueryBusy)
    async def _query_busy(request: Request, exc: QueryBusy) -> JSONResponse:
        response = error_response(exc.status, exc.reason)
        response.headers["Retry-After"] = str(exc.retry_after_seconds)
        return response

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
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
            limits={"sql_timeout_seconds": config.sql_timeout_seconds, "sql_queue_timeout_seconds": config.sql_queue_timeout_seconds},
        )
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        # rendered in a worker thread: a large or slow scrape never holds the event loop
        return Response(await run_in_threadpool(metrics.exposition), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    app.include_router(
        event_routes(
            config=config,
            metrics=metrics,
            decoder=decoder,
            current_store=current_store,
            current_ingestor=current_ingestor,
            durability=durability,
        )
    )
    app.include_router(alert_routes(config=config, state=app.state, current_store=current_store))

    @app.post("/v1/sql")
    async def post_sql(request: Request) -> Response:
        body = await read_body(request, config.max_body_bytes)
        try:
            req = msgspec.json.decode(body, type=SqlRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ApiError(400, f"invalid request body: {exc}") from None
        if req.limit is not None and req.limit < 1:
            raise ApiError(400, f"limit must be >= 1, got {req.limit}")
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
            raise ApiError(exc.status, exc.reason) from None
        return result_response(result, req.format)

    @app.get("/v1/query/{name}")
    async def get_named_query(name: str, request: Request) -> Response:
        params = dict(request.query_params)
        fmt = params.pop("format", "json")
        if fmt not in sql.RESULT_FORMATS:
            raise ApiError(
                400, f"format must be one of {', '.join(sql.RESULT_FORMATS)}", param="format"
            )
        try:
            query = queries.get_query(name)
            bound = query.bind(params, now=utc_now())
        except queries.UnknownQuery as exc:
            raise ApiError(exc.status, exc.reason, known=exc.known) from None
        except queries.BadParam as exc:
            raise ApiError(exc.status, exc.reason, param=exc.param) from None
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
            raise ApiError(exc.status, exc.reason) from None
        return result_response(result, fmt)

    return app
