"""The OpenAI-compatible HTTP server in front of the runtime (``kvscope serve``).

Endpoints, as the OpenAI API and vLLM's server define them:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``: one prompt (or one conversation,
  rendered with ChatML, Qwen's chat format, as text) per request; ``max_tokens`` (chat also
  ``max_completion_tokens``), ``temperature``, ``top_p``, ``stop`` (strings; the text ends
  before the first one, which is not returned), ``seed``, ``user`` (the session the scheduler is
  fair across), ``stream`` (server-sent events ending with ``data: [DONE]``;
  ``stream_options.include_usage`` adds a usage chunk). ``usage.prompt_tokens_details.cached_tokens``
  is the prompt tokens the prefix cache served (its recoverable tokens).
* ``GET /v1/models`` (with the vocabulary size, which trace replays need for token-id prompts),
  ``GET /health`` (503 once the engine thread has died), ``GET /metrics`` (Prometheus text, every
  series labelled ``model_name``: requests by finish reason, prompt / cached / generated tokens,
  time to first token, inter-token and end-to-end latency, requests running and waiting,
  preemptions, cache usage per form, prefix-cache query / hit / recoverable tokens; the cache
  gauges are read on the engine thread before each scrape).

It logs a start-up banner, one access-log line per request and, every ``stats_interval_seconds``
(an APScheduler job on the server's event loop), vLLM's stats line (:mod:`engine.runtime.server_log`).

Errors are OpenAI-style bodies ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed or unservable request, 404 for another model, 500 when the engine failed. A client
that disconnects mid-stream has its request aborted and its blocks freed.

The request bodies and the error shape are in :mod:`engine.runtime.openai_api`, the Prometheus
series in :mod:`engine.runtime.server_metrics`; a request is checked by the engine's
:class:`~engine.request_lifecycle.RequestLifecycle` before it is queued (a refusal is a 400, not a
failed stream) and then runs on the :class:`~engine.runtime.engine_loop.EngineLoop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import uvicorn
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.parallel.group import RankFailed
from engine.runtime.engine_loop import EngineLoop, Failed, Finished, Token
from engine.runtime.engine_snapshot import take_snapshot
from engine.runtime.openai_api import (
    CHAT_END,
    APIError,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    StopStrings,
    error_body,
    render_chat,
)
from engine.runtime.request import RuntimeRequest
from engine.runtime.server_log import LOG, AccessLog, StatsLine, banner
from engine.runtime.server_metrics import ServerMetrics
from engine.sampling import SamplingParams
from engine.tokenizer import StreamDecoder

DEFAULT_CHAT_MAX_TOKENS = 256
"""Tokens a chat completion may generate when the request does not say."""
DISCONNECT_POLL_SECONDS = 0.25
"""How often a request without a stream checks that its client is still connected."""
SNAPSHOT_TIMEOUT_SECONDS = 5.0
"""How long a scrape or the stats line waits for the engine thread to read the cache (between
two steps); past it they use the previous reading."""
T = TypeVar("T")


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, port: int, *, host: str = "127.0.0.1", start_timeout: float = 60.0) -> Iterator[str]:
    """Run ``app`` on uvicorn in a daemon thread until the block ends (tests, benchmarks); yields
    its base URL once uvicorn has started listening.

    Raises:
        RuntimeError: uvicorn did not start within ``start_timeout`` seconds (a port in use, for
            example; its own log says why).
    """
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="kvscope-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server on {host}:{port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(start_timeout)


def create_app(
    loop: EngineLoop, model_name: str, *, url: str | None = None, access_log: bool = True, stats_interval_seconds: float = 10.0
) -> FastAPI:
    """The FastAPI app serving ``loop``'s runtime as ``model_name``; starts the engine thread with
    the app's lifespan (logging the banner, naming ``url``, the OpenAI base URL, when given) and
    stops it after.

    Args:
        access_log: log one line per HTTP request (:class:`~engine.runtime.server_log.AccessLog`).
        stats_interval_seconds: log the stats line this often (0: never); ``app.state.log_stats``
            (a coroutine function) logs one now and returns it (None: idle again, or the engine
            thread did not answer).
    """
    if stats_interval_seconds < 0:
        raise ValueError(f"stats_interval_seconds = {stats_interval_seconds} must be ≥ 0")
    llm = loop.runtime.llm
    metrics = ServerMetrics(loop, model_name)
    stats = StatsLine(metrics.totals, time.monotonic())
    created = int(time.time())

    async def refresh_snapshot() -> None:
        """Read the cache's usage on the engine thread into ``metrics.snapshot`` (kept as it
        was when the engine is gone or busy past :data:`SNAPSHOT_TIMEOUT_SECONDS`)."""
        with contextlib.suppress(RuntimeError, TimeoutError):
            metrics.snapshot = await loop.inspect(take_snapshot, timeout_seconds=SNAPSHOT_TIMEOUT_SECONDS)

    async def log_stats() -> str | None:
        await refresh_snapshot()
        if metrics.snapshot is None:
            return None
        line = stats.line(metrics.totals, metrics.snapshot, time.monotonic())
        if line is not None:
            LOG.info("%s", line)
        return line

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop.start()
        scheduler = None
        try:
            LOG.info("%s", banner(loop.runtime, model_name, url))
            if stats_interval_seconds > 0:
                scheduler = AsyncIOScheduler(event_loop=asyncio.get_running_loop())
                scheduler.add_job(log_stats, IntervalTrigger(seconds=stats_interval_seconds), id="stats", max_instances=1, coalesce=True)
                scheduler.start()
            yield
        finally:
            if scheduler is not None:
                scheduler.shutdown(wait=False)
            loop.stop()

    app = FastAPI(title="kvscope", lifespan=lifespan)
    app.state.log_stats = log_stats
    if access_log:
        app.add_middleware(AccessLog)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ())[1:] if isinstance(p, str)) or None
        return APIError(400, f"{param or 'body'}: {first.get('msg')}", param=param).response()

    @app.get("/health")
    async def health() -> Response:
        ranks = [] if llm.ranks is None else llm.ranks.status()
        dead = [r["rank"] for r in ranks if not r["alive"]]
        if dead or isinstance(loop.error, RankFailed):  # rank None: a collective timed out, every process alive
            rank = dead[0] if dead else getattr(loop.error, "rank", None)
            detail = repr(loop.error) if loop.error is not None else f"tensor-parallel rank {rank} exited"
            return JSONResponse(status_code=503, content={"status": "rank failed", "rank": rank, "error": detail, "ranks": ranks})
        if not loop.alive:
            return JSONResponse(status_code=503, content={"status": "engine stopped", "error": repr(loop.error)})
        return JSONResponse({"status": "ok", **({"ranks": ranks} if ranks else {})})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "kvscope", "vocab_size": llm.layout.vocab_size}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        await refresh_snapshot()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def prompt_ids(prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        """One prompt: text, token ids, or a list holding one of those."""
        if isinstance(prompt, str):
            return llm.tokenizer.encode(prompt)
        if all(isinstance(t, int) for t in prompt):
            return [t for t in prompt if isinstance(t, int)]
        if len(prompt) != 1:
            raise APIError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
        only = prompt[0]
        return llm.tokenizer.encode(only) if isinstance(only, str) else [int(t) for t in only]  # type: ignore[union-attr]

    async def unless_gone(request: Request, work: Awaitable[T]) -> T | Response:
        """Await ``work`` while watching the connection: a client that goes away cancels it
        (which aborts its request in the engine) and gets 499, as nginx logs it."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, APIError):
                    await task
                return Response(status_code=499)

    def check(body: SamplingFields) -> None:
        if body.model != model_name:
            raise APIError(404, f"The model `{body.model}` does not exist (this server serves `{model_name}`).", param="model", code="model_not_found")
        if body.n != 1:
            raise APIError(400, "only n = 1 is supported", param="n")

    def sampling(body: SamplingFields, max_tokens: int, prompt_ids: list[int]) -> SamplingParams:
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed)
            llm.lifecycle.validate(prompt_ids, max_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return params

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        check(body)
        ids = prompt_ids(body.prompt)
        params = sampling(body, 16 if body.max_tokens is None else body.max_tokens, ids)
        rid = f"cmpl-{uuid.uuid4().hex}"

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}  # fmt: skip

        return await respond(request, body, rid, ids, params, chunk, lambda text, finish: chunk(text, finish))

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatRequest) -> Response:
        check(body)
        ids = llm.tokenizer.encode(render_chat(body.messages))
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling(body, DEFAULT_CHAT_MAX_TOKENS if limit is None else limit, ids)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        first = True

        def delta(text: str, finish: str | None) -> dict[str, Any]:
            nonlocal first
            d: dict[str, Any] = {"content": text}
            if first:
                d["role"], first = "assistant", False
            return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name,
                    "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]}  # fmt: skip

        def whole(text: str, finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}]}  # fmt: skip

        return await respond(request, body, rid, ids, params, delta, whole, extra_stops=(CHAT_END,))

    async def respond(
        request: Request, body: SamplingFields, rid: str, ids: list[int], params: SamplingParams,
        piece: Callable[[str, str | None], dict[str, Any]], whole: Callable[[str, str | None], dict[str, Any]],
        extra_stops: tuple[str, ...] = (),
    ) -> Response:  # fmt: skip
        stops = [*body.stops(), *extra_stops]
        session = body.user or rid

        async def events() -> AsyncGenerator[tuple[str, str | None, dict[str, Any] | None]]:
            """(text, finish_reason or None, usage once finished)."""
            decoder = StreamDecoder(llm.tokenizer)
            cutter = StopStrings(stops)
            seen = 0
            counted = False
            prefilled = False
            previous: Token | None = None
            try:
                async with contextlib.aclosing(loop.generate(ids, params, request_id=rid, session=session)) as updates:
                    async for update in updates:
                        if isinstance(update, Token):
                            seen += 1
                            if not prefilled:
                                metrics.prefilled(update.request, first_token=True)
                                prefilled = True
                            metrics.token(update, previous)
                            previous = update
                            text, stopped = cutter.push(decoder.push(update.token_id))
                            if stopped:  # leaving the stream aborts the request: its blocks are freed now
                                metrics.finished("stop", time.perf_counter() - update.request.t0)
                                counted = True
                                yield text, "stop", usage(update.request, seen)
                                return
                            if text:
                                yield text, None, None
                        elif isinstance(update, Finished):
                            r = update.request
                            reason = str(r.finish_reason)  # stop, length, or abort (the server shutting down)
                            if not prefilled:  # max_tokens = 0, or ended before its first token
                                metrics.prefilled(r, first_token=False)
                            metrics.finished(reason, r.e2e_seconds)
                            counted = True
                            yield cutter.push(decoder.finish())[0] + cutter.flush(), reason, usage(r, seen)
                        elif isinstance(update, Failed):
                            if isinstance(update.error, ValueError):
                                counted = True  # refused, never ran
                                raise APIError(400, str(update.error))
                            if isinstance(update.error, RankFailed) or isinstance(loop.error, RankFailed):
                                raise APIError(503, f"the engine lost a tensor-parallel rank: {loop.error or update.error}", type="service_unavailable")
                            raise APIError(500, f"the engine failed: {update.error!r}", type="internal_error")
            finally:
                if not counted:  # a client gone (or an engine failure) before the end
                    metrics.finished("abort", None)

        def usage(r: RuntimeRequest, generated: int) -> dict[str, Any]:
            cached = r.report.recoverable_tokens if r.report is not None else 0
            return {"prompt_tokens": len(ids), "completion_tokens": generated,
                    "total_tokens": len(ids) + generated, "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip

        if not body.stream:

            async def collect() -> JSONResponse:
                texts: list[str] = []
                finish: str | None = None
                final_usage: dict[str, Any] | None = None
                async with contextlib.aclosing(events()) as stream:
                    async for text, reason, use in stream:
                        texts.append(text)
                        finish, final_usage = reason or finish, use or final_usage
                out = whole("".join(texts), finish)
                out["usage"] = final_usage or {"prompt_tokens": len(ids), "completion_tokens": None, "total_tokens": None}
                return JSONResponse(out)

            return await unless_gone(request, collect())

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        stream = events()

        async def first() -> tuple[str, str | None, dict[str, Any] | None] | None:
            return await anext(stream, None)

        try:  # the first event before the 200: a refusal is still an error status
            head = await unless_gone(request, first())
        except BaseException:
            await stream.aclose()
            raise
        if isinstance(head, Response):  # the client left before the first token
            await stream.aclose()
            return head

        async def sse() -> AsyncIterator[str]:
            try:
                item = head
                while item is not None:
                    text, reason, use = item
                    yield f"data: {json.dumps(piece(text, reason))}\n\n"
                    if reason is not None:
                        if include_usage:
                            tail = piece("", None) | {"choices": [], "usage": use}
                            yield f"data: {json.dumps(tail)}\n\n"
                        break
                    item = await anext(stream, None)
                yield "data: [DONE]\n\n"
            except APIError as exc:
                yield f"data: {json.dumps(error_body(exc.message, exc.type, exc.param, exc.code))}\n\n"
            finally:
                await stream.aclose()  # a client gone mid-stream: the request is aborted

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app

