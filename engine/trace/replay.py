"""Replaying a real trace through ``engine.LLM``.

Requests run in arrival order (sessions interleaved by arrival; a session's own requests in its
time order). Gaps between arrivals are divided by ``speed`` and each single wait is capped at
``max_wait_seconds``, so long think times compress; when the engine falls behind, requests run
back to back. Every request is a real prefill through the prefix cache followed by a real decode
of its (scaled, capped) output length; the next prompt comes from the trace's ids, not from the
generated text.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.events import Outcome
from engine.llm import LLM, RequestTooLarge
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.trace.formats import TraceRequest
from engine.trace.prompts import PromptBuilder

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
    """

    block_tokens: int | None = None
    speed: float = 30.0
    max_wait_seconds: float = 1.0
    max_requests: int | None = None
    max_output_tokens: int = 16
    seed: int = 0

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


def replay(
    llm: LLM,
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    *,
    on_request: ProgressCallback | None = None,
    stop: threading.Event | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> ReplayTally:
    """Run the trace's requests through ``llm``; returns the in-process tally.

    ``on_request(done, total, request, output)`` is called after each request (output None when
    the request was skipped because it cannot fit the cache pools — logged and counted).
    ``stop`` ends the replay early between requests.
    """
    todo = list(requests[: config.max_requests] if config.max_requests else requests)
    block_tokens = config.block_tokens
    if block_tokens is None:
        block_tokens = max(1, (todo[0].block_tokens if todo else 64) // DEFAULT_SCALE)
    builder = PromptBuilder(block_tokens, llm.layout.vocab_size, config.seed)
    tally = ReplayTally()
    scheduled = clock()
    previous_arrival = todo[0].arrival_seconds if todo else 0.0
    for i, req in enumerate(todo):
        if stop is not None and stop.is_set():
            break
        gap = max(0.0, req.arrival_seconds - previous_arrival) / config.speed
        previous_arrival = req.arrival_seconds
        scheduled += min(gap, config.max_wait_seconds)
        now = clock()
        if scheduled > now:
            if stop is not None:
                stop.wait(scheduled - now)
            else:
                sleep(scheduled - now)
        else:
            scheduled = now
        prompt = builder.prompt(req)
        params = SamplingParams(max_tokens=builder.output_tokens(req, config.max_output_tokens))
        try:
            out: RequestOutput | None = llm.generate([prompt], params, request_ids=[req.request_id])[0]
        except RequestTooLarge as exc:
            log.warning("request %s skipped: %s", req.request_id, exc)
            tally.skipped_requests += 1
            out = None
        if out is not None:
            tally.add(out)
        if on_request is not None:
            on_request(i + 1, len(todo), req, out)
    return tally
