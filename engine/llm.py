"""``engine.LLM``: the public entry point (shaped like vLLM's ``LLM``), DESIGN.md §4.

Every request runs through the prefix cache by the steps of
:class:`~engine.request_lifecycle.RequestLifecycle` (:attr:`LLM.lifecycle`): hash chain → lookup
(L* and every form's verdict) → leases → chunked prefill from L* (taking recurrent checkpoints at
their boundaries) → decode → release. One ``cache_lookup`` event per (request, form) and one
``request`` event go to the telemetry sink. ``generate`` and ``score`` run requests one at a
time; :class:`~engine.runtime.runtime.Runtime` runs many at once over the same lifecycle.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from engine.cache import CacheConfig, PrefixCache
from engine.cache.admission import CostModel
from engine.config import HybridConfig
from engine.cost_calibration import measure_cost_model
from engine.event_emitter import EventEmitter
from engine.events import Tier
from engine.faults import Faults
from engine.identity import default_engine_id as default_engine_id
from engine.identity import resolve_device
from engine.loader import load_model
from engine.memory_estimate import check_memory
from engine.model.base import ModelLayout
from engine.model.kernel_backend import resolve_kernel_backend, set_kernel_backend
from engine.outputs import CacheReport, RequestOutput, ScoreOutput
from engine.parallel import engine_ranks
from engine.parallel.executor import RankSpec, run_on_every_rank, runs_on_every_rank
from engine.parallel.group import DEFAULT_TIMEOUT_SECONDS
from engine.prompt_inputs import normalise_prompts
from engine.request_lifecycle import RequestLifecycle, check_fits
from engine.request_lifecycle import RequestTooLarge as RequestTooLarge
from engine.sampling import Sampler, SamplingParams
from engine.telemetry import EventSink, NullSink, TelemetryClient

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _RunResult:
    logits: Tensor | None
    last_logits: Tensor
    output_token_ids: list[int]
    report: CacheReport
    ttft_seconds: float
    e2e_seconds: float


class LLM:
    """A hybrid-attention model with a per-form prefix cache.

    Args:
        model: a preset name (``kvscope_hybrid-tiny``), a model directory (``config.json`` +
            ``*.safetensors`` [+ ``tokenizer.json``]) or a family config (random weights).
        device: ``"auto"``, ``"cpu"`` or ``"cuda[:i]"``.
        cache: pool sizes and policies (defaults: :class:`CacheConfig`).
        telemetry: an agent URL (events are shipped by a :class:`TelemetryClient`), an
            :class:`EventSink`, or None (events discarded).
        engine_id: names this engine in events (default ``host-pid-start``, unique per run:
            see :func:`default_engine_id`).
        check_invariants: run :meth:`PrefixCache.check_invariants` after every chunk (tests).
        faults: faults to inject (:mod:`engine.faults`; tests), none by default.
        block_events: also emit a ``block`` event whenever a block or slot of any pool is
            stored or removed (vLLM's KV-event vocabulary; off by default: one event per block).
        cost_model: the admission's per-token costs and tier bandwidths; None: measured on this
            device at the first request when there is a choice to price (tiers or Tail-Replay
            enabled), else plans are ranked by how deep they resume.
        kernel_backend: ``"auto"`` (the Triton kernels on CUDA, torch elsewhere), ``"torch"``
            or ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``, for tests); see
            :mod:`engine.model.kernel_backend`.
        dtype: the weights' and KV pools' dtype (``float32``, ``bfloat16``, ``float16``); None:
            a directory's ``config.json`` ``dtype`` / ``torch_dtype``, else float32. Recurrent
            state stays float32.
        tensor_parallel_size: N ranks (one process each: this one is rank 0, the others are
            spawned and stopped by :meth:`close`), each holding 1/N of the sharded weights and
            of the sharded cache pools and its own host and disk tiers (:mod:`engine.parallel`;
            docs/tensor-parallel.md): gloo on the CPU, NCCL on CUDA (rank r on GPU r).
        tp_timeout_seconds: how long a rank waits in one collective before the engine calls a
            peer dead (:class:`~engine.parallel.group.RankFailed`).

    Raises:
        ValueError: an unknown model name, dtype or an invalid cache configuration; a model
            whose heads do not divide by ``tensor_parallel_size`` (naming the field).
    """

    def __init__(
        self,
        model: str | Path | HybridConfig | object = "kvscope_hybrid-tiny",
        device: str = "auto",
        cache: CacheConfig | None = None,
        telemetry: str | EventSink | None = None,
        *,
        engine_id: str | None = None,
        check_invariants: bool = False,
        block_events: bool = False,
        faults: Faults | None = None,
        cost_model: CostModel | None = None,
        kernel_backend: str = "auto",
        dtype: str | torch.dtype | None = None,
        tensor_parallel_size: int = 1,
        tp_timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        _rank: RankSpec | None = None,
    ) -> None:
        self.tp_rank = 0 if _rank is None else _rank.rank  # this process's tensor-parallel rank
        self.device = engine_ranks.rank_device(resolve_device(device), self.tp_rank, tensor_parallel_size)
        self.cache_config = cache or CacheConfig()
        self.engine_id = engine_id or default_engine_id()
        loaded = load_model(model, self.device, dtype, precheck=functools.partial(check_memory, self.cache_config, self.device))
        self.model = loaded.model
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.config = getattr(self.model, "config", None)
        """The family's config object (``HybridConfig``, ...), for callers that need it."""
        self.ranks: engine_ranks.EngineRanks | None = None
        """The tensor-parallel group (and on rank 0 its workers); None in a single process."""
        if tensor_parallel_size > 1:
            workers_kwargs = dict(
                model=model, device=device, cache=cache, engine_id=self.engine_id, check_invariants=check_invariants,
                faults=faults, cost_model=cost_model, kernel_backend=kernel_backend, dtype=dtype,
                tensor_parallel_size=tensor_parallel_size, tp_timeout_seconds=tp_timeout_seconds,
            )  # fmt: skip
            self.ranks = engine_ranks.start(self.model, self.device, tensor_parallel_size, tp_timeout_seconds, _rank, LLM, workers_kwargs)
            self.cache_config = engine_ranks.rank_cache_config(self.cache_config, self.tp_rank)
        self.layout: ModelLayout = self.model.layout
        self.dtype = next(self.model.parameters()).dtype
        """The weights' dtype, also the KV pools' (``dtype`` argument, else the checkpoint's config, else float32)."""
        try:
            self.cache = PrefixCache.planned(self.layout, self.cache_config, self.model_name, self.device, self.dtype)
        except BaseException:
            self._close_ranks()
            raise
        try:
            if self.ranks is not None:
                engine_ranks.join_cache(self.ranks, self.cache)
            self.kernel_backend = resolve_kernel_backend(kernel_backend, self.device, self.cache.unit_tokens)
            """The backend the layers run on (``torch`` or ``triton``)."""
            set_kernel_backend(self.model, self.kernel_backend)
            self._finish_init(telemetry, check_invariants, block_events, faults, cost_model)
            if self.ranks is not None and self.ranks.workers is not None:
                self.ranks.workers.ready()  # every worker built its shard
        except BaseException:
            if self.cache.tiers is not None:
                self.cache.tiers.close()  # gives the disk tier's directory back
            self._close_ranks()
            raise

    def _close_ranks(self) -> None:
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def _finish_init(
        self,
        telemetry: str | EventSink | None,
        check_invariants: bool,
        block_events: bool,
        faults: Faults | None,
        cost_model: CostModel | None,
    ) -> None:
        self.cache_config = self.cache.config  # block counts from the memory plan when budgeted
        if cost_model is not None and self.cache.tiers is not None:
            missing = [str(t) for t, on in self.cache.tiers.enabled.items() if on and t not in cost_model.tier_bytes_per_second]
            if missing:
                raise ValueError(f"cost_model has no tier_bytes_per_second for the enabled {' and '.join(missing)} tier")
        check_fits(self.cache, self.layout, prompt_tokens=1, max_tokens=0)
        self.cache.log_plan()
        self.sink: EventSink
        if telemetry is None:
            self.sink = NullSink()
        elif isinstance(telemetry, str):
            self.sink = TelemetryClient(telemetry, self.engine_id)
        else:
            self.sink = telemetry
        if faults is not None and faults.on_rank not in (None, self.tp_rank):
            faults = None  # injected on another tensor-parallel rank only
        if faults is not None:
            self.cache.faults = faults
            if self.cache.tiers is not None:
                self.cache.tiers.corrupt_writes = faults.corrupt_offloaded_file
                if faults.read_during_swap_in:
                    self.cache.tiers.hold()
        self.cost_model = cost_model
        self._needs_costs = cost_model is None and (self.cache.tiers is not None or self.cache_config.tail_replay != "off")
        self.events = EventEmitter(self.sink, self.engine_id, self.model_name, self.cache)
        """Builds and sends this engine's telemetry events."""
        if block_events:
            self.events.watch_blocks()
        self.lifecycle = RequestLifecycle(
            self.model, self.cache, self.events, engine_id=self.engine_id, device=self.device,
            cost_model=self._costs, check_invariants=check_invariants,
        )  # fmt: skip
        """Every request's steps, from validation to its events (``generate``, ``score`` and the
        serving runtime all go through it)."""

    @property
    def check_invariants(self) -> bool:
        """Whether :meth:`PrefixCache.check_invariants` runs after every chunk (tests)."""
        return self.lifecycle.check_invariants

    # -- public API ------------------------------------------------------------------------------
    @runs_on_every_rank()
    @torch.no_grad()
    def prefill_logits(self, token_ids: Sequence[int]) -> Tensor:
        """Logits ``[T, vocab]`` (float32) of a full recompute with no cache: the reference.

        Raises:
            ValueError: an empty prompt or a token id outside the vocabulary.
        """
        ids = self.lifecycle.as_tensor(token_ids)
        return self.model(ids, torch.arange(len(ids), device=self.device), self.model.new_dense_state())

    @runs_on_every_rank()
    @torch.no_grad()
    def score(self, token_ids: Sequence[int], *, request_id: str | None = None) -> ScoreOutput:
        """Run a prompt through the prefix cache like a normal request (no decode) and return the
        logits of the positions actually computed (L* … T−1; L* − R … T−1 after a Tail-Replay of
        R tokens, flagged ``approximate``)."""
        rid = request_id or self.lifecycle.new_request_id()
        result = self._run(list(token_ids), SamplingParams(max_tokens=0), rid, keep_logits=True)
        assert result.logits is not None
        return ScoreOutput(request_id=rid, logits=result.logits, cache=result.report)

    @runs_on_every_rank("on_token")
    @torch.no_grad()
    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list (text or token ids), one request after another.

        ``on_token(prompt_index, token_id)`` is called for every generated token as soon as it
        is sampled (streaming).

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, or a prompt that
                does not fit the cache pools.
        """
        params = sampling_params or SamplingParams()
        batch = normalise_prompts(self.tokenizer, prompts)
        if request_ids is not None and len(request_ids) != len(batch):
            raise ValueError(f"{len(request_ids)} request_ids for {len(batch)} prompts")
        outputs = []
        for i, ids in enumerate(batch):
            rid = request_ids[i] if request_ids is not None else self.lifecycle.new_request_id()
            stream = (lambda token, i=i: on_token(i, token)) if on_token is not None else None
            r = self._run(ids, params, rid, keep_logits=False, on_token=stream)
            outputs.append(
                RequestOutput(
                    request_id=rid,
                    prompt_token_ids=ids,
                    output_token_ids=r.output_token_ids,
                    text=self.tokenizer.decode(r.output_token_ids),
                    cache=r.report,
                    ttft_seconds=r.ttft_seconds,
                    e2e_seconds=r.e2e_seconds,
                )
            )
        return outputs

    @runs_on_every_rank()
    def prefetch(self, prompt: str | Sequence[int]) -> int:
        """Start swapping in from host or disk what a request with this prompt would reuse,
        without waiting (the copies run on the tiers' reader threads; a later request waits for them or
        resumes lower, per ``CacheConfig.swap_in_wait``). Returns the bytes enqueued (0 without
        tiers or when nothing needs a swap-in)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.lifecycle.as_tensor(ids)
        return self.cache.prefetch(self.cache.block_hashes(ids), len(ids))

    @runs_on_every_rank()
    def offload(self, tier: Tier | str = Tier.HOST, *, evict: bool = True) -> int:
        """Copy every cached object (not leased by a running request) to ``tier`` and, with
        ``evict``, drop its device copy; returns the objects moved.

        Raises:
            ValueError: that tier is off.
        """
        return self.cache.offload_all(Tier(tier), evict=evict)

    def close(self, timeout_seconds: float | None = 30.0) -> None:
        """Finish the tiers' copies (file writes included), then flush and stop the telemetry
        sink; with tensor parallelism, stop the other ranks."""
        try:
            if self.cache.tiers is not None:
                self.cache.settle(wait=True)
                self.cache.tiers.close()
            self.sink.close(timeout_seconds)
        finally:
            self._close_ranks()

    def on_every_rank(self, fn: Callable[..., object], *args: object) -> list[object]:
        """``fn(llm, *args)`` on every tensor-parallel rank (each with its own engine), results
        in rank order; ``[fn(self, *args)]`` in a single process. ``fn`` must be picklable (a
        module-level function): for tests and diagnostics (bytes held, invariants per rank)."""
        if self.ranks is None or self.ranks.workers is None:
            return [fn(self, *args)]
        return run_on_every_rank(self.ranks.workers, self, fn, args)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one request at a time ---------------------------------------------------------------------
    def _run(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        keep_logits: bool,
        on_token: Callable[[int], None] | None = None,
    ) -> _RunResult:
        """One request through :attr:`lifecycle`, alone: start, prefill, decode, release,
        events (the runtime's :meth:`~engine.runtime.runtime.Runtime.step` is the batched one)."""
        lifecycle = self.lifecycle
        arrival_wall = time.time()
        t0 = time.perf_counter()
        lifecycle.validate(token_ids, params.max_tokens)
        lease = lifecycle.start(token_ids, params.max_tokens)
        try:
            try:
                logits = lifecycle.prefill(lease, keep_logits)
            finally:
                lifecycle.prefill_done(lease)
            report = lifecycle.report(lease.record)
            last = logits[-1]
            sampler = Sampler(params)
            outputs: list[int] = []
            ttft = time.perf_counter() - t0
            while len(outputs) < params.max_tokens:
                token = sampler(last)
                if self.ranks is not None:  # rank 0's sample: every rank appends the same token
                    token = self.ranks.group.broadcast_ints([token])[0]
                outputs.append(token)
                if len(outputs) == 1:
                    ttft = time.perf_counter() - t0
                if on_token is not None:
                    on_token(token)
                if token in params.stop_token_ids or len(outputs) == params.max_tokens:
                    break
                last = lifecycle.decode_step(lease.seq, token)
        finally:
            lifecycle.release(lease)
            lifecycle.check_cache()
        e2e = time.perf_counter() - t0
        lifecycle.finish(request_id, arrival_wall, lease.record, report, len(outputs), ttft, e2e)
        return _RunResult(logits if keep_logits else None, last, outputs, report, ttft, e2e)

    def emit_engine_stats(self, ts: float | None = None) -> None:
        """One ``engine_stats`` event per form on the device with the pools' occupancy, and one
        per (form, lower tier) holding objects (:meth:`EventEmitter.engine_stats`; ``ts`` in
        wall-clock seconds, default now)."""
        self.events.engine_stats(ts)

    # -- helpers ---------------------------------------------------------------------------------
    @runs_on_every_rank()
    def calibrate(self) -> CostModel:
        """Measure the admission's cost model on this device now (per-token prefill costs, each
        enabled tier's bandwidth and per-object cost) and use it from here on; returns it."""
        self._needs_costs = True
        costs = self._costs()
        assert costs is not None
        return costs

    def _costs(self) -> CostModel | None:
        """The admission's cost model, measured once on this device when first needed (with
        tensor parallelism every rank measures in lockstep and rank 0's figures are used)."""
        if self._needs_costs:
            self._needs_costs = False
            group = None if self.ranks is None else self.ranks.group
            self.cost_model = measure_cost_model(self.model, self.layout.vocab_size, self.device, self.cache.tiers, group)
            log.info("admission cost model: %s", self.cost_model)
        return self.cost_model


def check_cache_config(model: str | Path, cache: CacheConfig) -> None:
    """Fail early, before services start, when ``cache`` cannot serve ``model`` (a compression
    ratio that does not tile the prefix-match unit, a budget too small for the headroom, pools
    too small for one request).

    Raises:
        ValueError: naming the setting to change.
    """
    LLM(model, device="cpu", cache=cache)
