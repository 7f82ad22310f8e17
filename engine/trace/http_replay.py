"""Replaying a trace through a running ``kvscope serve`` over HTTP, many sessions at once.

Every session of the trace (a weka conversation, each of its sub-agents, a Mooncake session) is
its own client: its requests go out in order, each one no earlier than its scaled arrival time
and not before the session's previous answer came back, at most ``max_sessions`` (default: the
config's ``max_num_seqs``) at once, first arrival first — the schedule of the in-process replay
(:class:`~engine.trace.schedule.ArrivalSchedule`). Arrival gaps are divided by ``speed`` and
each gap is capped at ``max_wait_seconds``. Prompts
are the same token ids the in-process replay builds (``PromptBuilder``), sent as
``/v1/completions`` with ``stream`` on, so the time to the first streamed chunk is the request's
TTFT as the client sees it; ``user`` carries the session, which the server's scheduler is fair
across. The server's own engine emits the cache events to its agent.

Agent conversations with their full text (SWE-agent trajectories) replay as chats instead:
:func:`replay_chats_over_http`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from engine.trace.formats import ChatSession, TraceRequest
from engine.trace.prompts import PromptBuilder
from engine.trace.replay import DEFAULT_SCALE, ReplayConfig
from engine.trace.schedule import ArrivalSchedule

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """The server could not be reached or answered something other than the API."""


@dataclass(slots=True)
class HttpReplayResult:
    """What the clients saw."""

    requests: int = 0
    skipped: int = 0
    """Requests the server refused (400: e.g. too large for its cache pools)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_seconds: list[float] = field(default_factory=list)
    e2e_seconds: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    sessions: int = 0

    def to_json(self) -> dict[str, Any]:
        def pct(values: list[float], q: float) -> float | None:
            if not values:
                return None
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

        return {
            "sessions": self.sessions,
            "requests": self.requests,
            "skipped_requests": self.skipped,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_share": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
            "output_tokens": self.output_tokens,
            "wall_seconds": self.wall_seconds,
            "output_tokens_per_second": self.output_tokens / self.wall_seconds if self.wall_seconds else None,
            "total_tokens_per_second": (self.prompt_tokens + self.output_tokens) / self.wall_seconds if self.wall_seconds else None,
            "ttft_p50_seconds": pct(self.ttft_seconds, 0.5),
            "ttft_p99_seconds": pct(self.ttft_seconds, 0.99),
            "ttft_mean_seconds": statistics.fmean(self.ttft_seconds) if self.ttft_seconds else None,
            "e2e_p50_seconds": pct(self.e2e_seconds, 0.5),
        }


async def model_card(client: httpx.AsyncClient) -> dict[str, Any]:
    """The server's one model (``/v1/models``), with kvscope's ``vocab_size``.

    Raises:
        ServerError: unreachable, or not a kvscope server.
    """
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        card: dict[str, Any] = response.json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ServerError(f"{client.base_url}: no /v1/models answer ({exc})") from None
    if "vocab_size" not in card:
        raise ServerError(f"{client.base_url}: the model card has no vocab_size (not a kvscope server?)")
    return card


async def streamed(client: httpx.AsyncClient, path: str, body: dict[str, Any], name: str, result: HttpReplayResult) -> dict[str, Any] | None:
    """POST one streamed request, count it into ``result`` (TTFT to the first chunk, usage from
    the last); returns its usage, or None when the server refused it (400, counted skipped).

    Raises:
        ServerError: the server is unreachable, answers 5xx, or sends an error in the stream.
    """
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code == 400:
                message = json.loads(await response.aread()).get("error", {}).get("message", "")
                log.warning("request %s refused: %s", name, message)
                result.skipped += 1
                return None
            if response.status_code != 200:
                raise ServerError(f"{name}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ServerError(f"{name}: {chunk['error'].get('message')}")
                if ttft is None and chunk.get("choices"):
                    ttft = time.monotonic() - sent
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        raise ServerError(f"{name}: {exc!r}") from None
    if usage is None:
        raise ServerError(f"{name}: the stream ended without usage")
    result.requests += 1
    result.prompt_tokens += int(usage["prompt_tokens"])
    result.output_tokens += int(usage["completion_tokens"])
    result.cached_tokens += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    result.e2e_seconds.append(time.monotonic() - sent)
    if ttft is not None:
        result.ttft_seconds.append(ttft)
    return usage


CHARS_PER_TOKEN = 4
"""A chat answer of N characters is replayed as about N / 4 output tokens (capped)."""


async def replay_chats_over_http(
    base_url: str, sessions: Sequence[ChatSession], *, max_output_tokens: int, max_sessions: int | None = None, timeout_seconds: float = 600.0,
    on_request: Callable[[], None] | None = None,
) -> HttpReplayResult:
    """Replay agent conversations (:func:`engine.trace.formats.read_swe_agent`) as real text
    chats: every session its own client sending its model calls in order to
    ``/v1/chat/completions`` with the history so far, as the agent did (so each call shares the
    previous call's prefix); sessions concurrently, at most ``max_sessions`` at once.
    ``on_request()`` is called as each model call ends.

    Raises:
        ServerError: as :func:`replay_over_http`.
    """
    result = HttpReplayResult(sessions=len(sessions))
    limits = httpx.Limits(max_connections=max(len(sessions), 1), max_keepalive_connections=max(len(sessions), 1))
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_seconds, limits=limits) as client:
        card = await model_card(client)
        gate = asyncio.Semaphore(max_sessions or max(len(sessions), 1))
        start = time.monotonic()

        async def session(s: ChatSession) -> None:
            async with gate:
                for i, turn in enumerate(s.turns):
                    tokens = max(1, min(max_output_tokens, turn.answer_chars // CHARS_PER_TOKEN))
                    body = {"model": card["id"], "messages": list(turn.messages), "max_tokens": tokens, "temperature": 0, "user": s.session_id}
                    await streamed(client, "/v1/chat/completions", body, f"{s.session_id}#{i}", result)
                    if on_request is not None:
                        on_request()

        await asyncio.gather(*(session(s) for s in sessions))
        result.wall_seconds = time.monotonic() - start
    return result


async def replay_over_http(
    base_url: str,
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    *,
    max_sessions: int | None = None,
    timeout_seconds: float = 600.0,
    on_request: Callable[[TraceRequest, dict[str, Any] | None], None] | None = None,
) -> HttpReplayResult:
    """Replay ``requests`` against the server at ``base_url`` (module docstring).

    ``on_request(request, usage)`` is called as each request ends (usage None when refused).

    Raises:
        ServerError: the server is unreachable, answers 5xx, or breaks the stream.
    """
    todo = list(requests[: config.max_requests] if config.max_requests else requests)
    result = HttpReplayResult()
    if not todo:
        return result
    schedule = ArrivalSchedule(todo, speed=config.speed, max_wait_seconds=config.max_wait_seconds, limit=max_sessions or config.max_num_seqs)
    sessions = {r.session_id for r in todo}
    result.sessions = len(sessions)
    limits = httpx.Limits(max_connections=max(len(sessions), 1), max_keepalive_connections=max(len(sessions), 1))
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_seconds, limits=limits) as client:
        card = await model_card(client)
        block_tokens = config.block_tokens or max(1, todo[0].block_tokens // DEFAULT_SCALE)
        builder = PromptBuilder(block_tokens, int(card["vocab_size"]), config.seed)
        start = time.monotonic()
        wake = asyncio.Event()

        async def one(req: TraceRequest) -> None:
            try:
                body = {
                    "model": card["id"], "prompt": builder.prompt(req), "max_tokens": builder.output_tokens(req, config.max_output_tokens),
                    "temperature": 0, "user": req.session_id,
                }  # fmt: skip
                usage = await streamed(client, "/v1/completions", body, req.request_id, result)
                if on_request is not None:
                    on_request(req, usage)
            finally:
                schedule.ended(req)
                wake.set()

        out: set[asyncio.Task[None]] = set()
        try:
            while not schedule.finished():
                wake.clear()
                for req in schedule.take_due(time.monotonic() - start):
                    out.add(asyncio.create_task(one(req), name=req.request_id))
                due = schedule.next_due()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), None if due is None else max(0.0, start + due - time.monotonic()))
                for task in [t for t in out if t.done()]:
                    out.discard(task)
                    task.result()  # a ServerError ends the replay
        finally:
            for task in out:
                task.cancel()
            await asyncio.gather(*out, return_exceptions=True)
        result.wall_seconds = time.monotonic() - start
    return result
