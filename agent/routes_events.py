"""The ingest routes: ``POST /v1/events`` (one batch, answered after its commit, with the
engine's durable watermark), ``GET /v1/ingest/watermark`` and ``POST /v1/ingest/checkpoint``
(the end-to-end acknowledgement of :mod:`agent.durability`), ``GET /v1/ingest/next-seq`` (where
a restarted engine's seqs continue, :mod:`engine.run_seq`). Contracts: :mod:`agent.app`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import duckdb
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from agent.api_common import ApiError, error_response, read_body, retry_later
from agent.config import AgentConfig
from agent.decode import BatchDecoder, Decoded, Invalid
from agent.durability import Durability
from agent.ingest import IngestOutcome
from agent.metrics import AgentMetrics
from agent.pipeline import Ingestor, IngestorClosed, QueueFull, StoreWriteError
from agent.rejected import record_rejected
from agent.store import Store, StoreClosedError, utc_now
from engine.events_arrow import ARROW_MEDIA_TYPE, WireFormat

EVENT_MEDIA_TYPES: dict[str, WireFormat] = {
    ARROW_MEDIA_TYPE: "arrow",
    "application/json": "json",
    "application/msgpack": "msgpack",
    "application/x-msgpack": "msgpack",
}


def event_routes(
    *,
    config: AgentConfig,
    metrics: AgentMetrics,
    decoder: BatchDecoder,
    current_store: Callable[[], Store],
    current_ingestor: Callable[[], Ingestor],
    durability: Durability | None,
) -> APIRouter:
    """The ingest routes over the app's store, pipeline and decoder (``current_store`` and
    ``current_ingestor`` raise :class:`~agent.api_common.ApiError` 503 when there is none)."""
    router = APIRouter()

    async def decode_and_queue(
        body: bytes, fmt: WireFormat, target: Store, ingestor: Ingestor
    ) -> tuple[Future[IngestOutcome], Decoded] | JSONResponse:
        """Decode ``body`` and queue it for a flush; an error answer when it cannot be."""
        try:
            decoded = await decoder.decode(body, fmt)
        except BrokenProcessPool:
            metrics.observe_rejected("decode_error")
            return retry_later("a decode worker died twice in a row; send the batch again")
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
            located = {"column": error.column, "row": error.row} if error.column is not None else {}
            return error_response(422, error.reason, path=error.path, **located)
        prepared = decoded.batch
        try:
            if config.ingest_full_policy == "block":
                future = await run_in_threadpool(ingestor.submit, prepared)
            else:
                future = ingestor.submit(prepared)
        except QueueFull as exc:
            metrics.observe_rejected("queue_full")
            return retry_later(str(exc))
        except IngestorClosed as exc:
            return retry_later(str(exc))
        return future, decoded

    @router.post("/v1/events")
    async def post_events(request: Request) -> JSONResponse:
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        fmt = EVENT_MEDIA_TYPES.get(media_type)
        if fmt is None:
            metrics.observe_rejected("content_type")
            raise ApiError(
                415,
                f"unsupported content type {media_type or '(none)'!r}; "
                f"send one of {', '.join(EVENT_MEDIA_TYPES)}",
            )
        try:
            body = await read_body(request, config.max_body_bytes)
        except ApiError as exc:
            if exc.status == 413:
                metrics.observe_rejected("too_large")
            raise
        target = current_store()
        ingestor = current_ingestor()
        with ingestor.incoming():  # a flush starting meanwhile waits for this batch
            queued = await decode_and_queue(body, fmt, target, ingestor)
        if isinstance(queued, JSONResponse):
            return queued
        future, decoded = queued
        try:
            # shielded: a cancelled request must not cancel the flush's future, whose batch may
            # already be committed together with others
            outcome = await asyncio.shield(asyncio.wrap_future(future))
        except (duckdb.Error, StoreClosedError, StoreWriteError) as exc:
            return retry_later(f"the store could not write this batch ({type(exc).__name__}); send it again")
        metrics.observe_ingest(outcome)
        metrics.stages.add("decode", decoded.decode_seconds)
        metrics.stages.add("check", decoded.check_seconds)
        metrics.run_info.observe(outcome)
        if outcome.status == "conflict":
            return error_response(
                409,
                f"seq {outcome.seq} of engine {outcome.engine_id!r} was already stored with other "
                "events: two engines send under this engine_id at once (give each its own --engine-id), "
                "or a restarted one reused a seq (continue at GET /v1/ingest/next-seq)",
                path="$.seq",
            )
        answer: dict[str, object] = {"status": outcome.status, "events": outcome.events}
        if durability is not None:
            answer["seq"] = outcome.seq
            answer["checkpoint_epoch"] = durability.epoch  # read after the commit: see agent.durability
            answer["durable_seq"] = durability.durable_seq(outcome.engine_id)
            answer["agent_instance"] = durability.instance
        return JSONResponse(answer)

    def current_durability() -> Durability:
        if durability is None:
            raise ApiError(404, "this agent keeps no durable watermarks (no acknowledgement log)")
        return durability

    def watermark_answer(engine_id: str) -> JSONResponse:
        current = current_durability()
        return JSONResponse(
            {
                "engine_id": engine_id,
                "checkpoint_epoch": current.epoch,
                "durable_seq": current.durable_seq(engine_id),
                "agent_instance": current.instance,
            }
        )

    @router.get("/v1/ingest/watermark")
    async def ingest_watermark(engine_id: str) -> JSONResponse:
        return watermark_answer(engine_id)

    @router.get("/v1/ingest/next-seq")
    async def ingest_next_seq(engine_id: str) -> JSONResponse:
        return JSONResponse({"engine_id": engine_id, "next_seq": current_ingestor().tracker.next_seq(engine_id)})

    @router.post("/v1/ingest/checkpoint")
    async def ingest_checkpoint(engine_id: str) -> JSONResponse:
        current = current_durability()
        asked = time.monotonic()
        try:
            await run_in_threadpool(current.sync, asked)
        except (duckdb.Error, StoreClosedError) as exc:
            return retry_later(f"the checkpoint failed ({type(exc).__name__}); ask again")
        return watermark_answer(engine_id)

    return router
