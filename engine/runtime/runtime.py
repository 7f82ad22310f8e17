"""The serving runtime: many requests in flight, one engine step at a time.

Each :meth:`Runtime.step`:

1. asks the :class:`~engine.runtime.scheduler.Scheduler` for the running requests' decode tokens
   and prefill chunks within the token budget, then admits waiting requests (prefix-cache lookup,
   admission pricing and leases, as :class:`~engine.llm.LLM` does for one request) while budget
   and ``max_num_seqs`` allow;
2. allocates every chunk's pages (``PagedSequence.begin_chunk``); when a pool has nothing left to
   evict, the newest running request is **preempted by recompute** (its leases released, its
   published pages left in the cache; it waits again, first in its session, and resumes from
   whatever prefix the cache still holds — usually most of it);
3. runs **one forward** over all the chunks packed along T
   (:class:`~engine.model.state.PackedStates`: norms, MLPs and the LM head once over the batch,
   each mixer per sequence on its own state);
4. commits every chunk (pages published, checkpoints taken where the scheduler ended chunks),
   samples a token for each request whose sequence is fully computed, and finishes those that hit
   a stop token or ``max_tokens``, emitting their events like the one-request path does.

This follows vLLM's engine core (scheduler → model runner → sampler, preemption by recompute).
Everything runs on the caller's thread; the server drives it from its own engine thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import Tensor

from engine.cache.block_pool import SENTINEL_BLOCK, PoolExhausted
from engine.cache.forms import PagedKVForm
from engine.cache.prefix_cache import Admitted
from engine.cache.sequence import PagedSequence
from engine.events import Form
from engine.llm import LLM
from engine.model.state import PackedStates
from engine.outputs import CacheReport, RequestOutput
from engine.runtime.model_runner import DecodeRunner, supports_static_decode
from engine.runtime.scheduler import Scheduler, SchedulerConfig
from engine.sampling import Sampler, SamplingParams

log = logging.getLogger(__name__)


class FinishReason(StrEnum):
    """Why a request ended (OpenAI's ``finish_reason`` values, plus ``abort``)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class RuntimeRequest:
    """One request in the runtime: its prompt, what it produced, and the cache objects it holds
    while running (``seq``, its admission until its prefill is done)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    session: str
    serial: int
    max_chunk: int
    on_token: Callable[[int], None] | None = None
    on_finish: Callable[[RuntimeRequest], None] | None = None
    keep_logits: bool = False
    arrival_wall: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    sampled_logits: list[Tensor] = field(default_factory=list)
    """With ``keep_logits``: the logits row ``[vocab]`` each output token was sampled from."""
    seq: PagedSequence | None = None
    admitted: Admitted | None = None
    recovering: bool = False
    t_admit: float = 0.0
    first_admitted: Admitted | None = None
    """The first admission: what the cache gave the user's prompt (a re-admission after a
    preemption resumes on pages the request published itself, which are not cache hits)."""
    t_first_admit: float = 0.0
    report: CacheReport | None = None
    epochs: dict[Form, int] | None = None
    ttft_seconds: float | None = None
    e2e_seconds: float | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    decode_slot: int | None = None
    """The decode runner's slot holding this request's recurrent state while it decodes."""
    sampler: Sampler = field(init=False)

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.params)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens if self.seq is not None else 0

    @property
    def num_tokens(self) -> int:
        if self.seq is not None:
            return len(self.seq.token_ids)
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def next_chunk_end(self, budget: int) -> int:
        """A prefill chunk from the computed tokens: at most ``budget`` and ``max_chunk`` tokens,
        ending at the next checkpoint position if one comes first."""
        assert self.seq is not None
        start = self.num_computed_tokens
        ends = [self.num_tokens, start + budget, start + self.max_chunk]
        ends += [p for p in self.seq.checkpoint_positions if start < p < min(ends)]
        return min(ends)


class Runtime:
    """Continuous batching over one :class:`~engine.llm.LLM` (module docstring).

    Args:
        llm: the engine (model, prefix cache, telemetry sink); the runtime uses its cache and
            model and emits through its sink. Do not run ``llm.generate`` on the same engine
            while the runtime has requests.
        config: the scheduler's limits.
        static_decode: decode through the :class:`~engine.runtime.model_runner.DecodeRunner`
            (persistent buffers, padded batches, decode slots); None: whenever the model has the
            batched decode path (not yet the ``deepseek_v4`` family).
        decode_batch_sizes: the runner's padded sizes (default: its own list).
        cuda_graphs: the runner's ``cuda_graphs`` (None: captured on CUDA with the Triton
            backend when the model allows; False: vLLM's ``enforce_eager``).
        check_graph_safe: the runner's ``check_graph_safe`` (tests).

    Raises:
        ValueError: from the runner (``cuda_graphs=True`` where graphs cannot be captured).
    """

    def __init__(
        self, llm: LLM, config: SchedulerConfig | None = None, *, static_decode: bool | None = None,
        decode_batch_sizes: tuple[int, ...] | None = None, cuda_graphs: bool | None = None, check_graph_safe: bool = False,
    ) -> None:  # fmt: skip
        self.llm = llm
        self.config = config or SchedulerConfig()
        if static_decode is None:
            static_decode = supports_static_decode(llm.model)
        self.decode_runner = (
            DecodeRunner(
                llm, self.config.max_num_seqs, self.config.max_model_len, decode_batch_sizes,
                cuda_graphs=cuda_graphs, check_graph_safe=check_graph_safe,
            )
            if static_decode
            else None
        )  # fmt: skip
        self.scheduler = Scheduler(self.config)
        self.waiting: list[RuntimeRequest] = []
        self.running: list[RuntimeRequest] = []
        self.requests: dict[str, RuntimeRequest] = {}
        """Every request not yet collected by :meth:`pop_finished`, by id."""
        self._serials = itertools.count()
        self.num_preemptions = 0
        self.num_steps = 0
        self.last_step_tokens = 0
        """Tokens the last step computed (at most ``max_num_batched_tokens``)."""

    # -- requests --------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        session: str = "default",
        on_token: Callable[[int], None] | None = None,
        on_finish: Callable[[RuntimeRequest], None] | None = None,
        keep_logits: bool = False,
    ) -> RuntimeRequest:
        """Queue a request (text or token ids); it starts at a later :meth:`step`. ``on_token``
        is called with each token as it is sampled, ``on_finish`` with the request once it ended
        (stop, length or abort), both on the stepping thread.

        Raises:
            ValueError: an empty prompt, a token outside the vocabulary, a request that cannot
                fit the cache pools, or a request id already in use.
        """
        params = params or SamplingParams()
        ids = self.llm.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.llm._as_tensor(ids)
        self.llm._check_fits(len(ids), params.max_tokens)
        if len(ids) + params.max_tokens > self.config.max_model_len:
            raise ValueError(f"{len(ids)} prompt + {params.max_tokens} output tokens exceed max_model_len = {self.config.max_model_len}")
        rid = request_id or self.llm._next_request_id()
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        request = RuntimeRequest(
            request_id=rid,
            prompt_token_ids=ids,
            params=params,
            session=session,
            serial=next(self._serials),
            max_chunk=self.llm.cache_config.max_prefill_chunk_tokens,
            on_token=on_token,
            on_finish=on_finish,
            keep_logits=keep_logits,
        )
        self.requests[rid] = request
        self.waiting.append(request)
        return request

    def abort(self, request_id: str) -> bool:
        """End a request now (a client went away): its leases and pages are released at once.
        Returns False for an unknown or already finished request."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def pop_finished(self, request_id: str) -> RuntimeRequest:
        """Forget a finished request (its id can be used again) and return it.

        Raises:
            KeyError: no such request. RuntimeError: it has not finished.
        """
        request = self.requests[request_id]
        if not request.finished:
            raise RuntimeError(f"request {request_id} is still running")
        return self.requests.pop(request_id)

    # -- stepping --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[RuntimeRequest]:
        """One engine step (module docstring); returns the requests that got a token or
        finished in it."""
        plan = self.scheduler.schedule(self.running)
        work: list[tuple[RuntimeRequest, int]] = [(r, r.num_tokens) for r in plan.decodes]  # type: ignore[misc]
        work += plan.prefills  # type: ignore[arg-type]
        budget = plan.budget_left
        while budget > 0:
            nxt = self.scheduler.next_admission(self.running, self.waiting)
            if nxt is None:
                break
            assert isinstance(nxt, RuntimeRequest)
            if self.running and not self._fits(nxt):
                break  # wait for memory rather than admit and preempt (vLLM's can_allocate)
            self.waiting.remove(nxt)
            self._start(nxt)
            end = nxt.next_chunk_end(budget)
            work.append((nxt, end))
            budget -= end - nxt.num_computed_tokens
        prepared = self._allocate(work)
        self.num_steps += 1
        self.last_step_tokens = sum(end - start for _, start, end, _ in prepared)
        if not prepared:
            return []
        llm = self.llm
        runner = self.decode_runner
        decoding = [p for p in prepared if runner is not None and p[2] - p[1] == 1 and p[2] == p[0].num_tokens]
        static = {id(p[0]) for p in decoding}
        packed = [p for p in prepared if id(p[0]) not in static]
        last_rows: dict[int, Tensor] = {}  # id(request) -> the logits row its token is sampled from
        if decoding:
            assert runner is not None
            for r, *_ in decoding:
                if r.decode_slot is None:
                    r.decode_slot = runner.acquire(r.seq)  # type: ignore[arg-type]
            max_rows = runner.sizes[-1]
            for first in range(0, len(decoding), max_rows):
                part = decoding[first : first + max_rows]
                rows = runner.run([(r.seq, r.decode_slot) for r, *_ in part])  # type: ignore[misc]
                last_rows |= {id(r): rows[i] for i, (r, *_) in enumerate(part)}
        if packed:
            ids = llm._ids([t for r, start, end, _ in packed for t in r.seq.token_ids[start:end]])  # type: ignore[union-attr]
            positions = [p for *_, p in packed]
            states = tuple(r.seq for r, *_ in packed)
            logits = llm.model(ids, torch.cat(positions), PackedStates(states, tuple(positions)))  # type: ignore[arg-type]
            offset = 0
            for r, start, end, _ in packed:
                offset += end - start
                last_rows[id(r)] = logits[offset - 1]
        touched: list[RuntimeRequest] = []
        for r, _, end, _ in prepared:
            seq = r.seq
            assert seq is not None
            seq.commit(end, take_checkpoint=end in seq.checkpoint_positions)
            if end == len(seq.token_ids):
                self._prefill_done(r)
                self._sample(r, last_rows[id(r)])
                touched.append(r)
        if llm.check_invariants:
            llm.cache.check_invariants()
        return touched

    def run(self) -> None:
        """Step until every request has finished."""
        while self.has_unfinished():
            self.step()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | None = None,
        *,
        sessions: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` concurrently to completion; outputs in prompt order.

        Raises:
            ValueError: as :meth:`add_request`.
        """
        added = [
            self.add_request(p, params, session=sessions[i] if sessions is not None else "default") for i, p in enumerate(prompts)
        ]
        self.run()
        outputs = []
        for r in added:
            self.pop_finished(r.request_id)
            assert r.report is not None and r.ttft_seconds is not None and r.e2e_seconds is not None
            outputs.append(
                RequestOutput(
                    request_id=r.request_id,
                    prompt_token_ids=r.prompt_token_ids,
                    output_token_ids=r.output_token_ids,
                    text=self.llm.tokenizer.decode(r.output_token_ids),
                    cache=r.report,
                    ttft_seconds=r.ttft_seconds,
                    e2e_seconds=r.e2e_seconds,
                )
            )
        return outputs

    # -- internals -------------------------------------------------------------------------------
    def _start(self, r: RuntimeRequest) -> None:
        """Admission and leases for ``r`` (again after a preemption, for its prompt and the
        outputs so far)."""
        llm = self.llm
        costs = llm._costs()
        r.t_admit = time.perf_counter()
        remaining = r.params.max_tokens - len(r.output_token_ids)
        r.admitted, r.seq = llm._start_request(r.prompt_token_ids + r.output_token_ids, remaining, costs)
        r.recovering = True
        if r.first_admitted is None:
            r.first_admitted, r.t_first_admit = r.admitted, r.t_admit
        if r.epochs is None:
            r.epochs = llm._epochs(r.seq, r.admitted.plan.resume_tokens)
        self.running.append(r)

    def _pages_needed(self, r: RuntimeRequest, form: PagedKVForm) -> int:
        """Pages of ``form`` that ``r`` will hold through its prompt and next token — and, once it
        has been preempted, through all of its output, so it is not preempted again and again —
        all of them for a full-KV form, the most one request holds for a window form."""
        cache = self.llm.cache
        if form.window is None:
            tokens = r.num_tokens + (r.params.max_tokens - len(r.output_token_ids) if r.num_preemptions else 0)
            return -(-tokens // cache.unit_tokens) + 1
        return cache.window_pages_needed(form.window, r.params.max_tokens - len(r.output_token_ids))

    def _fits(self, r: RuntimeRequest) -> bool:
        """Whether every KV pool can hold ``r``'s pages (:meth:`_pages_needed`) besides what the
        running requests will still allocate, counting cached pages as evictable (vLLM's
        ``can_allocate``). Conservative: pages ``r`` would reuse from the cache count too."""
        for form in self.llm.cache.kv_forms:
            outstanding = 0
            for running in self.running:
                held = sum(1 for b in running.seq.tables[form] if b != SENTINEL_BLOCK) if running.seq is not None else 0
                outstanding += max(1, self._pages_needed(running, form) - held)
            available = form.pool.num_blocks - 1 - form.pool.num_leased - outstanding
            if self._pages_needed(r, form) > available:
                return False
        return True

    def _allocate(self, work: list[tuple[RuntimeRequest, int]]) -> list[tuple[RuntimeRequest, int, int, Tensor]]:
        """``begin_chunk`` for every piece of work, preempting the newest running request when a
        pool is exhausted; returns (request, start, end, positions) for what will run."""
        prepared: list[tuple[RuntimeRequest, int, int, Tensor]] = []
        for r, end in work:
            while r.seq is not None:
                start = r.seq.num_computed_tokens
                try:
                    prepared.append((r, start, end, r.seq.begin_chunk(end)))
                    break
                except PoolExhausted:
                    victim = max(self.running, key=lambda x: x.serial)
                    if victim is r and len(self.running) == 1:
                        raise
                    self._preempt(victim)
                    prepared = [p for p in prepared if p[0] is not victim]
        return prepared

    def _preempt(self, r: RuntimeRequest) -> None:
        log.info("preempting %s by recompute (%d tokens computed)", r.request_id, r.num_computed_tokens)
        self._release(r)
        self.waiting.append(r)
        r.num_preemptions += 1
        self.num_preemptions += 1

    def _release(self, r: RuntimeRequest) -> None:
        if r.decode_slot is not None:
            assert self.decode_runner is not None
            self.decode_runner.release(r.decode_slot)
            r.decode_slot = None
        if r.recovering and r.admitted is not None:
            self.llm.cache.finish_recovery(r.admitted)
            r.recovering = False
        if r.seq is not None:
            r.seq.finish()
            r.seq = None
        if r in self.running:
            self.running.remove(r)

    def _prefill_done(self, r: RuntimeRequest) -> None:
        if not r.recovering:
            return
        assert r.admitted is not None
        self.llm.cache.finish_recovery(r.admitted)
        r.recovering = False
        if r.report is None:  # the first admission is the one the user's prompt got
            assert r.first_admitted is not None
            r.report = self.llm._report(r.first_admitted, time.perf_counter() - r.t_first_admit)

    def _sample(self, r: RuntimeRequest, row: Tensor) -> None:
        params = r.params
        if len(r.output_token_ids) >= params.max_tokens:  # max_tokens = 0: a prefill only
            self._finish(r, FinishReason.LENGTH)
            return
        token = r.sampler(row)
        r.output_token_ids.append(token)
        if r.keep_logits:
            r.sampled_logits.append(row.clone())
        if r.ttft_seconds is None:
            r.ttft_seconds = time.perf_counter() - r.t0
        if r.on_token is not None:
            r.on_token(token)
        if token in params.stop_token_ids:
            self._finish(r, FinishReason.STOP)
        elif len(r.output_token_ids) >= params.max_tokens:
            self._finish(r, FinishReason.LENGTH)
        else:
            assert r.seq is not None
            r.seq.append_token(token)

    def _finish(self, r: RuntimeRequest, reason: FinishReason) -> None:
        self._release(r)
        r.finish_reason = reason
        r.e2e_seconds = time.perf_counter() - r.t0
        if r.ttft_seconds is None:
            r.ttft_seconds = r.e2e_seconds
        if r.report is None and r.first_admitted is not None:  # ended before its prefill did
            r.report = self.llm._report(r.first_admitted, time.perf_counter() - r.t_first_admit)
        if r.report is not None and r.epochs is not None:
            self.llm._emit_request(r.request_id, r.arrival_wall, r.report, len(r.output_token_ids), r.ttft_seconds, r.e2e_seconds, r.epochs)
        if self.llm.check_invariants:
            self.llm.cache.check_invariants()
        if r.on_finish is not None:
            r.on_finish(r)
