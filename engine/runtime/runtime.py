"""The serving runtime: many requests in flight, one engine step at a time.

Each :meth:`Runtime.step`:

1. asks the :class:`~engine.runtime.scheduler.Scheduler` for the running requests' decode tokens
   and prefill chunks within the token budget, then admits waiting requests (prefix-cache lookup,
   admission pricing and leases: :meth:`~engine.request_lifecycle.RequestLifecycle.start`, as
   :class:`~engine.llm.LLM` does for one request) while budget and ``max_num_seqs`` allow;
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

With tensor parallelism every rank runs each step in lockstep on its mirror of rank 0's runtime
(:mod:`engine.runtime.runtime_ranks`); rank 0's sampled tokens are broadcast once per step.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor

from engine.cache.block_pool import PoolExhausted
from engine.llm import LLM
from engine.model.state import PackedStates
from engine.outputs import RequestOutput
from engine.request_lifecycle import RequestTooLarge
from engine.runtime import runtime_ranks
from engine.runtime.memory_fit import fits
from engine.runtime.model_runner import DecodeRunner, supports_static_decode
from engine.runtime.request import FinishReason, RuntimeRequest
from engine.runtime.scheduler import Scheduler, SchedulerConfig
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class Runtime:
    """Continuous batching over one :class:`~engine.llm.LLM` (module docstring).

    Args:
        llm: the engine (model, prefix cache, telemetry sink); the runtime runs its model and
            takes every request through its :attr:`~engine.llm.LLM.lifecycle`. Do not run
            ``llm.generate`` on the same engine while the runtime has requests.
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
        self.lifecycle = llm.lifecycle
        """The engine's request steps: validation, start, commit, release, events."""
        self.config = config or SchedulerConfig()
        if static_decode is None:
            static_decode = supports_static_decode(llm.model)
        self._runner = (static_decode, decode_batch_sizes, cuda_graphs, check_graph_safe)
        self.decode_runner: DecodeRunner | None = None
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
        self._inputs: list[tuple[str, object]] = []  # tensor parallelism: adds and aborts the mirrors have not seen
        self.mirrored = llm.ranks is not None and llm.ranks.workers is not None  # rank 0 of a tensor-parallel engine
        if llm.ranks is not None:
            runtime_ranks.register(llm, self)
        if self.mirrored:  # every rank builds its decode runner at once (a CUDA graph capture runs collectives)
            mirror = {"config": self.config, "static_decode": static_decode, "decode_batch_sizes": decode_batch_sizes, "cuda_graphs": cuda_graphs}
            llm.on_every_rank(runtime_ranks.build_mirror, Runtime, mirror)
        else:
            self.build_decode_runner()

    def build_decode_runner(self) -> None:
        """The static decode runner (captures its CUDA graphs), when static decode is on."""
        static, sizes, graphs, check = self._runner
        if static:
            self.decode_runner = DecodeRunner(self.llm, self.config.max_num_seqs, self.config.max_model_len, sizes, cuda_graphs=graphs, check_graph_safe=check)

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
            ValueError: an empty prompt, a token outside the vocabulary, or a request id already
                in use.
            RequestTooLarge: a request that cannot fit the cache pools or ``max_model_len``.
        """
        params = params or SamplingParams()
        ids = self.llm.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.lifecycle.validate(ids, params.max_tokens)
        if len(ids) + params.max_tokens > self.config.max_model_len:
            raise RequestTooLarge(f"{len(ids)} prompt + {params.max_tokens} output tokens exceed max_model_len = {self.config.max_model_len}")
        rid = request_id or self.lifecycle.new_request_id()
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
        if self.mirrored:
            self._inputs.append(("add", {"prompt": ids, "params": params, "request_id": rid, "session": session}))
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
        if self.mirrored:
            self._inputs.append(("abort", request_id))
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
        finished in it. On rank 0 of a tensor-parallel engine every rank runs it.

        Raises:
            RankFailed: a tensor-parallel rank died or hung. RuntimeError: the ranks scheduled
                different steps (an internal invariant).
        """
        if not self.mirrored:
            return self.step_here()
        inputs, self._inputs = self._inputs, []
        return cast(list[RuntimeRequest], self.llm.on_every_rank(runtime_ranks.step_on_rank, inputs)[0])

    def step_here(self) -> list[RuntimeRequest]:
        """The step on this rank only (what :meth:`step` runs on every rank)."""
        plan = self.scheduler.schedule(self.running)
        work: list[tuple[RuntimeRequest, int]] = [(r, r.num_tokens) for r in plan.decodes]  # type: ignore[misc]
        work += plan.prefills  # type: ignore[arg-type]
        budget = plan.budget_left
        while budget > 0:
            nxt = self.scheduler.next_admission(self.running, self.waiting)
            if nxt is None:
                break
            assert isinstance(nxt, RuntimeRequest)
            if self.running and not runtime_ranks.rank0_says(self.llm, fits(self.llm.cache, self.running, nxt)):
                break  # wait for memory rather than admit and preempt (vLLM's can_allocate); rank 0 decides
            self.waiting.remove(nxt)
            self._start(nxt)
            end = nxt.next_chunk_end(budget)
            work.append((nxt, end))
            budget -= end - nxt.num_computed_tokens
        prepared = self._allocate(work)
        if llm_ranks := self.llm.ranks:
            runtime_ranks.agree_on_schedule(llm_ranks.group, [(r.serial, start, end) for r, start, end, _ in prepared], self.num_preemptions)
        self.num_steps += 1
        self.last_step_tokens = sum(end - start for _, start, end, _ in prepared)
        if not prepared:
            return []
        llm = self.llm
        lifecycle = self.lifecycle
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
            ids = lifecycle.to_device([t for r, start, end, _ in packed for t in r.seq.token_ids[start:end]])  # type: ignore[union-attr]
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
            lifecycle.commit(seq, end)
            if end == len(seq.token_ids):
                self._prefill_done(r)
                touched.append(r)
        sampling = [r for r in touched if len(r.output_token_ids) < r.params.max_tokens]  # max_tokens = 0: a prefill only
        tokens = [r.sampler(last_rows[id(r)]) for r in sampling]
        if self.llm.ranks is not None and tokens:  # rank 0's samples: every rank appends the same tokens
            tokens = self.llm.ranks.group.broadcast_ints(tokens)
        chosen = dict(zip(map(id, sampling), tokens, strict=True))
        for r in touched:
            self._take(r, chosen.get(id(r)), last_rows[id(r)])
        lifecycle.check_cache()
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
        outputs so far): :meth:`RequestLifecycle.start`."""
        remaining = r.params.max_tokens - len(r.output_token_ids)
        r.lease = self.lifecycle.start(r.prompt_token_ids + r.output_token_ids, remaining)
        if r.first_admission is None:
            r.first_admission = r.lease.record
        self.running.append(r)

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
        """Give back the decode slot and the lease ``r`` holds; it is no longer running."""
        if r.decode_slot is not None:
            assert self.decode_runner is not None
            self.decode_runner.release(r.decode_slot)
            r.decode_slot = None
        if r.lease is not None:
            self.lifecycle.release(r.lease)
            r.lease = None
        if r in self.running:
            self.running.remove(r)

    def _prefill_done(self, r: RuntimeRequest) -> None:
        """``r``'s sequence is fully computed: its recovery budget goes back (once per
        admission), and its report is made from its first admission if not yet."""
        assert r.lease is not None
        if not self.lifecycle.prefill_done(r.lease):
            return
        if r.report is None:  # the first admission is the one the user's prompt got
            assert r.first_admission is not None
            r.report = self.lifecycle.report(r.first_admission)

    def _take(self, r: RuntimeRequest, token: int | None, row: Tensor) -> None:
        """Append ``r``'s sampled ``token`` (None: it had nothing left to generate) from the
        logits ``row``, and finish it on a stop token or at ``max_tokens``."""
        params = r.params
        if token is None:
            self._finish(r, FinishReason.LENGTH)
            return
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
        """End ``r``: release it, time it, emit its events (when it was ever admitted), check the
        cache, then call its ``on_finish``."""
        self._release(r)
        r.finish_reason = reason
        r.e2e_seconds = time.perf_counter() - r.t0
        if r.ttft_seconds is None:
            r.ttft_seconds = r.e2e_seconds
        first = r.first_admission
        if r.report is None and first is not None:  # ended before its prefill did
            r.report = self.lifecycle.report(first)
        if r.report is not None and first is not None:
            self.lifecycle.finish(r.request_id, r.arrival_wall, first, r.report, len(r.output_token_ids), r.ttft_seconds, r.e2e_seconds)
        self.lifecycle.check_cache()
        if r.on_finish is not None:
            r.on_finish(r)
