"""The swap controller: what the host and disk tiers hold of a prefix, and moving it back.

A :class:`SwapController` owns the :class:`~engine.cache.tiers.TierStore` (the tiers copy every
object a device pool evicts down — write-back — through the hooks :func:`open_tiers` attaches),
the swap-ins a prefetch started and the objects they brought back. It plans nothing: the
planner asks it for the deeper resume the tiers allow (:meth:`SwapController.swap_plan`), runs
a chosen one (:meth:`SwapController.swap_in`) and re-plans on the device afterwards.

Ownership of blocks: a swap-in leases what is already on the device first (so its own
allocations cannot evict it, case C8), reserves the tier entries (``SWAPPING_IN``: the tiers
cannot drop them), then allocates device blocks and enqueues the copies on the tiers' reader
threads; a block is never given back while a copy into it may still run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.cache.admission import RecoveryBudget
from engine.cache.block_pool import BlockPool, PoolExhausted
from engine.cache.config import CacheConfig
from engine.cache.coordinator import ResumePlan, plan_resume
from engine.cache.form_set import FormSet
from engine.cache.hashing import BlockHash
from engine.cache.rank_agreement import RankAgreement
from engine.cache.tiers import SwapIn, TierEntry, TierStore, TierView, fingerprint_text
from engine.cache.verdicts import mark_recovered, relabel
from engine.events import ABSENT_REASONS, Form, Outcome, Reason, Tier


def open_tiers(config: CacheConfig, form_set: FormSet) -> TierStore | None:
    """The host and disk tiers of ``config`` attached to every pool of ``form_set`` (with the
    layout fingerprint of every pool tensor), the disk tier's files indexed again; None when
    both tiers are off. The directory is given back if attaching or indexing raises."""
    if not (config.host_tier_bytes or config.disk_tier_bytes):
        return None
    tiers = TierStore(
        host_bytes=config.host_tier_bytes,
        disk_bytes=config.disk_tier_bytes,
        disk_dir=Path(config.disk_tier_dir) if config.disk_tier_dir else None,
        index=form_set.index,
        device=form_set.device,
    )
    try:
        tiers.attach(
            [store for f in form_set.forms for store in f.stores()],
            {name: fingerprint_text(c.layout) for name, c in form_set.contracts.items()},
        )
        tiers.rebuild()
    except BaseException:
        tiers.close()  # gives the directory back
        raise
    return tiers


@dataclass(slots=True)
class SwapPlan:
    """A deeper exact resume that needs swap-ins: the tier-view plan and, per form, the
    entries to bring back."""

    plan: ResumePlan
    entries: dict[Form, list[tuple[BlockPool, TierEntry]]]

    def bytes_by_tier(self) -> dict[Tier, int]:
        out: dict[Tier, int] = {}
        for items in self.entries.values():
            for _, e in items:
                out[e.tier] = out.get(e.tier, 0) + e.nbytes
        return out

    def objects_by_tier(self) -> dict[Tier, int]:
        return dict(Counter(e.tier for items in self.entries.values() for _, e in items))


@dataclass(frozen=True, slots=True)
class SwapResult:
    """What a swap-in brought back: per form served by it the tier (disk if any object came
    from disk), the bytes and the wall seconds; per form whose copy failed, the reason."""

    moved: dict[Form, tuple[Tier, int, float]]
    failures: dict[Form, Reason]


class SwapController:
    """Swap-ins, prefetch and offload between the device pools of ``form_set`` and ``tiers``.

    ``recovery`` is the global cap on recovery in flight (swap-in bytes count against it while
    copies run); ``config.swap_in_wait`` decides whether :meth:`settle` waits for a prefetch.
    """

    def __init__(self, form_set: FormSet, tiers: TierStore, recovery: RecoveryBudget, config: CacheConfig) -> None:
        self.form_set = form_set
        self.tiers = tiers
        self.recovery = recovery
        self.config = config
        self._prefetched: list[SwapIn] = []
        self._restored: dict[tuple[str, BlockHash], tuple[Tier, int, float]] = {}
        self.agreement: RankAgreement | None = None
        """With tensor parallelism: the cross-rank exchanges of the tier-view plan
        (:mod:`engine.cache.rank_agreement`; the planner's own)."""
        self._refused: dict[tuple[str, BlockHash], Reason] = {}
        """(pool, hash) of prefetched copies the tiers refused, with the reason (``epoch_changed``:
        the entry was dropped meanwhile), until a lookup that needed them claims it."""

    # -- the tier view ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _tier_view(self, view: TierView = TierView.READABLE) -> Iterator[None]:
        """Let every pool count the lower-tier objects ``view`` names as present (a swap-in
        away)."""
        pools = list(self.form_set.pools())
        moved = view is not self.tiers.view
        self.tiers.view, self.tiers.version = view, self.tiers.version + moved
        for p in pools:
            p.tier_view = True
        try:
            yield
        finally:
            for p in pools:
                p.tier_view = False
            self.tiers.view, self.tiers.version = TierView.READABLE, self.tiers.version + moved

    def swap_plan(self, hashes: Sequence[BlockHash], prompt_tokens: int, vetoes: Mapping[Form, Reason] | None, device: ResumePlan) -> SwapPlan | None:
        """The exact resume the device and the tiers together allow, with the entries to swap
        in, when it lies deeper than ``device`` (else None).

        Raises:
            RuntimeError: the tier view needs an object no tier holds (an internal invariant).
        """
        if not device.hash_hit_tokens:
            return None
        agreement = self.agreement
        reasons = self.form_set.failure_reasons(vetoes)
        if agreement is not None:  # every rank's shards on its own tiers: the minimum over ranks
            agreement.begin()
            reasons = agreement.vetoes(reasons, [f.form for f in self.form_set.forms])
        forms = self.form_set.resumable(reasons)
        with self._tier_view():
            if agreement is not None:
                forms = agreement.forms(forms, hashes)
            plan = plan_resume(forms, hashes, prompt_tokens, device.hash_hit_tokens, self.form_set.unit_tokens)
            if agreement is not None:
                plan = agreement.annotate(plan)
        if plan.resume_tokens <= device.resume_tokens - device.replayed_tokens:
            return None
        if self.prefetching:  # a form whose lost objects are on their way up says so
            in_flight = self.in_flight_forms(hashes, plan, TierView.READABLE_OR_IN_FLIGHT)
            plan = relabel(plan, in_flight, (Outcome.INVALIDATED, Outcome.REPLAYED))
        entries: dict[Form, list[tuple[BlockPool, TierEntry]]] = {}
        for f in self.form_set.forms:
            for pool, h in f.needed_keys(hashes, plan.resume_tokens):
                if pool.lookup(h) is None:
                    entry = self.tiers.readable(pool.name, h)
                    if entry is None:
                        raise RuntimeError(f"{pool.name}: the tier-view plan needs {h.hex()}, which no tier holds")
                    entries.setdefault(f.form, []).append((pool, entry))
        return SwapPlan(plan, entries)

    # -- swap-in ---------------------------------------------------------------------------------
    def swap_in(self, hashes: Sequence[BlockHash], swap: SwapPlan, nbytes: int) -> SwapResult:
        """Bring back every object of ``swap`` as one unit and wait for the copies; ``nbytes``
        count against the recovery cap meanwhile. A form whose copy failed verification reports
        its reason (``offload_corrupt``, ``layout_mismatch``); one whose blocks the device pools
        cannot take, ``recovery_cap_reached``. Leases and reservations are given back either way."""
        t0 = time.perf_counter()
        tiers = self.tiers
        self.recovery.acquire(nbytes, 0)
        leased: list[tuple[BlockPool, int]] = []
        failures: dict[Form, Reason] = {}
        swaps: list[tuple[Form, SwapIn]] = []
        pending: list[tuple[Form, BlockPool, TierEntry]] = []
        try:
            # lease what is already on the device first, so the swap-ins' allocations cannot
            # evict it (case C8), and reserve the entries so the tiers cannot drop them
            for f in self.form_set.forms:
                for pool, h in f.needed_keys(hashes, swap.plan.resume_tokens):
                    block = pool.lookup(h)
                    if block is not None:
                        pool.lease(block)
                        leased.append((pool, block))
            reserved = [(form, pool, e) for form, items in swap.entries.items() for pool, e in items]
            for _, _, entry in reserved:
                tiers.begin_swap_in(entry)
            pending = list(reserved)
            while pending:
                form, pool, entry = pending[0]
                try:
                    block = pool.allocate()
                except PoolExhausted:  # the device pools cannot take the whole unit
                    failures.setdefault(form, Reason.RECOVERY_CAP_REACHED)
                    break
                leased.append((pool, block))
                swap_in = tiers.copy_in(pool, entry, block)  # may raise: the entry is still pending
                pending.pop(0)
                swaps.append((form, swap_in))
            tiers.release()
            concurrent.futures.wait([s.future for _, s in swaps])
            while swaps:
                form, s = swaps.pop(0)
                reason = tiers.finish_swap_in(s)
                if reason is not None:
                    failures.setdefault(form, reason)
        finally:
            for _, _, entry in pending:  # reserved, never copied: intact
                tiers.cancel_swap_in(entry)
            # never give a block back while a copy into it may still run (an exception above)
            concurrent.futures.wait([s.future for _, s in swaps])
            for _, s in swaps:
                tiers.finish_swap_in(s)
            for pool, block in leased:
                pool.release(block)
            self.recovery.release(nbytes, 0)
        seconds = time.perf_counter() - t0
        moved: dict[Form, tuple[Tier, int, float]] = {}
        for form, items in swap.entries.items():
            if form not in failures:
                found = {e.tier for _, e in items}
                moved[form] = (Tier.DISK if Tier.DISK in found else Tier.HOST, sum(e.nbytes for _, e in items), seconds)
        return SwapResult(moved=moved, failures=failures)

    # -- prefetch --------------------------------------------------------------------------------
    @property
    def prefetching(self) -> bool:
        """Whether swap-ins a prefetch started are not yet committed."""
        return bool(self._prefetched)

    def prefetched_blocks(self) -> Counter[tuple[int, int]]:
        """(id of the pool, block) of every device block a prefetch holds leased."""
        return Counter((id(s.pool), s.block) for s in self._prefetched)

    def in_flight_forms(
        self, hashes: Sequence[BlockHash], plan: ResumePlan, view: TierView = TierView.IN_FLIGHT
    ) -> dict[Form, Reason]:
        """Forms of ``plan`` (a device plan; with ``view`` ``READABLE_OR_IN_FLIGHT``, a tier-view
        plan) that lost tokens (or were replayed) and would serve the point their reason is about
        (``FormLookup.reason_tokens``, the highest lost point where their state was stored) once
        the swap-ins in flight land: every object they lack there is being copied up. Only a form
        whose reason says its state is not on the device (:data:`ABSENT_REASONS`) is relabeled: one
        whose lost points were never stored (``below_granularity``) or that failed validation
        would not resume deeper by waiting, nor one that also lacks an object no copy brings."""
        lost = {
            f.form: f.reason_tokens
            for f in plan.forms
            if f.outcome in (Outcome.INVALIDATED, Outcome.REPLAYED) and f.reason in ABSENT_REASONS and f.reason_tokens
        }
        if not lost:
            return {}
        out: dict[Form, Reason] = {}
        with self._tier_view(view):
            for f in self.form_set.forms:
                if f.form in lost and f.resume_at_most(hashes, lost[f.form]) >= lost[f.form]:
                    out[f.form] = Reason.IN_FLIGHT_SWAP
        return out

    def prefetch(self, swap: SwapPlan) -> int:
        """Start the copies of ``swap`` without waiting (SGLang HiCache-style prefetch). Their
        objects become visible when a later :meth:`settle` commits them; until then they are in
        flight and their bytes count against the recovery cap. Returns the bytes enqueued (0
        when the cap refuses them or the pools have no room)."""
        reserved = [(pool, e) for items in swap.entries.values() for pool, e in items]
        need = Counter(pool.name for pool, _ in reserved)
        nbytes = sum(e.nbytes for _, e in reserved)
        pools = {pool.name: pool for pool, _ in reserved}
        if any(pools[name].num_free < n + 1 for name, n in need.items()) or not self.recovery.admits(nbytes, 0):
            return 0
        # reserve every entry before allocating: an allocation's write-back may make room in
        # the tier, and must not drop what this prefetch is about to read
        for _, entry in reserved:
            self.tiers.begin_swap_in(entry)
        self.recovery.acquire(nbytes, 0)
        started = 0
        try:
            for pool, entry in reserved:
                block = pool.allocate()
                try:
                    self._prefetched.append(self.tiers.copy_in(pool, entry, block))
                except BaseException:
                    pool.release(block)
                    raise
                started += 1
        except BaseException:
            for _, entry in reserved[started:]:  # never copied: intact, and their bytes not in flight
                self.tiers.cancel_swap_in(entry)
                self.recovery.release(entry.nbytes, 0)
            raise
        return nbytes

    def settle(self, *, wait: bool | None = None) -> None:
        """Before a lookup: complete the tiers' finished copies, and the swap-ins a prefetch
        started — waiting for those still in flight when ``wait`` (default:
        ``CacheConfig.swap_in_wait``)."""
        if self._prefetched and (self.config.swap_in_wait if wait is None else wait):
            self.tiers.release()
            concurrent.futures.wait([s.future for s in self._prefetched])
        self._commit_prefetched()
        self.tiers.poll()

    def _commit_prefetched(self) -> None:
        pending = []
        for s in self._prefetched:
            if not s.future.done():
                pending.append(s)
                continue
            refused = self.tiers.finish_swap_in(s)
            self.recovery.release(s.entry.nbytes, 0)
            if refused is not None:
                self._refused[(s.pool.name, s.entry.block_hash)] = refused
                if len(self._refused) > sum(p.num_blocks for p in self.form_set.pools()):
                    self._refused.pop(next(iter(self._refused)))
            if s.published:
                key = (s.pool.name, s.entry.block_hash)
                self._restored[key] = (s.entry.tier, s.entry.nbytes, time.perf_counter() - s.started)
                if len(self._restored) > sum(p.num_blocks for p in self.form_set.pools()):
                    self._restored.pop(next(iter(self._restored)))
            s.pool.release(s.block)
        self._prefetched = pending

    def claim_restored(self, hashes: Sequence[BlockHash], plan: ResumePlan) -> ResumePlan:
        """Forms whose objects at L* a prefetch brought back report ``recovered`` (once)."""
        if not self._restored or not plan.resume_tokens:
            return plan
        resume = plan.resume_tokens - plan.replayed_tokens
        found: dict[Form, tuple[Tier, int, float]] = {}
        for f in self.form_set.forms:
            for pool, h in f.needed_keys(hashes, resume):
                got = self._restored.pop((pool.name, h), None)
                if got is not None:
                    tier, b, sec = found.get(f.form, (Tier.HOST, 0, 0.0))
                    found[f.form] = (Tier.DISK if Tier.DISK in (tier, got[0]) else Tier.HOST, b + got[1], max(sec, got[2]))
        if not found:
            return plan
        missing = self.form_set.missing_reasons()
        prior = tuple(dataclasses.replace(f, reason=missing[f.form]) for f in plan.forms)
        return mark_recovered(plan, dataclasses.replace(plan, forms=prior), found, missing)

    def claim_refused(self, hashes: Sequence[BlockHash], plan: ResumePlan) -> dict[Form, Reason]:
        """Forms of ``plan`` that lost tokens because an object they lack at the first point they
        lost (usable + U) is one a prefetch's copy of was refused, with the refusal's reason
        (once each) — what the lookup reports instead of the device's ``kv_evicted``-like one."""
        if not self._refused:
            return {}
        u = self.form_set.unit_tokens
        lost = {f.form: f.usable_tokens + u for f in plan.forms if f.outcome is Outcome.INVALIDATED and f.usable_tokens + u <= plan.hash_hit_tokens}
        out: dict[Form, Reason] = {}
        for f in self.form_set.forms:
            if f.form not in lost:
                continue
            for pool, h in f.needed_keys(hashes, lost[f.form]):
                reason = self._refused.pop((pool.name, h), None) if pool.lookup(h) is None else None
                if reason is not None:
                    out.setdefault(f.form, reason)
        return out

    # -- offload ---------------------------------------------------------------------------------
    def offload_all(self, tier: Tier, *, evict: bool = True) -> int:
        """Copy every cached device object to ``tier`` and wait for the copies; with ``evict``
        the device copies of the objects the tier holds are then dropped (what memory pressure
        would do, at once). Objects leased by running requests stay. Returns how many of the
        copied objects the tier holds afterwards (fewer when it is smaller than the data).

        Raises:
            ValueError: ``tier`` is the device, or is off.
        """
        check_offload_tier(self.tiers, tier)
        moved: list[tuple[BlockPool, int]] = []
        for pool in self.form_set.pools():
            for h, block in list(pool.cached_blocks.items()):
                if pool.ref_count[block] == 0 and self.tiers.offload_now(pool, block, h, tier):
                    moved.append((pool, block))
        self.tiers.flush()
        held = 0
        for pool, block in moved:
            key = pool.block_hash[block]
            if key is not None and self.tiers.readable(pool.name, key) is not None:
                held += 1  # (a tier smaller than the data keeps only the last objects)
                if evict:
                    pool.evict(block)
        return held


def check_offload_tier(tiers: TierStore | None, tier: Tier) -> None:
    """Raise ValueError unless objects can be offloaded to ``tier`` (host or disk, switched on)."""
    if tier is Tier.DEVICE:
        raise ValueError("offload copies objects down to the host or disk tier, not to the device")
    if tiers is None or not tiers.capacity[tier]:
        raise ValueError(f"the {tier} tier is off (set CacheConfig.{tier}_tier_bytes)")
