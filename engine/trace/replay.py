"""Replaying a real trace through the engine's batched runtime, in process.

Every session of the trace is a client: its requests go out in order, each no earlier than its
arrival time and not before the session's previous request finished; sessions run concurrently
through :class:`~engine.runtime.Runtime` (the continuous batching ``kvscope serve`` runs, without
HTTP). Gaps between arrivals are divided by ``speed`` and each single wait is capped at
``max_wait_seconds``, so long think times compress; when the engine falls behind, requests queue.
Every request is a real prefill through the prefix cache followed by a real decode of its
(scaled, capped) output length; the next prompt comes from the trace's ids, not from the
generated text.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from engine.events import Outcome
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.request_lifecycle import RequestTooLarge
from engine.runtime import Runtime, RuntimeRequest, SchedulerConfig
from engine.runtime.engine_thread import EngineThread
from engine.sampling import SamplingParams
from engine.trace.formats import TraceRequest
from engine.trace.prompts import PromptBuilder
from engine.trace.schedule import ArrivalSchedule

log = logging.getLogger(__name__)

DEFAULT_SCALE = 16
"""Without ``block_tokens``, a trace block of B tokens becomes B // 16 replay tokens."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayConfig:
    """Replay knobs.

    Attributes:
        block_tokens: N, tokens per trace block in the replay; None scales the trace's block
            size B down by :data:`DEFAULT_SCALE` (weka 64 → 4, Mooncake 512 → 32).
        speed: trace seconds per wall second.
        max_wait_seconds: cap on one wait between arrivals (wall seconds).
        max_requests: stop after this many requests (None: the whole trace).
        max_output_tokens: cap on decoded tokens per request.
        seed: seeds the token ids of blocks and fillers.
        max_num_seqs: requests running at once in the batched runtime (``kvscope serve``'s
            ``--max-num-seqs``).
        max_num_batched_tokens: tokens computed per engine step, decode and prefill together
            (``kvscope serve``'s ``--max-num-batched-tokens``).
    """

    block_tokens: int | None = None
    speed: float = 30.0
    max_wait_seconds: float = 1.0
    max_requests: int | None = None
    max_output_tokens: int = 16
    seed: int = 0
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256

    def __post_init__(self) -> None:
        if self.block_tokens is not None and self.block_tokens <= 0:
            raise ValueError(f"block_tokens = {self.block_tokens} must be positive")
        if not self.speed > 0:
            raise ValueError(f"speed = {self.speed} must be positive")
        if self.max_wait_seconds < 0:
            raise ValueError(f"max_wait_seconds = {self.max_wait_seconds} must be >= 0")
        if self.max_requests is not None and self.max_requests <= 0:
            raise ValueError(f"max_requests = {self.max_requests} must be positive")
        if self.max_output_tokens < 0:
            raise ValueError(f"max_output_tokens = {self.max_output_tokens} must be >= 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs = {self.max_num_seqs} and max_num_batched_tokens = {self.max_num_batched_tokens} must be at least 1")


@dataclass(slots=True)
class ReplayTally:
    """Token and outcome totals of the requests replayed so far (computed in-process)."""

    requests: int = 0
    skipped_requests: int = 0
    prompt_tokens: int = 0
    hash_hit_tokens: int = 0
    recoverable_tokens: int = 0
    replayed_tokens: int = 0
    recomputed_tokens: int = 0
    output_tokens: int = 0
    forms: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    reasons: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    losses: dict[tuple[str | None, str], list[int]] = field(default_factory=dict)
    """(limiting form, reason) → [tokens lost, requests, tied requests]: a request's hash-hit
    tokens not recoverable, under every form tied at its resume point, each with its own reason
    (as the agent's ``tokens_lost`` query counts them)."""

    def add(self, out: RequestOutput) -> None:
        c = out.cache
        self.requests += 1
        self.prompt_tokens += c.prompt_tokens
        self.hash_hit_tokens += c.hash_hit_tokens
        self.recoverable_tokens += c.recoverable_tokens
        self.replayed_tokens += c.replayed_tokens
        self.recomputed_tokens += c.recomputed_tokens
        self.output_tokens += len(out.output_token_ids)
        for f in c.forms:
            self.forms[str(f.form)][str(f.outcome)] += 1
            if f.outcome != Outcome.HIT:
                self.reasons[str(f.form)][str(f.reason)] += 1
        lost = c.hash_hit_tokens - c.recoverable_tokens
        if lost > 0:
            tied = len(c.limiting_forms) > 1
            for form in c.limiting_forms or (c.limiting_form,):
                reason = c.limiting_reason
                if form != c.limiting_form:  # a tied form's own reason: its lookup of least usable tokens
                    own = [f for f in c.forms if f.form == form]
                    reason = min(own, key=lambda f: f.usable_tokens).reason if own else reason
                key = (None if form is None else str(form), str(reason))
                tally = self.losses.setdefault(key, [0, 0, 0])
                tally[0] += lost
                tally[1] += 1
                tally[2] += int(tied)

    def outcome_counts(self) -> dict[str, dict[str, int]]:
        """``{form: {outcome: count}}`` with every outcome of every form present (zeros kept)."""
        return {form: {str(o): int(counts.get(str(o), 0)) for o in Outcome} for form, counts in self.forms.items()}


ProgressCallback = Callable[[int, int, TraceRequest, RequestOutput | None], None]

HARD_STOP_JOIN_SECONDS = 10.0
"""After a second interrupt, how long :func:`replay` waits for the engine thread to abort its
requests before it re-raises."""


def replay(
    llm: LLM,
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    *,
    on_request: ProgressCallback | None = None,
    stop: threading.Event | None = None,
    sleep: Callable[[float], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    thread: EngineThread | None = None,
) -> ReplayTally:
    """Run the trace's requests through ``llm``'s batched runtime; returns the in-process tally.

    The requests go through :class:`~engine.runtime.Runtime` — the continuous batching
    ``kvscope serve`` runs — in process, on the replay's schedule
    (:class:`~engine.trace.schedule.ArrivalSchedule`, shared with the replay against a server):
    every session is a client sending its requests in order, each no earlier than its compressed
    arrival and after the session's previous request ended; at most ``config.max_num_seqs`` are
    out at once, first arrival first, and each engine step computes at most
    ``config.max_num_batched_tokens`` tokens. ``sleep`` (default: a wait that a stop ends) is
    called only while nothing is running and the next arrival is ahead.

    ``on_request(done, total, request, output)`` is called as each request ends (output None
    when it was skipped because it cannot fit the cache pools or ``max_model_len`` — logged and
    counted). ``stop`` ends the replay early: no request starts after it is set (queued ones are
    dropped), the running ones finish. An interrupt (Ctrl-C) on the calling thread sets it; a
    second one aborts the running requests too and is re-raised.

    The steps run on ``thread`` — the :class:`~engine.runtime.engine_thread.EngineThread` that
    built ``llm``, so torch keeps one OpenMP team (that module's docstring) — or, without one,
    on a thread of their own; this call waits for them. ``on_request`` runs there.

    Raises:
        ValueError: a model the runtime cannot batch (from :class:`~engine.runtime.Runtime`).
    """
    stop = stop if stop is not None else threading.Event()
    hard_stop = threading.Event()
    wait: Callable[[float], object] = sleep if sleep is not None else stop.wait
    own = thread is None
    engine = thread if thread is not None else EngineThread("kvscope-replay-engine")
    try:
        if engine.here:
            return _replay(llm, requests, config, on_request=on_request, stop=stop, hard_stop=hard_stop, sleep=wait, clock=clock)
        running = engine.submit(_replay, llm, requests, config, on_request=on_request, stop=stop, hard_stop=hard_stop, sleep=wait, clock=clock)
        try:
            try:
                return running.result()
            except KeyboardInterrupt:  # the first Ctrl-C: nothing new starts, the running requests finish
                if running.done():
                    raise
                log.warning("interrupted: finishing the running requests (interrupt again to abort them)")
                stop.set()
                running.result()
                raise
        except KeyboardInterrupt:
            if not running.done():  # the second: abort the running requests, leave the loop
                hard_stop.set()
                stop.set()
                with contextlib.suppress(BaseException):
                    running.result(HARD_STOP_JOIN_SECONDS)
            raise
    finally:
        if own:
            engine.close(HARD_STOP_JOIN_SECONDS)


def _replay(
    llm: LLM, requests: Sequence[TraceRequest], config: ReplayConfig, *, on_request: ProgressCallback | None,
    stop: threading.Event, hard_stop: threading.Event, sleep: Callable[[float], object], clock: Callable[[], float],
) -> ReplayTally:  # fmt: skip
    """:func:`replay`'s loop, on the engine thread."""
    todo = list(requests[: config.max_requests] if config.max_requests else requests)
    block_tokens = config.block_tokens
    if block_tokens is None:
        block_tokens = max(1, (todo[0].block_tokens if todo else 64) // DEFAULT_SCALE)
    builder = PromptBuilder(block_tokens, llm.layout.vocab_size, config.seed)
    tally = ReplayTally()
    schedule = ArrivalSchedule(todo, speed=config.speed, max_wait_seconds=config.max_wait_seconds, limit=config.max_num_seqs)
    runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs))
    finished: list[tuple[TraceRequest, RuntimeRequest]] = []
    start = clock()
    done = 0

    def report(req: TraceRequest, out: RequestOutput | None) -> None:
        nonlocal done
        done += 1
        schedule.ended(req)
        if out is None:
            tally.skipped_requests += 1
        else:
            tally.add(out)
        if on_request is not None:
            on_request(done, len(todo), req, out)

    try:
        while True:
            if stop.is_set() and not schedule.closed:
                schedule.close()
                for r in list(runtime.waiting):  # queued, never admitted: dropped, no events
                    if r.first_admission is None:
                        runtime.abort(r.request_id)
                        runtime.pop_finished(r.request_id)
                        finished[:] = [f for f in finished if f[1] is not r]
                        schedule.ended(_trace_request(todo, r.request_id))
            if hard_stop.is_set():
                break
            for req in schedule.take_due(clock() - start):
                params = SamplingParams(max_tokens=builder.output_tokens(req, config.max_output_tokens))
                try:
                    runtime.add_request(builder.prompt(req), params, request_id=req.request_id, session=req.session_id, on_finish=partial(_ended, finished, req))
                except RequestTooLarge as exc:
                    log.warning("request %s skipped: %s", req.request_id, exc)
                    report(req, None)
            if runtime.has_unfinished():
                runtime.step()
            elif schedule.finished():
                break
            else:
                due = schedule.next_due()
                assert due is not None, "nothing running, nothing due, and the schedule not finished"
                sleep(max(0.0, start + due - clock()))
            for req, r in finished:
                runtime.pop_finished(r.request_id)
                report(req, _output(llm, r))
            finished.clear()
    finally:  # an exception or a hard stop: nothing stays leased
        for rid in list(runtime.requests):
            runtime.abort(rid)
    return tally


def _trace_request(todo: Sequence[TraceRequest], request_id: str) -> TraceRequest:
    return next(r for r in todo if r.request_id == request_id)


def _ended(finished: list[tuple[TraceRequest, RuntimeRequest]], req: TraceRequest, r: RuntimeRequest) -> None:
    finished.append((req, r))


def _output(llm: LLM, r: RuntimeRequest) -> RequestOutput:
    assert r.report is not None and r.ttft_seconds is not None and r.e2e_seconds is not None
    return RequestOutput(
        request_id=r.request_id,
        prompt_token_ids=r.prompt_token_ids,
        output_token_ids=r.output_token_ids,
        text=llm.tokenizer.decode(r.output_token_ids),
        cache=r.report,
        ttft_seconds=r.ttft_seconds,
        e2e_seconds=r.e2e_seconds,
    )
