"""A request's life in the engine, from its prompt to its events (DESIGN.md §4).

Every request goes through these steps of :class:`RequestLifecycle`, in this order, whether it
runs alone (``LLM.generate``, ``LLM.score``) or among many
(:class:`~engine.runtime.runtime.Runtime`, behind the server). After each step, what the request
holds:

1. :meth:`~RequestLifecycle.validate`: token ids inside the vocabulary, and the prompt plus
   ``max_tokens`` outputs fit the pools as configured. Holds nothing.
2. :meth:`~RequestLifecycle.start`: hash chain → lookup (L* and every form's verdict) →
   admission pricing → leases; an object that changed between the check and the lease has the
   plan made again with that form vetoed (``epoch_changed``). Holds a :class:`Lease`: the
   sequence's leases and the recovery budget.
3. :meth:`~RequestLifecycle.commit`, per chunk ``[start, end)`` after its forward: pages
   published, a recurrent checkpoint taken when ``end`` is a checkpoint position.
   (:meth:`~RequestLifecycle.prefill` and :meth:`~RequestLifecycle.decode_step` run and commit
   chunks of a request that runs alone; the runtime packs many requests' chunks in one forward.)
4. :meth:`~RequestLifecycle.prefill_done`, once the prompt is computed: the recovery budget goes
   back (Tail-Replay tokens are in flight until then); :meth:`~RequestLifecycle.report` says
   how the cache served the admission. Holds the sequence's leases.
5. :meth:`~RequestLifecycle.release` (finish, abort or preemption): whatever the lease still
   holds goes back; what the sequence published stays cached. Holds nothing.
6. :meth:`~RequestLifecycle.finish`: the ``cache_lookup`` and ``request`` events.

A request preempted by recompute is released and started again; its report and events are its
first admission's (:class:`AdmissionRecord`: a re-admission resuming on pages the request
published itself is not a cache hit).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.cache import CacheConfig, PrefixCache
from engine.cache.admission import CostModel
from engine.cache.hashing import BlockHash
from engine.cache.prefix_cache import Admitted, StaleResume
from engine.cache.sequence import PagedSequence
from engine.event_emitter import EventEmitter
from engine.events import Form, Reason
from engine.model.base import CausalLM, ModelLayout
from engine.outputs import CacheReport


class RequestTooLarge(ValueError):
    """A request that cannot fit the cache pools as configured (raise the pool sizes)."""


def check_fits(cache: PrefixCache, layout: ModelLayout, prompt_tokens: int, max_tokens: int) -> None:
    """Refuse one request of ``prompt_tokens`` + ``max_tokens`` tokens that can never run: its
    full-KV pages (``ceil(tokens / unit_tokens)``) or its sliding-window pages exceed their pool
    (less the sentinel block).

    Raises:
        RequestTooLarge: naming the pool and the setting that sizes it.
    """
    c = cache.config
    pages = -(-(prompt_tokens + max_tokens) // c.unit_tokens)
    if "full_attention" in layout.layer_types and pages > c.full_kv_blocks - 1:
        raise RequestTooLarge(
            f"a request of {prompt_tokens} prompt + {max_tokens} output tokens needs {pages} full_kv "
            f"pages; the pool has {c.full_kv_blocks - 1} (raise {_sizing(c, 'CacheConfig.full_kv_blocks')})"
        )
    window = layout.sliding_window
    window_pages = cache.window_pages_needed(window, max_tokens) if window is not None else 0
    if window_pages > c.swa_blocks - 1:
        raise RequestTooLarge(
            f"a request generating {max_tokens} tokens may hold {window_pages} swa_window pages; "
            f"the pool has {c.swa_blocks - 1} (raise {_sizing(c, 'CacheConfig.swa_blocks')})"
        )


def _sizing(config: CacheConfig, field: str) -> str:
    """The setting that sizes a pool: its own field, or the budget when a memory plan sized it."""
    return "CacheConfig.memory_bytes" if config.memory_bytes is not None else field


@dataclass(frozen=True, slots=True)
class AdmissionRecord:
    """What :meth:`RequestLifecycle.start` decided for one admission; kept after its lease is
    released, for the request's report and events.

    Attributes:
        admitted: the admission's plan (L*, every form's verdict), path and prediction.
        epochs: each form's epoch at the plan's resume point L* (reported with its lookups).
        admitted_at: ``time.perf_counter()`` seconds when the admission began.
    """

    admitted: Admitted
    epochs: dict[Form, int]
    admitted_at: float


@dataclass(eq=False, slots=True)
class Lease:
    """What one admission of a request holds, from :meth:`RequestLifecycle.start` to
    :meth:`RequestLifecycle.release`.

    Attributes:
        record: what the admission decided.
        seq: the request's paged sequence (its block tables and working state), leasing what
            the plan reuses.
        recovering: still holding the recovery budget (until :meth:`RequestLifecycle.prefill_done`).
    """

    record: AdmissionRecord
    seq: PagedSequence
    recovering: bool = True


class RequestLifecycle:
    """The steps of a request's life (module docstring) over one engine's model, cache and events.

    Args:
        model: the engine's model; :meth:`prefill` and :meth:`decode_step` run it.
        cache: the engine's prefix cache.
        events: where a finished request's events go.
        engine_id: prefixes the request ids :meth:`new_request_id` makes.
        device: where the model runs (token ids go there).
        cost_model: returns the admission's cost model (None: plans ranked by how deep they
            resume); called at every :meth:`start`, so it may measure on first use.
        check_invariants: run :meth:`PrefixCache.check_invariants` after every prefill chunk and
            release of the one-request path, and wherever a caller runs :meth:`check_cache`.
    """

    def __init__(
        self,
        model: CausalLM,
        cache: PrefixCache,
        events: EventEmitter,
        *,
        engine_id: str,
        device: torch.device,
        cost_model: Callable[[], CostModel | None],
        check_invariants: bool = False,
    ) -> None:
        self.model = model
        self.cache = cache
        self.events = events
        self.engine_id = engine_id
        self.cost_model = cost_model
        self.check_invariants = check_invariants
        self.layout: ModelLayout = model.layout
        self.device = device
        self.request_serials = itertools.count()
        """Numbers the ids :meth:`new_request_id` makes, from 0."""

    # -- before the cache is touched ----------------------------------------------------------------
    def new_request_id(self) -> str:
        """``{engine_id}-{n}``, n counting from 0 in this engine."""
        return f"{self.engine_id}-{next(self.request_serials)}"

    def to_device(self, token_ids: Sequence[int]) -> Tensor:
        """Token ids as a ``[len(token_ids)]`` int64 tensor on the engine's device (unchecked)."""
        return torch.tensor(token_ids, dtype=torch.long, device=self.device)

    def as_tensor(self, token_ids: Sequence[int]) -> Tensor:
        """:meth:`to_device`, checked: ``[T]`` int64 on the engine's device.

        Raises:
            ValueError: an empty prompt, or a token id outside ``[0, vocab_size)`` (naming it and
                its position).
        """
        if len(token_ids) == 0:
            raise ValueError("empty prompt: at least one token is needed")
        ids = self.to_device(token_ids)
        vocab = self.layout.vocab_size
        bad = ((ids < 0) | (ids >= vocab)).nonzero()
        if len(bad):
            i = int(bad[0].item())
            raise ValueError(f"token id {token_ids[i]} at position {i} is outside the vocabulary [0, {vocab})")
        return ids

    def validate(self, token_ids: Sequence[int], max_tokens: int) -> None:
        """Refuse a request that can never run: :meth:`as_tensor` and :func:`check_fits`.

        Raises:
            ValueError: an empty prompt or a token id outside the vocabulary.
            RequestTooLarge: the prompt and ``max_tokens`` outputs do not fit the pools.
        """
        self.as_tensor(token_ids)
        check_fits(self.cache, self.layout, len(token_ids), max_tokens)

    # -- holding cache objects ----------------------------------------------------------------------
    def start(self, token_ids: list[int], max_tokens: int) -> Lease:
        """Admission and leases for one request of ``token_ids`` (prompt, and after a preemption
        the outputs so far) that may still generate ``max_tokens`` tokens.

        Prices the plans with :attr:`cost_model` (measured first if needed), then
        :meth:`PrefixCache.admit` and :meth:`PrefixCache.start`. When an object the plan relies
        on changed between the check and the lease (:class:`StaleResume`, on any tensor-parallel
        rank), the plan is made again with that form vetoed (``epoch_changed``); if that one goes
        stale too, the request recomputes everything (every form vetoed). The caller owns the
        returned lease: give it back with :meth:`release`.

        Raises:
            StaleResume: a plan that reuses nothing went stale (an internal invariant). RuntimeError: from
                :meth:`PrefixCache.start` (an internal invariant). Nothing is held after a raise.
        """
        costs = self.cost_model()
        admitted_at = time.perf_counter()
        cache = self.cache
        hashes = cache.block_hashes(token_ids)
        if cache.faults.lose_shard is not None:
            cache.form_set.lose_shard(cache.faults.lose_shard, hashes)
        admitted = cache.admit(hashes, len(token_ids), costs, output_tokens=max_tokens)
        if cache.faults.evict_between_check_and_use:
            cache.inject_eviction(admitted.plan, hashes)
        leased = self._lease(admitted, token_ids, hashes)
        if isinstance(leased, StaleResume):  # changed between check and use: recompute, say why
            cache.finish_recovery(admitted)
            admitted = cache.admit(hashes, len(token_ids), costs, output_tokens=max_tokens, vetoes={leased.form: Reason.EPOCH_CHANGED})
            leased = self._lease(admitted, token_ids, hashes)
            if isinstance(leased, StaleResume):  # changed again: recompute everything (nothing leased can go stale)
                cache.finish_recovery(admitted)
                cold = dict.fromkeys((f.form for f in cache.forms), Reason.EPOCH_CHANGED)
                admitted = cache.admit(hashes, len(token_ids), costs, output_tokens=max_tokens, vetoes=cold)
                leased = self._lease(admitted, token_ids, hashes)
                if isinstance(leased, StaleResume):
                    cache.finish_recovery(admitted)
                    raise leased
        seq = leased
        try:
            epochs = {f.form: cache.form_epoch(seq, f, admitted.plan.resume_tokens) for f in cache.forms}
        except BaseException:
            cache.finish_recovery(admitted)
            seq.finish()
            raise
        if cache.agreement is not None:
            cache.agreement.count(admitted.plan)
        return Lease(AdmissionRecord(admitted, epochs, admitted_at), seq)

    def _lease(self, admitted: Admitted, token_ids: list[int], hashes: list[BlockHash]) -> PagedSequence | StaleResume:
        """:meth:`PrefixCache.start` on ``admitted``'s plan; a :class:`StaleResume` (returned,
        nothing held) when a leased object changed since the lookup — with tensor parallelism,
        on any rank (the ranks exchange it, :meth:`RankAgreement.stale`, and all release).

        Raises:
            RuntimeError: from :meth:`PrefixCache.start`; the recovery budget is given back.
        """
        cache = self.cache
        seq: PagedSequence | None = None
        stale: StaleResume | None = None
        try:
            seq = cache.start(admitted.plan, token_ids, hashes)
        except StaleResume as exc:
            stale = exc
        except BaseException:
            cache.finish_recovery(admitted)
            raise
        if cache.agreement is not None:
            agreed = cache.agreement.stale(None if stale is None else stale.form, [f.form for f in cache.forms])
            if agreed is not None and stale is None:
                assert seq is not None
                seq.finish()  # another rank's lease went stale: every rank plans again
                stale = StaleResume(agreed[0])
        if stale is not None:
            return stale
        assert seq is not None
        return seq

    def commit(self, seq: PagedSequence, end: int) -> None:
        """After the forward of a chunk ending at token ``end`` (exclusive): publish its pages,
        taking a recurrent checkpoint when ``end`` is one of ``seq``'s checkpoint positions."""
        seq.commit(end, take_checkpoint=end in seq.checkpoint_positions)

    def prefill(self, lease: Lease, keep_logits: bool) -> Tensor:
        """Compute ``[L*, T)`` of the lease's sequence alone, in chunks of at most
        ``max_prefill_chunk_tokens`` that end at its checkpoint positions where those cannot be
        taken inside a chunk (``PagedSequence.chunk_stops``), each committed
        (:meth:`commit`, then :meth:`check_cache`).

        Returns:
            float32 logits ``[T − L*, vocab]`` of the computed positions with ``keep_logits``,
            else only the last one's, ``[1, vocab]``.
        """
        seq = lease.seq
        total = len(seq.token_ids)
        start = seq.num_computed_tokens
        pieces: list[Tensor] = []
        while start < total:
            end = min([total, start + self.cache.config.max_prefill_chunk_tokens, *(p for p in seq.chunk_stops if p > start)])
            positions = seq.begin_chunk(end)
            logits = self.model(self.to_device(seq.token_ids[start:end]), positions, seq)
            self.commit(seq, end)
            self.check_cache()
            pieces.append(logits if keep_logits else logits[-1:])
            start = end
        return torch.cat(pieces) if keep_logits else pieces[-1]

    def decode_step(self, seq: PagedSequence, token: int) -> Tensor:
        """Append ``token`` to ``seq``, compute it alone and commit it (no checkpoint); returns
        the float32 logits row ``[vocab]`` the next token is sampled from."""
        seq.append_token(token)
        end = len(seq.token_ids)
        positions = seq.begin_chunk(end)
        logits = self.model(self.to_device([token]), positions, seq)
        seq.commit(end, take_checkpoint=False)
        return logits[-1]

    def prefill_done(self, lease: Lease) -> bool:
        """Give back the recovery budget the lease holds (:meth:`PrefixCache.finish_recovery`),
        once its sequence is fully computed; returns whether it still held it (False: already
        given back, nothing done)."""
        if not lease.recovering:
            return False
        self.cache.finish_recovery(lease.record.admitted)
        lease.recovering = False
        return True

    def release(self, lease: Lease) -> None:
        """Give back all the lease holds: the recovery budget if :meth:`prefill_done` has not,
        then the sequence's leases and pages (``PagedSequence.finish``; what it published stays
        cached). Used when a request finishes, is aborted or is preempted."""
        self.prefill_done(lease)
        lease.seq.finish()

    def report(self, record: AdmissionRecord) -> CacheReport:
        """How the cache served the admission of ``record``, with ``actual_seconds`` measured from
        its :attr:`AdmissionRecord.admitted_at` to now (call it when the prefill is done)."""
        admitted = record.admitted
        plan = admitted.plan
        return CacheReport(
            plan=plan,
            admission=admitted.admission,
            approximate=plan.replayed_tokens > 0,
            replayed_tokens=plan.replayed_tokens,
            predicted_seconds=admitted.predicted_seconds,
            actual_seconds=time.perf_counter() - record.admitted_at,
        )

    # -- after -----------------------------------------------------------------------------------
    def finish(
        self,
        request_id: str,
        arrival_wall: float,
        record: AdmissionRecord,
        report: CacheReport,
        output_tokens: int,
        ttft_seconds: float,
        e2e_seconds: float,
    ) -> None:
        """Emit an ended request's events (:meth:`EventEmitter.request`): ``arrival_wall`` in
        wall-clock seconds; ``record`` (its first admission, whose epochs go with the lookups)
        and ``report``; ``ttft_seconds`` and ``e2e_seconds`` from its arrival. Call it once its
        lease is released."""
        self.events.request(request_id, arrival_wall, report, output_tokens, ttft_seconds, e2e_seconds, record.epochs)

    def check_cache(self) -> None:
        """With ``check_invariants``: :meth:`PrefixCache.check_invariants` (raises
        ``AssertionError`` naming the broken invariant); else nothing."""
        if self.check_invariants:
            self.cache.check_invariants()
