"""What ``kvscope serve`` writes to its log, as vLLM's and uvicorn's servers do:

* the start-up banner (:func:`banner`): the model and served name, device, dtype, kernels,
  tensor-parallel size, the scheduler's limits, the cache's memory plan and the URL;
* the access log (:class:`AccessLog`, ASGI middleware): one line per HTTP request, like
  uvicorn's, with the duration until the response (a whole stream) was sent;
* the periodic stats line (:class:`StatsLine`), like vLLM's ``LoggingStatLogger``: prompt and
  generation throughput, requests running and waiting, cache usage per form and the prefix
  cache's hit rate over the interval.

Banner and stats go to the logger ``engine.runtime.server_log`` (:data:`LOG`), the access log to
its child ``engine.runtime.server_log.access`` (:data:`ACCESS_LOG`), both at INFO; ``kvscope
serve`` shows them without ``-v``.
"""

from __future__ import annotations

import dataclasses
import http
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.runtime.engine_snapshot import EngineSnapshot
from engine.runtime.runtime import Runtime
from engine.runtime.server_metrics import ServerTotals

LOG = logging.getLogger(__name__)
ACCESS_LOG = logging.getLogger(f"{__name__}.access")


def banner(runtime: Runtime, served_model_name: str, url: str | None) -> str:
    """The start-up banner of ``runtime`` served as ``served_model_name`` at ``url`` (the
    OpenAI base URL, ``http://HOST:PORT/v1``; None: not known, the line is left out)."""
    llm = runtime.llm
    tp = 1 if llm.ranks is None else llm.ranks.group.size
    cfg = runtime.config
    plan = llm.cache.memory_plan().render().replace("\n", "\n  ")
    lines = [
        f"kvscope serve: model {llm.model_name} served as {served_model_name!r}",
        f"  device {llm.device}, dtype {str(llm.dtype).removeprefix('torch.')}, kernels {llm.kernel_backend}, "
        f"tensor-parallel size {tp}" + (" (the plan below is rank 0's shard)" if tp > 1 else ""),
        f"  scheduler: max_num_seqs {cfg.max_num_seqs}, max_num_batched_tokens {cfg.max_num_batched_tokens}, "
        f"max_model_len {cfg.max_model_len}; prefix-match unit U = {llm.cache_config.unit_tokens} tokens",
        f"  {plan}",
    ]
    if url is not None:
        lines.append(f"  listening on {url} (OpenAI API; /metrics, /health beside /v1)")
    return "\n".join(lines)


class AccessLog:
    """ASGI middleware: one :data:`ACCESS_LOG` line per HTTP request once its response has
    been sent (a stream: once it ended), in uvicorn's format plus the duration::

        127.0.0.1:52114 - "POST /v1/completions HTTP/1.1" 200 OK 84.2 ms

    A request the app failed on without answering is logged as 500 (then re-raised).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status: int | None = None

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            ACCESS_LOG.info("%s", access_line(scope, 500 if status is None else status, (time.perf_counter() - t0) * 1e3))


def access_line(scope: Scope, status: int, duration_ms: float) -> str:
    """``CLIENT - "METHOD PATH?QUERY HTTP/V" STATUS PHRASE DURATION ms`` (uvicorn's access
    format; ``-`` for an unknown client, no phrase for a status without one such as 499)."""
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    query = scope.get("query_string", b"").decode("latin-1")
    target = scope.get("path", "") + (f"?{query}" if query else "")
    try:
        phrase = " " + http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f'{who} - "{scope.get("method", "-")} {target} HTTP/{scope.get("http_version", "1.1")}" {status}{phrase} {duration_ms:.1f} ms'


class StatsLine:
    """vLLM's periodic stats line from the server's token sums and an engine snapshot.

    Each :meth:`line` covers the interval since the previous call (or since ``start``):
    throughputs are tokens / interval seconds (prompt tokens count when a request's prefill
    finishes, generated tokens as they stream); the hit rates are the interval's prefix-cache
    hash-hit and recoverable tokens over its queried tokens (``n/a`` without queries); cache
    usage is every form's :attr:`~engine.runtime.engine_snapshot.FormUsage.usage_ratio` now. An
    idle interval (nothing generated or prefilled, nothing running or waiting) after an idle one
    gives None, so an idle server logs once and then stays quiet.
    """

    def __init__(self, totals: ServerTotals, start_seconds: float) -> None:
        self._last = dataclasses.replace(totals)
        self._last_seconds = start_seconds
        self._was_idle = False

    def line(self, totals: ServerTotals, snapshot: EngineSnapshot, now_seconds: float) -> str | None:
        """The line for the interval ending at ``now_seconds`` (``time.monotonic()`` seconds),
        or None (idle again)."""
        prev, seconds = self._last, max(now_seconds - self._last_seconds, 1e-9)
        self._last, self._last_seconds = dataclasses.replace(totals), now_seconds
        prompt = totals.prompt_tokens - prev.prompt_tokens
        generated = totals.generation_tokens - prev.generation_tokens
        idle = prompt == 0 and generated == 0 and snapshot.running == 0 and snapshot.waiting == 0
        if idle and self._was_idle:
            return None
        self._was_idle = idle
        queries = totals.prefix_queries_tokens - prev.prefix_queries_tokens
        hits = totals.prefix_hits_tokens - prev.prefix_hits_tokens
        recoverable = totals.prefix_recoverable_tokens - prev.prefix_recoverable_tokens
        usage = ", ".join(f"{f.form} {100 * f.usage_ratio:.1f}%" for f in snapshot.forms)
        rate = f"{100 * hits / queries:.1f}% (recoverable {100 * recoverable / queries:.1f}%)" if queries else "n/a"
        return (
            f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, Avg generation throughput: {generated / seconds:.1f} tokens/s, "
            f"Running: {snapshot.running} reqs, Waiting: {snapshot.waiting} reqs, Cache usage: {usage}, Prefix cache hit rate: {rate}"
        )
