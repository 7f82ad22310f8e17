"""``engine.LLM``: the public entry point (shaped like vLLM's ``LLM``), DESIGN.md §4.

Every request runs through the prefix cache: hash chain → lookup (L* and every form's verdict)
→ leases → chunked prefill from L* (taking recurrent checkpoints at their boundaries) → decode →
release. One ``cache_lookup`` event per (request, form) and one ``request`` event go to the
telemetry sink. Requests run one at a time in this walking skeleton.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from engine.cache import CacheConfig, PrefixCache
from engine.cache.admission import CostModel
from engine.cache.prefix_cache import Admitted, StaleResume
from engine.cache.sequence import PagedSequence
from engine.cache.tiers import round_trip
from engine.config import HybridConfig
from engine.events import (
    BlockAction,
    BlockEvent,
    CacheLookup,
    EngineStats,
    Form,
    Reason,
    RequestEvent,
    Tier,
)
from engine.faults import Faults
from engine.loader import load_model
from engine.model.base import ModelLayout
from engine.model.kernel_backend import resolve_kernel_backend, set_kernel_backend
from engine.outputs import CacheReport, RequestOutput, ScoreOutput
from engine.sampling import Sampler, SamplingParams
from engine.telemetry import EventSink, NullSink, TelemetryClient

log = logging.getLogger(__name__)

STATS_INTERVAL_SECONDS = 5.0


class RequestTooLarge(ValueError):
    """A request that cannot fit the cache pools as configured (raise the pool sizes)."""


def default_engine_id() -> str:
    """``host-pid-start``: unique per engine run (the start time, hex milliseconds, tells apart
    two runs that got the same pid), so each run's batch seqs start at 0 under their own id."""
    return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns() // 1_000_000:x}"


def resolve_device(device: str) -> torch.device:
    """``"auto"`` picks CUDA when present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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

    Raises:
        ValueError: an unknown model name or an invalid cache configuration.
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
    ) -> None:
        self.device = resolve_device(device)
        loaded = load_model(model, self.device)
        self.model = loaded.model
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.layout: ModelLayout = self.model.layout
        self.config = getattr(self.model, "config", None)
        """The family's config object (``HybridConfig``, ...), for callers that need it."""
        self.cache_config = cache or CacheConfig()
        self.engine_id = engine_id or default_engine_id()
        self.cache = PrefixCache.planned(self.layout, self.cache_config, self.model_name, self.device, torch.float32)
        try:
            self.kernel_backend = resolve_kernel_backend(kernel_backend, self.device, self.cache.unit_tokens)
            """The backend the layers run on (``torch`` or ``triton``)."""
            set_kernel_backend(self.model, self.kernel_backend)
            self._finish_init(telemetry, check_invariants, block_events, faults, cost_model)
        except BaseException:
            if self.cache.tiers is not None:
                self.cache.tiers.close()  # gives the disk tier's directory back
            raise

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
        self._check_fits(prompt_tokens=1, max_tokens=0)
        self.cache.log_plan()
        self.sink: EventSink
        if telemetry is None:
            self.sink = NullSink()
        elif isinstance(telemetry, str):
            self.sink = TelemetryClient(telemetry, self.engine_id)
        else:
            self.sink = telemetry
        self.check_invariants = check_invariants
        if faults is not None:
            self.cache.faults = faults
            if self.cache.tiers is not None:
                self.cache.tiers.corrupt_writes = faults.corrupt_offloaded_file
                if faults.read_during_swap_in:
                    self.cache.tiers.hold()
        self.cost_model = cost_model
        self._needs_costs = cost_model is None and (self.cache.tiers is not None or self.cache_config.tail_replay != "off")
        if block_events:
            tokens_of: dict[str, tuple[Form, int]] = {}
            for form, pool, _, _, tokens in self.cache.pool_entries():
                pool.observer = functools.partial(self._emit_block, form, tokens, Tier.DEVICE)
                tokens_of[pool.name] = (form, tokens)
            if self.cache.tiers is not None:
                self.cache.tiers.observer = lambda action, pool, h, tier: self._emit_block(*tokens_of[pool], tier, action, h, 0)
        self._request_counter = itertools.count()
        self._last_stats = 0.0

    # -- public API ------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill_logits(self, token_ids: Sequence[int]) -> Tensor:
        """Logits ``[T, vocab]`` (float32) of a full recompute with no cache: the reference.

        Raises:
            ValueError: an empty prompt or a token id outside the vocabulary.
        """
        ids = self._as_tensor(token_ids)
        return self.model(ids, torch.arange(len(ids), device=self.device), self.model.new_dense_state())

    @torch.no_grad()
    def score(self, token_ids: Sequence[int], *, request_id: str | None = None) -> ScoreOutput:
        """Run a prompt through the prefix cache like a normal request (no decode) and return the
        logits of the positions actually computed (L* … T−1; L* − R … T−1 after a Tail-Replay of
        R tokens, flagged ``approximate``)."""
        rid = request_id or self._next_request_id()
        result = self._run(list(token_ids), SamplingParams(max_tokens=0), rid, keep_logits=True)
        assert result.logits is not None
        return ScoreOutput(request_id=rid, logits=result.logits, cache=result.report)

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
        batch = self._normalise_prompts(prompts)
        if request_ids is not None and len(request_ids) != len(batch):
            raise ValueError(f"{len(request_ids)} request_ids for {len(batch)} prompts")
        outputs = []
        for i, ids in enumerate(batch):
            rid = request_ids[i] if request_ids is not None else self._next_request_id()
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

    def prefetch(self, prompt: str | Sequence[int]) -> int:
        """Start swapping in from host or disk what a request with this prompt would reuse,
        without waiting (the copies run on the tiers' reader threads; a later request waits for them or
        resumes lower, per ``CacheConfig.swap_in_wait``). Returns the bytes enqueued (0 without
        tiers or when nothing needs a swap-in)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._as_tensor(ids)
        return self.cache.prefetch(self.cache.block_hashes(ids), len(ids))

    def offload(self, tier: Tier | str = Tier.HOST, *, evict: bool = True) -> int:
        """Copy every cached object (not leased by a running request) to ``tier`` and, with
        ``evict``, drop its device copy; returns the objects moved.

        Raises:
            ValueError: that tier is off.
        """
        return self.cache.offload_all(Tier(tier), evict=evict)

    def close(self, timeout_seconds: float | None = 30.0) -> None:
        """Finish the tiers' copies (file writes included), then flush and stop the telemetry
        sink."""
        if self.cache.tiers is not None:
            self.cache.settle(wait=True)
            self.cache.tiers.close()
        self.sink.close(timeout_seconds)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- request execution -------------------------------------------------------------------------
    def _run(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        keep_logits: bool,
        on_token: Callable[[int], None] | None = None,
    ) -> _RunResult:
        arrival_wall = time.time()
        t0 = time.perf_counter()
        self._as_tensor(token_ids)  # validates
        self._check_fits(len(token_ids), params.max_tokens)
        costs = self._costs()
        t_admit = time.perf_counter()
        admitted, seq = self._start_request(token_ids, params.max_tokens, costs)
        plan = admitted.plan
        try:
            epochs = self._epochs(seq, plan.resume_tokens)
            try:
                logits = self._prefill(seq, keep_logits)
            finally:
                self.cache.finish_recovery(admitted)
            actual = time.perf_counter() - t_admit
            last = logits[-1]
            sampler = Sampler(params)
            outputs: list[int] = []
            ttft = time.perf_counter() - t0
            while len(outputs) < params.max_tokens:
                token = sampler(last)
                outputs.append(token)
                if len(outputs) == 1:
                    ttft = time.perf_counter() - t0
                if on_token is not None:
                    on_token(token)
                if token in params.stop_token_ids or len(outputs) == params.max_tokens:
                    break
                last = self._decode_step(seq, token)
        finally:
            seq.finish()
            if self.check_invariants:
                self.cache.check_invariants()
        e2e = time.perf_counter() - t0
        report = self._report(admitted, actual)
        self._emit_request(request_id, arrival_wall, report, len(outputs), ttft, e2e, epochs)
        return _RunResult(logits if keep_logits else None, last, outputs, report, ttft, e2e)

    def _start_request(self, token_ids: list[int], max_tokens: int, costs: CostModel | None) -> tuple[Admitted, PagedSequence]:
        """Admission and leases for one request: the plan, then :meth:`PrefixCache.start`; when an
        object the plan relies on changed between the check and the lease, the plan is made
        again with that form vetoed (``epoch_changed``). The caller owns the returned sequence
        (``finish`` it) and the admission (``finish_recovery`` once its prefill is done)."""
        hashes = self.cache.block_hashes(token_ids)
        admitted = self.cache.admit(hashes, len(token_ids), costs, output_tokens=max_tokens)
        if self.cache.faults.evict_between_check_and_use:
            self.cache.inject_eviction(admitted.plan, hashes)
        try:
            return admitted, self.cache.start(admitted.plan, token_ids, hashes)
        except StaleResume as stale:  # changed between check and use: recompute, say why
            self.cache.finish_recovery(admitted)
            admitted = self.cache.admit(hashes, len(token_ids), costs, output_tokens=max_tokens, vetoes={stale.form: Reason.EPOCH_CHANGED})
            try:
                return admitted, self.cache.start(admitted.plan, token_ids, hashes)
            except BaseException:
                self.cache.finish_recovery(admitted)
                raise
        except BaseException:
            self.cache.finish_recovery(admitted)
            raise

    def _epochs(self, seq: PagedSequence, resume_tokens: int) -> dict[Form, int]:
        """Each form's epoch at the plan's resume point L* (reported with its lookups)."""
        return {f.form: self.cache.form_epoch(seq, f, resume_tokens) for f in self.cache.forms}

    @staticmethod
    def _report(admitted: Admitted, actual_seconds: float) -> CacheReport:
        plan = admitted.plan
        return CacheReport(
            plan=plan,
            admission=admitted.admission,
            approximate=plan.replayed_tokens > 0,
            replayed_tokens=plan.replayed_tokens,
            predicted_seconds=admitted.predicted_seconds,
            actual_seconds=actual_seconds,
        )

    def _prefill(self, seq: PagedSequence, keep_logits: bool) -> Tensor:
        """Run ``[L*, T)`` in chunks of at most ``max_prefill_chunk_tokens`` that end at the
        sequence's checkpoint positions; logits of the computed positions (or only the last
        chunk's when ``keep_logits`` is False)."""
        total = len(seq.token_ids)
        start = seq.num_computed_tokens
        pieces: list[Tensor] = []
        while start < total:
            end = min([total, start + self.cache_config.max_prefill_chunk_tokens, *(p for p in seq.checkpoint_positions if p > start)])
            positions = seq.begin_chunk(end)
            logits = self.model(self._ids(seq.token_ids[start:end]), positions, seq)
            seq.commit(end, take_checkpoint=end in seq.checkpoint_positions)
            if self.check_invariants:
                self.cache.check_invariants()
            pieces.append(logits if keep_logits else logits[-1:])
            start = end
        return torch.cat(pieces) if keep_logits else pieces[-1]

    def _decode_step(self, seq: PagedSequence, token: int) -> Tensor:
        seq.append_token(token)
        end = len(seq.token_ids)
        positions = seq.begin_chunk(end)
        logits = self.model(self._ids([token]), positions, seq)
        seq.commit(end, take_checkpoint=False)
        return logits[-1]

    # -- events --------------------------------------------------------------------------------
    def _emit_request(
        self,
        request_id: str,
        ts: float,
        report: CacheReport,
        output_tokens: int,
        ttft: float,
        e2e: float,
        epochs: dict[Form, int],
    ) -> None:
        for f in report.forms:
            self.sink.emit(
                CacheLookup(
                    ts=ts,
                    engine_id=self.engine_id,
                    request_id=request_id,
                    model=self.model_name,
                    form=f.form,
                    tier=f.tier,
                    outcome=f.outcome,
                    reason=f.reason,
                    hash_hit_tokens=report.hash_hit_tokens,
                    usable_tokens=f.usable_tokens,
                    recoverable_tokens=f.recoverable_tokens,
                    replayed_tokens=f.replayed_tokens,
                    approximate=f.replayed_tokens > 0,
                    recovery_seconds=f.recovery_seconds,
                    bytes_moved=f.bytes_moved,
                    epoch=epochs.get(f.form, 0),
                    ghost_tokens=f.ghost_tokens,
                    ghost_bytes=f.ghost_bytes,
                    spare_bytes=f.spare_bytes,
                )
            )
        self.sink.emit(
            RequestEvent(
                ts=ts,
                engine_id=self.engine_id,
                request_id=request_id,
                model=self.model_name,
                prompt_tokens=report.prompt_tokens,
                output_tokens=output_tokens,
                hash_hit_tokens=report.hash_hit_tokens,
                resume_tokens=report.resume_tokens,
                recoverable_tokens=report.recoverable_tokens,
                replayed_tokens=report.replayed_tokens,
                recomputed_tokens=report.recomputed_tokens,
                approximate=report.approximate,
                limiting_form=report.limiting_form,
                limiting_reason=report.limiting_reason,
                admission=report.admission,
                predicted_seconds=report.predicted_seconds,
                actual_seconds=report.actual_seconds,
                ttft_seconds=ttft,
                e2e_seconds=e2e,
            )
        )
        now = time.time()
        if now - self._last_stats >= STATS_INTERVAL_SECONDS:
            self._last_stats = now
            self.emit_engine_stats(now)

    def _emit_block(self, form: Form, num_tokens: int, tier: Tier, action: str, h: bytes, block: int) -> None:
        self.sink.emit(
            BlockEvent(
                ts=time.time(),
                engine_id=self.engine_id,
                model=self.model_name,
                form=form,
                tier=tier,
                action=BlockAction(action),
                block_hash=h.hex(),
                block_id=block,
                num_tokens=num_tokens,
            )
        )

    def emit_engine_stats(self, ts: float | None = None) -> None:
        """One ``engine_stats`` event per form on the device with the pools' occupancy, and one
        per (form, lower tier) holding objects (bytes and object counts)."""
        ts = time.time() if ts is None else ts
        in_flight = self.cache.recovery.in_flight
        for occ in [*self.cache.occupancy(), *self.cache.tier_occupancy()]:
            self.sink.emit(
                EngineStats(
                    ts=ts,
                    engine_id=self.engine_id,
                    model=self.model_name,
                    form=occ.form,
                    tier=occ.tier,
                    used_bytes=occ.used_bytes,
                    used_blocks=occ.used_blocks,
                    cached_blocks=occ.cached_blocks,
                    free_blocks=occ.free_blocks,
                    total_blocks=occ.total_blocks,
                    recoveries_in_flight=in_flight,
                )
            )

    # -- helpers ---------------------------------------------------------------------------------
    def calibrate(self) -> CostModel:
        """Measure the admission's cost model on this device now (per-token prefill costs, each
        enabled tier's bandwidth and per-object cost) and use it from here on; returns it."""
        self._needs_costs = True
        costs = self._costs()
        assert costs is not None
        return costs

    def _costs(self) -> CostModel | None:
        """The admission's cost model, measured once on this device when first needed."""
        if self._needs_costs:
            self._needs_costs = False
            tiers = self.cache.tiers
            where = {} if tiers is None else {t: tiers.disk_dir for t, on in tiers.enabled.items() if on}

            def prefill(n: int) -> None:
                ids = torch.randint(0, self.layout.vocab_size, (n,), device=self.device)
                with torch.no_grad():
                    self.model(ids, torch.arange(n, device=self.device), self.model.new_dense_state())

            self.cost_model = CostModel.measure(prefill, where, round_trip)
            log.info("admission cost model: %s", self.cost_model)
        return self.cost_model

    def _next_request_id(self) -> str:
        return f"{self.engine_id}-{next(self._request_counter)}"

    def _ids(self, token_ids: Sequence[int]) -> Tensor:
        return torch.tensor(token_ids, dtype=torch.long, device=self.device)

    def _as_tensor(self, token_ids: Sequence[int]) -> Tensor:
        if len(token_ids) == 0:
            raise ValueError("empty prompt: at least one token is needed")
        ids = self._ids(token_ids)
        bad = ((ids < 0) | (ids >= self.layout.vocab_size)).nonzero()
        if len(bad):
            i = int(bad[0].item())
            raise ValueError(f"token id {token_ids[i]} at position {i} is outside the vocabulary [0, {self.layout.vocab_size})")
        return ids

    def _check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        c = self.cache_config
        pages = -(-(prompt_tokens + max_tokens) // c.unit_tokens)
        if "full_attention" in self.layout.layer_types and pages > c.full_kv_blocks - 1:
            raise RequestTooLarge(
                f"a request of {prompt_tokens} prompt + {max_tokens} output tokens needs {pages} full_kv "
                f"pages; the pool has {c.full_kv_blocks - 1} (raise {self._size_knob('CacheConfig.full_kv_blocks')})"
            )
        window = self.layout.sliding_window
        window_pages = self.cache.window_pages_needed(window, max_tokens) if window is not None else 0
        if window_pages > c.swa_blocks - 1:
            raise RequestTooLarge(
                f"a request generating {max_tokens} tokens may hold {window_pages} swa_window pages; "
                f"the pool has {c.swa_blocks - 1} (raise {self._size_knob('CacheConfig.swa_blocks')})"
            )

    def _size_knob(self, field: str) -> str:
        """The setting that sizes a pool: its own field, or the budget when a memory plan sized it."""
        return "CacheConfig.memory_bytes" if self.cache_config.memory_bytes is not None else field

    def _normalise_prompts(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
        if isinstance(prompts, str):
            return [self.tokenizer.encode(prompts)]
        items: list[object] = list(prompts)
        if items and all(isinstance(p, int) for p in items):
            return [[p for p in items if isinstance(p, int)]]
        out: list[list[int]] = []
        for p in items:
            if isinstance(p, str):
                out.append(self.tokenizer.encode(p))
            elif isinstance(p, Sequence):
                out.append([int(t) for t in p])
            else:
                raise ValueError(f"a prompt must be text or a list of token ids, got {type(p).__name__}")
        return out


def check_cache_config(model: str | Path, cache: CacheConfig) -> None:
    """Fail early, before services start, when ``cache`` cannot serve ``model`` (a compression
    ratio that does not tile the prefix-match unit, a budget too small for the headroom, pools
    too small for one request).

    Raises:
        ValueError: naming the setting to change.
    """
    LLM(model, device="cpu", cache=cache)
