"""The runtime on its own thread, for asyncio callers (the OpenAI-compatible server).

One engine thread owns the :class:`~engine.runtime.runtime.Runtime` (and so the model and the
prefix cache): it takes commands (add, abort) from a queue between steps, steps while anything is
unfinished, and sleeps on the queue otherwise. Each request's tokens and its end travel back to
the caller's event loop through an ``asyncio.Queue`` (``call_soon_threadsafe``), as vLLM's
``AsyncLLM`` hands its engine core's outputs to per-request streams.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.runtime.engine_thread import EngineThread
from engine.runtime.request import RuntimeRequest
from engine.runtime.runtime import Runtime
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 0.5
"""How long the idle engine thread sleeps on its command queue before checking for a stop."""
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Token:
    token_id: int
    request: RuntimeRequest
    """The request it belongs to (read its report, not its growing lists, off the engine thread)."""
    sampled_at: float
    """``time.perf_counter()`` seconds when the engine thread took the token (right after
    sampling): consecutive tokens' difference is the inter-token latency."""


@dataclass(frozen=True, slots=True)
class Finished:
    request: RuntimeRequest


@dataclass(frozen=True, slots=True)
class Failed:
    error: BaseException


Update = Token | Finished | Failed


class EngineLoop:
    """Runs ``runtime`` on an engine thread (:meth:`start` / :meth:`stop`): ``thread``, the
    :class:`~engine.runtime.engine_thread.EngineThread` that built the engine (so torch keeps one
    OpenMP team), or without one a daemon thread of its own."""

    def __init__(self, runtime: Runtime, thread: EngineThread | None = None) -> None:
        self.runtime = runtime
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._own = thread is None
        self._engine = thread
        self._running: Future[None] | None = None
        self.error: BaseException | None = None
        """What stopped the engine thread, if it died."""
        self._streams: dict[str, Callable[[Update], None]] = {}
        """Per request in flight: how to reach its caller (engine thread only)."""

    @property
    def alive(self) -> bool:
        return self._running is not None and not self._running.done() and self.error is None

    def start(self) -> None:
        if self._engine is None:
            self._engine = EngineThread()
        self._running = self._engine.submit(self._run)

    def stop(self, timeout_seconds: float = 30.0) -> None:
        """Abort what is in flight and leave the engine thread (closing it when it is the loop's own)."""
        self._stopping.set()
        self._commands.put(lambda: None)
        if self._running is not None:
            concurrent.futures.wait([self._running], timeout_seconds)
        if self._own and self._engine is not None:
            self._engine.close(0)

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread between steps."""
        self._commands.put(fn)

    async def inspect(self, fn: Callable[[Runtime], T], *, timeout_seconds: float = 5.0) -> T:
        """``fn(runtime)`` run on the engine thread between steps, where the runtime and its
        cache are not changing (the server's stats and cache gauges read the pools there).

        Raises:
            RuntimeError: the engine thread is not running. TimeoutError: it did not get to
                ``fn`` within ``timeout_seconds`` (a long step). Whatever ``fn`` raises (the
                engine thread itself carries on).
        """
        if not self.alive:
            raise RuntimeError(f"the engine is not running ({self.error!r})")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: Any, error: Exception | None) -> None:  # on the event loop
            if done.done():  # timed out meanwhile
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        def run() -> None:  # on the engine thread: never let fn's error stop it
            result: Any = None
            error: Exception | None = None
            try:
                result = fn(self.runtime)
            except Exception as exc:
                error = exc
            with contextlib.suppress(RuntimeError):  # the event loop has closed
                loop.call_soon_threadsafe(settle, result, error)

        self.call(run)
        return await asyncio.wait_for(done, timeout_seconds)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str, session: str = "default"
    ) -> AsyncGenerator[Update]:
        """Submit a request and yield its :class:`Token` updates, then one :class:`Finished` (or
        :class:`Failed`). Leaving the iteration early (a client gone) aborts the request on the
        engine thread, which releases its blocks."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Update] = asyncio.Queue()

        def put(update: Update) -> None:
            loop.call_soon_threadsafe(updates.put_nowait, update)

        def finished(r: RuntimeRequest) -> None:
            self._streams.pop(r.request_id, None)
            put(Finished(r))

        def add() -> None:
            if self.error is not None:  # queued just before the engine thread died
                put(Failed(RuntimeError(f"the engine is not running ({self.error!r})")))
                return
            try:
                request = self.runtime.add_request(
                    prompt_token_ids, params, request_id=request_id, session=session,
                    on_token=lambda t: put(Token(t, request, time.perf_counter())), on_finish=finished,
                )  # fmt: skip
            except Exception as exc:  # a request the runtime refuses: the caller reports it
                put(Failed(exc))
            else:
                self._streams[request_id] = put

        done = False
        if not self.alive:
            yield Failed(RuntimeError(f"the engine is not running ({self.error!r})"))
            return
        self.call(add)
        try:
            while True:
                update = await updates.get()
                done = not isinstance(update, Token)
                yield update
                if done:
                    return
        finally:
            if not done:
                self.call(lambda: self._abort(request_id))

    def _drain(self) -> None:
        """Run the commands left in the queue (once the thread died, adds fail at once)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            with contextlib.suppress(Exception):
                command()

    def _abort(self, request_id: str) -> None:
        if self.runtime.abort(request_id):
            log.info("aborted %s: its client went away", request_id)

    def _run(self) -> None:
        runtime = self.runtime
        try:
            while not self._stopping.is_set():
                try:
                    self._commands.get_nowait()()
                    continue
                except queue.Empty:
                    pass
                if runtime.has_unfinished():
                    runtime.step()
                    for rid in [rid for rid, r in runtime.requests.items() if r.finished]:
                        runtime.pop_finished(rid)
                else:
                    with contextlib.suppress(queue.Empty):
                        command = self._commands.get(timeout=IDLE_WAIT_SECONDS)
                        command()
        except BaseException as exc:  # an engine bug: every caller hears of it, the server reports unhealthy
            log.exception("the engine thread stopped")
            self.error = exc
            for put in list(self._streams.values()):
                put(Failed(exc))
            self._streams.clear()
            self._drain()
        finally:
            for rid in list(runtime.requests):
                try:
                    runtime.abort(rid)
                except Exception:  # the cache may be what broke; the process is going down
                    log.exception("could not abort %s", rid)
