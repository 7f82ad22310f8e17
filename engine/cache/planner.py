"""The planner: a request's resume plan on the device, its candidate plans, and which one it
runs (DESIGN.md §4, red lines 1 and 2).

:meth:`Planner.lookup` is the device plan (exact, or Tail-Replay); :meth:`Planner.admit`
prices it against the exact plan without replay, a deeper exact plan after a swap-in (asked of
the :class:`~engine.cache.swap.SwapController`) and a cold prefill, and runs the cheapest one the
recovery cap admits. The planner owns no pool: it reads the forms' resume rules through the
:class:`~engine.cache.form_set.FormSet` and moves nothing itself.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.cache.admission import Candidate, CostModel, RecoveryBudget, choose, price
from engine.cache.config import CacheConfig
from engine.cache.coordinator import ResumePlan, plan_resume, resume_limit
from engine.cache.form_set import FormSet
from engine.cache.ghosts import GhostPricer
from engine.cache.hashing import BlockHash
from engine.cache.indexer_sync import with_sync_delay
from engine.cache.rank_agreement import RankAgreement
from engine.cache.swap import SwapController, SwapPlan
from engine.cache.tail_replay import tail_replay_plan
from engine.cache.validation import check_granularity
from engine.cache.verdicts import relabel, swapped_verdicts
from engine.events import Admission, Form, Outcome, Reason


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """What admission decided for one request: the plan to start (device view, after any
    swap-in), the path, its predicted seconds, and the recovery budget it holds until its
    prefill ends (release it with :meth:`Planner.finish_recovery`)."""

    plan: ResumePlan
    admission: Admission
    predicted_seconds: float
    held_replay_tokens: int = 0


class Planner:
    """Plans over the forms of ``form_set``; swap-ins through ``swap`` (None: no lower tier);
    Tail-Replay tokens and swap-in bytes held against ``recovery``."""

    def __init__(self, form_set: FormSet, swap: SwapController | None, recovery: RecoveryBudget, config: CacheConfig) -> None:
        self.form_set = form_set
        self.swap = swap
        self.recovery = recovery
        self.config = config
        self.ghosts = GhostPricer(form_set)
        self.agreement: RankAgreement | None = None
        """With tensor parallelism: the cross-rank exchanges every lookup runs in lockstep
        (:mod:`engine.cache.rank_agreement`); None in a single process."""

    def lookup(
        self,
        hashes: Sequence[BlockHash],
        prompt_tokens: int,
        vetoes: Mapping[Form, Reason] | None = None,
        *,
        output_tokens: int = 0,
        replay: bool = True,
        hit_tokens: int | None = None,
    ) -> ResumePlan:
        """The hash hit and the resume plan; takes no lease and changes nothing.

        The four validation layers (DESIGN.md §4): granularity and group intersection are part
        of each form's resume rule; a form whose stored tensors break the reading kernel's
        contract (layer 2) or alignment (layer 4) cannot resume anywhere and reports that
        reason. ``vetoes`` names forms that must not be used (with the reason they report).
        Objects only a lower tier holds count for the hash hit but not for L* (see
        :meth:`admit`, which prices swapping them in). ``replay=False`` leaves Tail-Replay out.
        ``hit_tokens`` replaces the hash hit (the one a request matched before its swap-in, whose
        failed copies leave the index).

        Raises:
            RuntimeError: L* itself is not a multiple of U (an internal invariant).
        """
        fs, u, agreement = self.form_set, self.form_set.unit_tokens, self.agreement
        hit = fs.hash_hit_tokens(hashes) if hit_tokens is None else hit_tokens
        if agreement is not None:
            agreement.begin()
            hit = agreement.hash_hit(hit)
        reasons = fs.failure_reasons(vetoes) if hit else dict(vetoes or {})
        if agreement is not None:
            reasons = agreement.vetoes(reasons, [f.form for f in fs.forms])
        forms = fs.resumable(reasons)
        if agreement is not None:
            forms = agreement.forms(forms, hashes)
        plan = plan_resume(forms, hashes, prompt_tokens, hit, u)
        if replay and self.config.tail_replay != "off" and fs.linear is not None and hit and Form.LINEAR_STATE not in reasons:
            plan = tail_replay_plan(plan, forms, hashes, prompt_tokens + output_tokens, hit, config=self.config, kv_forms=fs.kv_forms)
        if agreement is not None:
            plan = agreement.annotate(plan)
        plan = dataclasses.replace(plan, pool_versions=fs.pool_versions())
        if self.swap is not None and self.swap.prefetching:  # objects on their way up: the forms that need them say so
            plan = relabel(plan, self.swap.in_flight_forms(hashes, plan), (Outcome.INVALIDATED, Outcome.REPLAYED))
        failure = check_granularity(plan.resume_tokens, u)
        if failure is not None:
            raise RuntimeError(f"resume point {plan.resume_tokens} fails validation: {failure}")
        return plan

    def admit(
        self,
        hashes: Sequence[BlockHash],
        prompt_tokens: int,
        costs: CostModel | None,
        *,
        output_tokens: int = 0,
        vetoes: Mapping[Form, Reason] | None = None,
    ) -> Admitted:
        """Choose and prepare a request's plan (DESIGN.md §4, red lines 1 and 2).

        Candidates: the device's own plan (exact, or Tail-Replay), the exact plan without
        Tail-Replay, a deeper exact resume after swapping objects in from host or disk, and a
        cold prefill; each is priced with ``costs`` (None: prefer the deepest resume) and the
        cheapest one the recovery cap admits wins. A chosen swap-in runs here (copies on the
        tiers' reader threads, waited for) and the plan is then made again on the device, so a
        copy that fails verification lowers L* with its reason (``offload_corrupt``,
        ``layout_mismatch``) instead of feeding wrong bytes. A form a rejected deeper plan would
        have recovered reports ``admission_recompute_cheaper`` or ``recovery_cap_reached``.

        Raises:
            RuntimeError: an internal invariant (a planned object vanished).
        """
        if self.swap is not None:
            self.swap.settle()
        device = self.lookup(hashes, prompt_tokens, vetoes, output_tokens=output_tokens)
        swap: SwapPlan | None = None
        if self.swap is not None:
            device = relabel(self.swap.claim_restored(hashes, device), self.swap.claim_refused(hashes, device))
            swap = self.swap.swap_plan(hashes, prompt_tokens, vetoes, device)
        exact = device if not device.replayed_tokens else self.lookup(hashes, prompt_tokens, vetoes, output_tokens=output_tokens, replay=False)
        model = costs or CostModel(seconds_per_token=1.0)  # without measured costs: the deepest resume wins
        start = device.resume_tokens - device.replayed_tokens
        kind = Admission.TAIL_REPLAY if device.replayed_tokens else (Admission.EXACT if device.resume_tokens else Admission.COLD)
        if kind is Admission.EXACT and any(f.outcome is Outcome.RECOVERED for f in device.forms):
            kind = Admission.SWAP_IN  # a prefetch brought its objects back
        chunks = functools.partial(self.chunks, prompt_tokens)
        # each candidate with the plan it starts (None for the cold prefill, built if chosen)
        options: list[tuple[Candidate, ResumePlan | None]] = [
            (price(model, kind, start, prompt_tokens, {}, device.replayed_tokens, chunks=chunks(device)), device)
        ]
        forced = self.config.tail_replay in ("on", "only") and self.recovery.admits(0, device.replayed_tokens)
        if exact is not device and not (device.replayed_tokens and forced):  # on / only: the paper's setting
            kind_exact = Admission.EXACT if exact.resume_tokens else Admission.COLD
            options.append((price(model, kind_exact, exact.resume_tokens, prompt_tokens, {}, 0, chunks=chunks(exact)), exact))
        swap_option: Candidate | None = None
        if swap is not None:
            swap_option = price(
                model, Admission.SWAP_IN, swap.plan.resume_tokens, prompt_tokens, swap.bytes_by_tier(), 0, swap.objects_by_tier(), chunks(swap.plan)
            )
            options.append((swap_option, swap.plan))
        cold_plan = dataclasses.replace(device, resume_tokens=0, replayed_tokens=0)
        options.append((price(model, Admission.COLD, 0, prompt_tokens, {}, 0, chunks=chunks(cold_plan)), None))
        best, rejected = choose([c for c, _ in options], self.recovery)
        if self.agreement is not None:  # priced on rank 0's measurements, but chosen once: rank 0's
            best = options[self.agreement.from_rank0(next(i for i, (c, _) in enumerate(options) if c is best))][0]
        predicted = best.predicted_seconds if costs is not None else 0.0
        why = {c.admission: Reason.RECOVERY_CAP_REACHED if how == "cap" else Reason.ADMISSION_RECOMPUTE_CHEAPER for c, how in rejected}

        if best is swap_option and swap is not None:
            plan = self._run_swap_in(hashes, prompt_tokens, output_tokens, vetoes, swap, device, best)
            return Admitted(plan=self._measured(plan, hashes, vetoes), admission=Admission.SWAP_IN, predicted_seconds=predicted)
        chosen = next(p for c, p in options if c is best)
        used_vetoes = vetoes
        if chosen is None:  # cold: nothing reused
            used_vetoes = cold = dict.fromkeys((f.form for f in self.form_set.forms), Reason.ADMISSION_RECOMPUTE_CHEAPER)
            chosen = self.lookup(hashes, prompt_tokens, cold, output_tokens=output_tokens, replay=False)
        plan = chosen
        relabels: dict[Form, Reason] = {}
        if device.replayed_tokens and plan is not device and Admission.TAIL_REPLAY in why:
            relabels[Form.LINEAR_STATE] = why[Admission.TAIL_REPLAY]
        if swap is not None and Admission.SWAP_IN in why:
            relabels |= dict.fromkeys(swap.entries, why[Admission.SWAP_IN])
        plan = relabel(plan, relabels)
        admission = best.admission
        if admission is not Admission.TAIL_REPLAY and swap is not None and plan.resume_tokens:
            admission = Admission.LOWER_RESUME
        self.recovery.acquire(0, plan.replayed_tokens)
        plan = self._measured(plan, hashes, used_vetoes)
        return Admitted(plan=plan, admission=admission, predicted_seconds=predicted, held_replay_tokens=plan.replayed_tokens)

    def _measured(self, plan: ResumePlan, hashes: Sequence[BlockHash], vetoes: Mapping[Form, Reason] | None) -> ResumePlan:
        """The admitted ``plan`` with what its events report besides verdicts: the ghosts
        (:class:`GhostPricer`) and the indexer's sync delay (:func:`with_sync_delay`)."""
        return with_sync_delay(self.ghosts.with_ghosts(plan, hashes, vetoes), hashes, self.form_set.indexer)

    def _run_swap_in(
        self,
        hashes: Sequence[BlockHash],
        prompt_tokens: int,
        output_tokens: int,
        vetoes: Mapping[Form, Reason] | None,
        swap: SwapPlan,
        device: ResumePlan,
        chosen: Candidate,
    ) -> ResumePlan:
        """Bring back every object of ``swap`` as one unit, then plan again on the device (with
        the hash hit the request matched): the plan resumes at the deepest point where every
        form's objects arrived intact; the verdicts are :func:`swapped_verdicts`'."""
        assert self.swap is not None
        result = self.swap.swap_in(hashes, swap, chosen.total_swap_bytes)
        failures, agreement = result.failures, self.agreement
        remote: dict[Form, int] = {}
        if agreement is not None:  # a copy that failed on another rank: this rank says whose
            remote = agreement.remote_failures(failures, [f.form for f in self.form_set.forms])
        after = self.lookup(hashes, prompt_tokens, vetoes, output_tokens=output_tokens, replay=False, hit_tokens=device.hash_hit_tokens)
        if agreement is not None:
            agreement.vetoers |= remote
            failures = dict.fromkeys(remote, Reason.TP_DISAGREE) | dict(failures)
        left: list[Form] = []
        linear = self.form_set.linear
        if linear is not None:  # its reason does not say whether the missing checkpoint was ever taken
            target = min(device.hash_hit_tokens, resume_limit(prompt_tokens, self.form_set.unit_tokens))
            if linear.left_device_between(hashes, swap.plan.form(Form.LINEAR_STATE).usable_tokens, target):
                left.append(Form.LINEAR_STATE)
        plan = swapped_verdicts(after, swap.plan, device, result.moved, failures, self.form_set.missing_reasons(), left)
        return plan if agreement is None else agreement.annotate(plan)

    def prefetch(self, hashes: Sequence[BlockHash], prompt_tokens: int) -> int:
        """Start swapping in, without waiting, what a request with this prompt would need from
        the tiers (:meth:`SwapController.prefetch`). Returns the bytes enqueued (0 when there
        are no tiers, nothing needs a swap-in, the cap refuses it, or the pools have no room)."""
        if self.swap is None:
            return 0
        self.swap.settle()
        device = self.lookup(hashes, prompt_tokens, replay=False)
        swap = self.swap.swap_plan(hashes, prompt_tokens, None, device)
        return 0 if swap is None else self.swap.prefetch(swap)

    def chunks(self, prompt_tokens: int, plan: ResumePlan) -> int:
        """Forward passes a prefill of ``plan`` runs: chunks of at most
        ``max_prefill_chunk_tokens`` that end at its checkpoint positions unless those are taken
        inside chunks (as the engine's prefill)."""
        start = plan.resume_tokens - plan.replayed_tokens
        cap = self.config.max_prefill_chunk_tokens
        inside = self.form_set.checkpoints_inside_chunks
        stops = [] if inside else sorted(p for p in self.form_set.checkpoint_positions(plan) if start < p < prompt_tokens)
        count, at = 0, start
        for stop in [*stops, prompt_tokens]:
            count += -(-(stop - at) // cap)  # full chunks up to the next checkpoint
            at = stop
        return max(count, 1)

    def finish_recovery(self, admitted: Admitted) -> None:
        """Give back the recovery budget a request held while it recovered (Tail-Replay
        tokens are in flight until its prefill ends)."""
        self.recovery.release(0, admitted.held_replay_tokens)
