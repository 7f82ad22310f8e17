"""The prefix cache of one model: its forms, the prefix index, lookup and the start of a request.

This is the object the engine talks to:

* :meth:`PrefixCache.block_hashes` — the prompt's hash chain (computed once per request);
* :meth:`PrefixCache.lookup` — the hash hit, then L* and every form's verdict;
* :meth:`PrefixCache.start` — lease what the plan reuses, then hand back a
  :class:`~engine.cache.sequence.PagedSequence` that allocates as the request runs;
* :meth:`PrefixCache.check_invariants` — pools, free queues and prefix index agree.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import time
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cache.admission import Candidate, CostModel, RecoveryBudget, choose, price
from engine.cache.block_pool import SENTINEL_BLOCK, BlockPool, PoolExhausted
from engine.cache.compressed import (
    MAIN,
    CompressedKVForm,
    EntryPages,
    IndexerStateForm,
    UncompressedTailForm,
    restore_states,
)
from engine.cache.config import CacheConfig
from engine.cache.coordinator import (
    FormLookup,
    ResumableForm,
    ResumePlan,
    plan_resume,
    resume_limit,
)
from engine.cache.forms import KERNEL_ABI, LinearCheckpointForm, PagedKVForm
from engine.cache.hashing import BlockHash, PrefixIndex, chain_hashes, root_hash
from engine.cache.memory_plan import POOL_FIELDS, MemoryPlan, PoolPlan, headroom, sized_config
from engine.cache.sequence import PagedSequence
from engine.cache.tiers import SwapIn, TierEntry, TierStore, fingerprint_text
from engine.cache.validation import (
    KernelContract,
    LayoutFingerprint,
    ValidationFailure,
    check_alignment,
    check_granularity,
    check_kernel_contract,
)
from engine.events import Admission, Form, Outcome, Reason, Tier
from engine.faults import NO_FAULTS, Faults
from engine.model.base import ModelLayout
from engine.model.state import CompressedLayerState, LinearLayerState

log = logging.getLogger(__name__)

CacheForm = PagedKVForm | CompressedKVForm | UncompressedTailForm | IndexerStateForm | LinearCheckpointForm


@dataclass(frozen=True, slots=True, kw_only=True)
class FormOccupancy:
    """One form's pool: blocks holding state (leased by running requests or cached), of which
    leased and cached (published), and blocks an allocation could take (empty or evictable)."""

    form: Form
    tier: Tier
    used_blocks: int
    leased_blocks: int
    cached_blocks: int
    free_blocks: int
    total_blocks: int
    bytes_per_block: int

    used_bytes: int
    """Bytes of the blocks holding state, summed pool by pool."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FormSpec:
    """What one form stores and where it can resume.

    granularity_tokens: the coarsest spacing (tokens) between positions it can resume at.
    bytes_per_block: bytes of one block of each of its pools together.
    fingerprints: (pool tensor name, layout fingerprint: dtype, block shape, axis order, kernel
        ABI version, model revision) of every tensor it stores.
    """

    form: Form
    granularity_tokens: int
    bytes_per_block: int
    fingerprints: tuple[tuple[str, LayoutFingerprint], ...]


@dataclass(frozen=True, slots=True)
class _Vetoed:
    """A form whose stored objects failed validation, or changed between a lookup and its
    leases: it can resume nowhere but at 0."""

    form: Form
    reason: Reason

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        return 0

    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int) -> Reason:
        return self.reason


class StaleResume(Exception):
    """An object a plan relies on changed between the lookup and its lease (the TOCTOU window
    of DESIGN.md §4 red line 3). The caller looks up again with the form vetoed
    (``epoch_changed``): the request degrades to recompute instead of reading a changed object."""

    def __init__(self, form: Form) -> None:
        super().__init__(f"{form}: an object of the plan changed before its lease")
        self.form = form


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """What admission decided for one request: the plan to start (device view, after any
    swap-in), the path, its predicted seconds, and the recovery budget it holds until its
    prefill ends (release it with :meth:`PrefixCache.finish_recovery`)."""

    plan: ResumePlan
    admission: Admission
    predicted_seconds: float
    held_replay_tokens: int = 0


@dataclass(slots=True)
class _SwapPlan:
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


class PrefixCache:
    """Every cache form of one model, sized by a :class:`CacheConfig`.

    Args:
        layout: the layers the forms serve (:meth:`CausalLM.layout`).
        config: pool sizes and policies.
        model_name: part of the hash root (with the layout's revision), so two models never
            share a prefix.
        device, dtype: where the KV pools live and their element type.
    """

    def __init__(
        self,
        layout: ModelLayout,
        config: CacheConfig,
        model_name: str,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.layout = layout
        self.faults: Faults = NO_FAULTS
        """Injected faults (engine/faults.py); none unless a test or config enables them."""
        self.budget: tuple[int, int] | None = None
        """(budget bytes, capacity tokens) when the pools came from a memory plan."""
        self.unit_tokens = config.unit_tokens
        self.device = device
        self.index = PrefixIndex()
        self.root = root_hash(model_name, layout.revision, config.unit_tokens)
        self.kv_forms: list[PagedKVForm] = []
        self.kv_form_of_layer: dict[int, PagedKVForm] = {}
        kv_shapes = {i: layout.kv_shape(i) for i in range(len(layout.layer_types))}
        for form, layers, blocks, window in (
            (Form.FULL_KV, layout.layers_of("full_attention"), config.full_kv_blocks, None),
            (Form.SWA_WINDOW, layout.window_layers, config.swa_blocks, layout.sliding_window),
        ):
            if not layers:
                continue
            kv_form = PagedKVForm(
                form, layers, blocks, config.unit_tokens, kv_shapes, window, self.index, dtype, device
            )
            self.kv_forms.append(kv_form)
            self.kv_form_of_layer.update(dict.fromkeys(layers, kv_form))
        self.linear: LinearCheckpointForm | None = None
        linear_layers = layout.layers_of("linear_attention")
        if linear_layers:
            conv_shape, rec_shape = layout.linear_state_shapes[linear_layers[0]]
            slots = 2 if config.tail_replay == "only" else config.linear_checkpoints  # only the sentinel and one slot
            self.linear = LinearCheckpointForm(
                linear_layers, slots, config.unit_tokens, conv_shape, rec_shape, self.index, device
            )
        self.compressed_specs = dict(layout.compressed_state_specs)
        self.compressed: CompressedKVForm | None = None
        self.tail: UncompressedTailForm | None = None
        self.indexer: IndexerStateForm | None = None
        if self.compressed_specs:
            specs, u = self.compressed_specs, config.unit_tokens
            self.compressed = CompressedKVForm(specs, config.compressed_blocks, u, self.index, device)
            self.tail = UncompressedTailForm(specs, config.tail_slots, u, self.index, device)
            if any(spec.indexer is not None for spec in specs.values()):
                self.indexer = IndexerStateForm(specs, config.compressed_blocks, config.tail_slots, u, self.index, device)
        forms: list[CacheForm] = list(self.kv_forms)
        forms += [f for f in (self.compressed, self.tail, self.indexer, self.linear) if f is not None]
        self.forms: tuple[CacheForm, ...] = tuple(forms)
        self._bytes_per_block: dict[int, float] | None = None  # id(pool) → its form's bytes per block of it (ghosts, spares)
        self.stored_revision = layout.revision
        """The weights every stored object was computed with (a stamp of the writer)."""
        self.stored_kernel_abi = KERNEL_ABI
        """The reader interface the stored objects were written for."""
        self.contracts = {
            t.name: KernelContract(
                layout=LayoutFingerprint.of(t.tensor, axis_order=t.axis_order, kernel_abi=KERNEL_ABI, model_revision=layout.revision),
                vector_bytes=t.vector_bytes,
            )
            for f in self.forms
            for t in f.stored_tensors()
        }
        """What the readers of each pool tensor were built for (this model's layout)."""
        self._reported: set[str] = set()
        self._validated: tuple[tuple[object, ...], dict[Form, ValidationFailure]] | None = None
        self.running: weakref.WeakSet[PagedSequence] = weakref.WeakSet()
        """Requests started and not finished (for the ownership check of check_invariants)."""
        tails = [f.slots for f in (self.tail, self.indexer) if f is not None]
        self._needs_checkpoints = self.linear is not None or any(t.keeps_rows for t in tails)
        self.recovery = RecoveryBudget(config.max_recovery_bytes, config.max_replay_tokens)
        """The global cap on recovery work in flight (DESIGN.md §4, red line 1)."""
        self.tiers: TierStore | None = None
        """The host and disk tiers (None when both are off)."""
        self._prefetched: list[SwapIn] = []
        self._restored: dict[tuple[str, BlockHash], tuple[Tier, int, float]] = {}
        if config.host_tier_bytes or config.disk_tier_bytes:
            self.tiers = TierStore(
                host_bytes=config.host_tier_bytes,
                disk_bytes=config.disk_tier_bytes,
                disk_dir=Path(config.disk_tier_dir) if config.disk_tier_dir else None,
                index=self.index,
                device=device,
            )
            try:
                self.tiers.attach(
                    [store for f in self.forms for store in f.stores()],
                    {name: fingerprint_text(c.layout) for name, c in self.contracts.items()},
                )
                self.tiers.rebuild()
            except BaseException:
                self.tiers.close()  # gives the directory back
                raise

    @property
    def has_checkpoint_forms(self) -> bool:
        """Whether some form resumes only at stored checkpoints (recurrent state, or rows of a
        compressor's tail or indexer): then resume points are the checkpoint positions, not
        every U boundary."""
        return self._needs_checkpoints

    # -- reporting -----------------------------------------------------------------------------
    def resume_granularity(self) -> dict[Form, int]:
        """The coarsest spacing (tokens) between positions each form can resume at."""
        out = {f.form: self.unit_tokens for f in self.kv_forms}
        if Form.SWA_WINDOW in out and self.has_checkpoint_forms:  # windows kept behind checkpoints
            out[Form.SWA_WINDOW] = self.config.checkpoint_interval_tokens
        if self.compressed is not None:
            out[Form.COMPRESSED_KV] = self.unit_tokens  # entries of whole groups are immutable
        interval = self.config.checkpoint_interval_tokens if self.has_checkpoint_forms else self.unit_tokens
        for f in (self.tail, self.indexer):
            if f is not None:
                out[f.form] = interval if f.slots.keeps_rows else self.unit_tokens
        if self.linear is not None:
            out[Form.LINEAR_STATE] = self.config.checkpoint_interval_tokens
        return out

    @classmethod
    def planned(cls, layout: ModelLayout, config: CacheConfig, model_name: str, device: torch.device, dtype: torch.dtype) -> PrefixCache:
        """A cache whose pools come from ``config.memory_bytes`` when it is set (one memory plan
        for every form), else from the config's block counts.

        Raises:
            ValueError: the budget cannot hold the headroom of every pool.
        """
        if config.memory_bytes is None:
            return cls(layout, config, model_name, device, dtype)
        probe_sizes: dict[str, object] = dict.fromkeys(POOL_FIELDS, 2)
        probe_sizes |= {"memory_bytes": None, "host_tier_bytes": 0, "disk_tier_bytes": 0}
        probe_config = CacheConfig(**{**dataclasses.asdict(config), **probe_sizes})
        probe = cls(layout, probe_config, model_name, device, dtype)
        sized, tokens = sized_config(config, probe.pool_plans())
        cache = cls(layout, sized, model_name, device, dtype)
        cache.budget = (config.memory_bytes, tokens)
        return cache

    def pool_entries(self) -> list[tuple[Form, BlockPool, str, int, int]]:
        """Every pool once: (form, pool, the CacheConfig field that sizes it, bytes per block,
        prefix tokens one block covers — 0 for per-boundary slots, which summarise a prefix)."""
        u = self.unit_tokens
        out: list[tuple[Form, BlockPool, str, int, int]] = [
            (f.form, f.pool, "full_kv_blocks" if f.window is None else "swa_blocks", f.bytes_per_block, u)
            for f in self.kv_forms
        ]
        for pages in self.entry_groups():
            form = Form.COMPRESSED_KV if pages.group.which == MAIN else Form.INDEXER_STATE
            out.append((form, pages.pool, "compressed_blocks", pages.bytes_per_block, pages.page_tokens))
        for f in (self.tail, self.indexer):
            if f is not None:
                out.append((f.form, f.slots.pool, "tail_slots", f.slots.bytes_per_block, 0))
        if self.linear is not None:
            out.append((Form.LINEAR_STATE, self.linear.pool, "linear_checkpoints", self.linear.bytes_per_block, 0))
        return out

    def pool_plans(self) -> list[PoolPlan]:
        """Every pool with its bytes per block, the prefix tokens one block holds (a slot: one
        per checkpoint interval; a window page: its share of the windows kept behind cached
        boundaries) and its headroom (see :mod:`engine.cache.memory_plan`)."""
        c, u = self.config, self.unit_tokens
        interval = c.checkpoint_interval_tokens if self.has_checkpoint_forms else u
        window = self.layout.sliding_window
        window_pages = self.window_pages_needed(window, 0) if window is not None else 0
        out: list[PoolPlan] = []
        for form, pool, field, bytes_per_block, page_tokens in self.pool_entries():
            tokens = page_tokens
            if field == "linear_checkpoints":
                tokens = c.checkpoint_interval_tokens
            elif field == "tail_slots":
                tokens = interval
            elif field == "swa_blocks" and window is not None and self.has_checkpoint_forms:
                # a cached boundary keeps the pages of its window; windows wider than the
                # interval overlap, so the pool then keeps every page of the prefix
                tail_pages = -(-(window - 1) // u) + 1
                tokens = interval // min(interval // u, tail_pages)
            out.append(
                PoolPlan(
                    name=pool.name,
                    form=form,
                    config_field=field,
                    blocks=pool.num_blocks - 1,
                    bytes_per_block=bytes_per_block,
                    tokens_per_block=max(1, tokens),
                    headroom_blocks=headroom(field, window_pages),
                )
            )
        return out

    def form_specs(self) -> dict[Form, FormSpec]:
        """One frozen spec per form: its resume granularity, bytes per block set and the layout
        fingerprint of every stored tensor (what validation layer 2 compares)."""
        granularity = self.resume_granularity()
        return {
            f.form: FormSpec(
                form=f.form,
                granularity_tokens=granularity[f.form],
                bytes_per_block=f.bytes_per_block,
                fingerprints=tuple((t.name, self.contracts[t.name].layout) for t in f.stored_tensors()),
            )
            for f in self.forms
        }

    def tail_replay_savings_bytes(self) -> int:
        """In Tail-Replay-only mode, the bytes the ``linear_state`` checkpoints would take
        (``CacheConfig.linear_checkpoints`` slots) and are not allocated; else 0."""
        if self.linear is None or self.config.tail_replay != "only":
            return 0
        return (self.config.linear_checkpoints - self.linear.pool.num_blocks) * self.linear.bytes_per_block

    def limit_cached(self, form: Form, max_cached_blocks: int | None) -> int:
        """Cap the evictable pages the paged pool of ``form`` (``full_kv`` or ``swa_window``) keeps
        cached (None lifts the cap): :meth:`BlockPool.limit_cached`. Returns the pages evicted now.

        Raises:
            ValueError: the model has no paged pool for ``form``, or a negative cap.
        """
        pools = [f.pool for f in self.kv_forms if f.form is form]
        if not pools:
            raise ValueError(f"this model has no paged {form} pool (it has: {', '.join(f.form for f in self.kv_forms) or 'none'})")
        return sum(pool.limit_cached(max_cached_blocks) for pool in pools)

    def memory_plan(self) -> MemoryPlan:
        budget, tokens = self.budget if self.budget is not None else (None, 0)
        pools = self.pool_plans()
        if budget is None:  # capacity implied by the explicit block counts
            tokens = min((p.blocks - p.headroom_blocks) * p.tokens_per_block for p in pools) if pools else 0
        return MemoryPlan(pools=tuple(pools), granularity=self.resume_granularity(), budget_bytes=budget, capacity_tokens=max(0, tokens))

    def log_plan(self) -> None:
        """Log the memory plan (every pool's blocks, headroom and bytes) and the effective resume
        granularity per form; warn when a form resumes more coarsely than 8·U (case C4)."""
        log.info("%s", self.memory_plan().render())
        saved = self.tail_replay_savings_bytes()
        if saved:
            log.info("Tail-Replay only: linear_state stores no recurrent checkpoints, saving %.1f MiB", saved / 2**20)
        for form, spacing in self.resume_granularity().items():
            if spacing > 8 * self.unit_tokens:
                log.warning("cache form %s resumes only every %d tokens (> 8·U, U = %d)", form, spacing, self.unit_tokens)

    def tier_occupancy(self) -> list[FormOccupancy]:
        """Per (form, lower tier) holding anything: its objects (all cached, none leased) and
        their bytes."""
        if self.tiers is None:
            return []
        form_of = {pool.name: form for form, pool, *_ in self.pool_entries()}
        totals: Counter[tuple[Form, Tier]] = Counter()
        sizes: Counter[tuple[Form, Tier]] = Counter()
        for entry in self.tiers.entries.values():
            key = (form_of[entry.pool], entry.tier)
            totals[key] += 1
            sizes[key] += entry.nbytes
        return [
            FormOccupancy(
                form=form,
                tier=tier,
                used_blocks=n,
                leased_blocks=0,
                cached_blocks=n,
                free_blocks=0,
                total_blocks=n,
                bytes_per_block=sizes[form, tier] // n,
                used_bytes=sizes[form, tier],
            )
            for (form, tier), n in sorted(totals.items())
        ]

    def occupancy(self) -> list[FormOccupancy]:
        """Per form on the device: the block counts of its fullest pool (a form with several
        pools — compressor geometries, indexer keys and pending rows — runs out when that one
        does; counts of different pools are never mixed) and the bytes of all its pools."""
        per_pool = {p.name: p.bytes_per_block for p in self.pool_plans()}
        out = []
        for f in self.forms:
            fullest = max(f.pools, key=lambda p: (p.num_holding / max(p.num_blocks - 1, 1), p.num_blocks))
            out.append(
                FormOccupancy(
                    form=f.form,
                    tier=Tier.DEVICE,
                    used_blocks=fullest.num_holding,
                    leased_blocks=fullest.num_leased,
                    cached_blocks=fullest.num_cached,
                    free_blocks=fullest.num_free,
                    total_blocks=fullest.num_blocks - 1,
                    bytes_per_block=f.bytes_per_block,
                    used_bytes=sum(p.num_holding * per_pool[p.name] for p in f.pools),
                )
            )
        return out

    # -- lookup --------------------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        return chain_hashes(self.root, token_ids, self.unit_tokens)

    def lookup(
        self,
        hashes: Sequence[BlockHash],
        prompt_tokens: int,
        vetoes: Mapping[Form, Reason] | None = None,
        *,
        output_tokens: int = 0,
        replay: bool = True,
    ) -> ResumePlan:
        """The hash hit and the resume plan; takes no lease and changes nothing.

        The four validation layers (DESIGN.md §4): granularity and group intersection are part
        of each form's resume rule; a form whose stored tensors break the reading kernel's
        contract (layer 2) or alignment (layer 4) cannot resume anywhere and reports that
        reason. ``vetoes`` names forms that must not be used (with the reason they report).
        Objects only a lower tier holds count for the hash hit but not for L* (see
        :meth:`admit`, which prices swapping them in). ``replay=False`` leaves Tail-Replay out.
        Raises RuntimeError if L* itself is not a multiple of U (an internal invariant).
        """
        hit = self.index.hit_blocks(hashes) * self.unit_tokens if self.config.enable_prefix_caching else 0
        reasons = {form: failure.reason for form, failure in (self.validation_failures() if hit else {}).items()}
        reasons |= dict(vetoes or {})
        forms = [_Vetoed(f.form, reasons[f.form]) if f.form in reasons else f for f in self.forms]
        plan = plan_resume(forms, hashes, prompt_tokens, hit, self.unit_tokens)
        if replay and self.config.tail_replay != "off" and self.linear is not None and hit and Form.LINEAR_STATE not in reasons:
            plan = self._tail_replay(plan, forms, hashes, prompt_tokens + output_tokens, hit)
        plan = dataclasses.replace(plan, pool_versions=tuple((f.form, tuple(p.version for p in f.pools)) for f in self.forms))
        if self._prefetched:  # objects on their way up: the forms that need them say so
            plan = _relabel(plan, self._in_flight_forms(hashes, min(hit, resume_limit(prompt_tokens, self.unit_tokens))))
        failure = check_granularity(plan.resume_tokens, self.unit_tokens)
        if failure is not None:
            raise RuntimeError(f"resume point {plan.resume_tokens} fails validation: {failure}")
        return plan

    GHOST_CANDIDATES = 64
    """Resume points (every U tokens down from the target) a form's ghost search tries at most."""

    def _with_ghosts(self, plan: ResumePlan, hashes: Sequence[BlockHash], vetoes: Mapping[Form, Reason] | None) -> ResumePlan:
        """The admitted plan with, for the telemetry's Capacity what-if (run once per request,
        on the plan :meth:`admit` returns, not on every candidate :meth:`lookup` makes): each form that could resume gets how much less device memory would still have served
        that resume (``FormLookup.spare_bytes``, :meth:`_spare`); each form that lost tokens, the
        resume point it would have had with more device memory and how much more
        (``FormLookup.ghost_tokens`` / ``ghost_bytes``): the highest
        point ≤ ``target`` whose every needed object is cached or was evicted recently, costing the
        largest over the pools of the deepest such eviction (:meth:`BlockPool.ghost_depth`) in
        form bytes (a form's memory grows over its pools in proportion to their size: one block
        of a pool stands for the form's bytes over the pool's blocks). A vetoed form (a validation failure) gets none: memory would not help."""
        if not plan.hash_hit_tokens:
            return plan
        target = min(plan.hash_hit_tokens, resume_limit(plan.prompt_tokens, self.unit_tokens))
        vetoed = set(self.validation_failures()) | set(vetoes or {})  # memory would not help these
        if self._bytes_per_block is None:
            # a form's memory is taken to grow or shrink over its pools in proportion to their
            # size, so one block of a pool stands for form bytes / the pool's blocks
            entries = self.pool_entries()
            form_bytes: Counter[Form] = Counter()
            for form_of, pool, _, size, _ in entries:
                form_bytes[form_of] += pool.num_blocks * size
            self._bytes_per_block = {id(pool): form_bytes[form_of] / pool.num_blocks for form_of, pool, _, _, _ in entries}
        by_form = {f.form: f for f in self.forms}
        forms = []
        for lookup in plan.forms:
            form = by_form[lookup.form]
            if lookup.form in vetoed:
                forms.append(lookup)
                continue
            if lookup.usable_tokens > 0:
                lookup = dataclasses.replace(lookup, spare_bytes=self._spare(form, hashes, lookup.usable_tokens))
            if lookup.usable_tokens < target:
                ghost = self._ghost(form, hashes, target, lookup.usable_tokens)
                if ghost is not None:
                    lookup = dataclasses.replace(lookup, ghost_tokens=ghost[0], ghost_bytes=ghost[1])
            forms.append(lookup)
        return dataclasses.replace(plan, forms=tuple(forms))

    def _spare(self, form: CacheForm, hashes: Sequence[BlockHash], usable: int) -> int:
        """The device memory ``form`` could lose and still hold every object a resume at
        ``usable`` reads: per pool, the fewest spare blocks among those objects
        (:meth:`BlockPool.spare_blocks`) in form bytes (a form's memory shrinks over its pools in
        proportion to their size); the smallest over the pools."""
        assert self._bytes_per_block is not None
        needed: dict[int, tuple[BlockPool, list[BlockHash]]] = {}
        for pool, h in form.needed_keys(hashes, usable):
            needed.setdefault(id(pool), (pool, []))[1].append(h)
        spare = [
            blocks * self._bytes_per_block[key]
            for key, (pool, keys) in needed.items()
            if (blocks := pool.spare_blocks(keys)) is not None
        ]
        if not spare:  # read from nothing on the device (e.g. swapped in): no device memory at stake
            return round(max(pool.num_blocks * self._bytes_per_block[id(pool)] for pool in form.pools))
        return round(min(spare))

    def _ghost(self, form: CacheForm, hashes: Sequence[BlockHash], target: int, usable: int) -> tuple[int, int] | None:
        u = self.unit_tokens
        assert self._bytes_per_block is not None
        for cand in range(target, usable, -u)[: self.GHOST_CANDIDATES]:
            deepest: dict[int, int] = {}
            for pool, h in form.needed_keys(hashes, cand):
                if pool.present(h):
                    continue
                depth = pool.ghost_depth(h)
                if depth is None:
                    break
                deepest[id(pool)] = max(deepest.get(id(pool), 0), depth)
            else:
                if not deepest:  # everything there, yet the form could not resume: memory is not why
                    return None
                return cand, max(1, round(max(n * self._bytes_per_block[pool] for pool, n in deepest.items())))
        return None

    def _tail_replay(
        self, exact: ResumePlan, forms: Sequence[ResumableForm], hashes: Sequence[BlockHash], total_tokens: int, hit: int
    ) -> ResumePlan:
        """The Tail-Replay plan when it resumes further than ``exact``, else ``exact``.

        L = the point every form but ``linear_state`` agrees on; R = ``replay_fraction``·L
        rounded up to U and clamped to [``replay_min_tokens``, ``replay_max_tokens``]; the other
        forms must resume exactly at L − R too (computation starts there, the linear layers
        from a zero state). Mode ``fallback``: only when L − R > the exact L* (no exact
        checkpoint within the budget); ``on`` / ``only``: whenever L > the exact L* and L − R > 0.
        (Tail-Replay paper, 2026;
        DESIGN.md §4.)
        """
        c, u = self.config, self.unit_tokens
        others = [f for f in forms if f.form != Form.LINEAR_STATE]
        if not others:  # a linear-only model has nothing else to resume on
            return exact
        prompt_tokens = exact.prompt_tokens
        alt = plan_resume(others, hashes, prompt_tokens, hit, u)
        point = alt.resume_tokens
        low = -(-c.replay_min_tokens // u) * u
        high = max(u, c.replay_max_tokens - c.replay_max_tokens % u)
        replay = min(max(-(-math.ceil(c.replay_fraction * point) // u) * u, low), high)  # multiples of U
        start = point - replay
        if point <= exact.resume_tokens or start <= 0 or any(f.resume_at_most(hashes, start) != start for f in others):
            return exact
        if c.tail_replay == "fallback" and start <= exact.resume_tokens:
            return exact  # an exact checkpoint lies within the replay budget
        # the replayed rows go to new pages while the matched ones stay pinned: R/U pages more
        # than the request would hold otherwise; refuse rather than exhaust the full-KV pool
        full = [f for f in self.kv_forms if f.window is None]
        if full and -(-total_tokens // u) + replay // u > full[0].pool.num_blocks - 1:
            return exact
        for f in self.kv_forms:  # a window form also keeps its pinned window next to the working set
            if f.window is not None:
                pinned = len(f.needed_pages(point))
                if pinned + self.window_pages_needed(f.window, total_tokens - prompt_tokens) > f.pool.num_blocks - 1:
                    return exact
        linear = exact.form(Form.LINEAR_STATE)
        replayed = FormLookup(
            form=Form.LINEAR_STATE,
            outcome=Outcome.REPLAYED,
            reason=linear.reason if linear.reason != Reason.NONE else Reason.LINEAR_CHECKPOINT_MISSING,
            usable_tokens=linear.usable_tokens,
            recoverable_tokens=0,  # no stored linear state was reused
            replayed_tokens=replay,
        )
        verdicts = sorted([*alt.forms, replayed], key=lambda f: list(Form).index(f.form))
        plan = dataclasses.replace(alt, forms=tuple(verdicts), replayed_tokens=replay)
        if plan.limiting_form is None:  # what keeps recoverable below L: the replayed form
            plan = dataclasses.replace(plan, limiting_form=Form.LINEAR_STATE, limiting_reason=replayed.reason)
        return plan

    # -- tiers and admission -------------------------------------------------------------------
    @contextlib.contextmanager
    def _tier_view(self) -> Iterator[None]:
        """Let every pool count objects the lower tiers hold as present (a swap-in away)."""
        pools = [p for f in self.forms for p in f.pools]
        for p in pools:
            p.tier_view = True
        try:
            yield
        finally:
            for p in pools:
                p.tier_view = False

    def _swap_plan(self, hashes: Sequence[BlockHash], prompt_tokens: int, vetoes: Mapping[Form, Reason] | None, device: ResumePlan) -> _SwapPlan | None:
        """The exact resume the device and the tiers together allow, with the entries to swap
        in, when it lies deeper than ``device`` (else None)."""
        if self.tiers is None or not device.hash_hit_tokens:
            return None
        reasons = {form: failure.reason for form, failure in self.validation_failures().items()} | dict(vetoes or {})
        forms = [_Vetoed(f.form, reasons[f.form]) if f.form in reasons else f for f in self.forms]
        with self._tier_view():
            plan = plan_resume(forms, hashes, prompt_tokens, device.hash_hit_tokens, self.unit_tokens)
        if plan.resume_tokens <= device.resume_tokens - device.replayed_tokens:
            return None
        entries: dict[Form, list[tuple[BlockPool, TierEntry]]] = {}
        for f in self.forms:
            for pool, h in f.needed_keys(hashes, plan.resume_tokens):
                if pool.lookup(h) is None:
                    entry = self.tiers.readable(pool.name, h)
                    if entry is None:
                        raise RuntimeError(f"{pool.name}: the tier-view plan needs {h.hex()}, which no tier holds")
                    entries.setdefault(f.form, []).append((pool, entry))
        return _SwapPlan(plan, entries)

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
        tiers' reader threads, waited for) and the plan is then made again on the device, so a copy that
        fails verification lowers L* with its reason (``offload_corrupt``, ``layout_mismatch``)
        instead of feeding wrong bytes. A form a rejected deeper plan would have recovered
        reports ``admission_recompute_cheaper`` or ``recovery_cap_reached``.

        Raises:
            RuntimeError: an internal invariant (a planned object vanished).
        """
        self.settle()
        device = self.lookup(hashes, prompt_tokens, vetoes, output_tokens=output_tokens)
        device = self._claim_restored(hashes, device)
        swap = self._swap_plan(hashes, prompt_tokens, vetoes, device)
        exact = device if not device.replayed_tokens else self.lookup(hashes, prompt_tokens, vetoes, output_tokens=output_tokens, replay=False)
        model = costs or CostModel(seconds_per_token=1.0)  # without measured costs: the deepest resume wins
        start = device.resume_tokens - device.replayed_tokens
        kind = Admission.TAIL_REPLAY if device.replayed_tokens else (Admission.EXACT if device.resume_tokens else Admission.COLD)
        if kind is Admission.EXACT and any(f.outcome is Outcome.RECOVERED for f in device.forms):
            kind = Admission.SWAP_IN  # a prefetch brought its objects back
        chunks = functools.partial(self._chunks, prompt_tokens)
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
        predicted = best.predicted_seconds if costs is not None else 0.0
        why = {c.admission: Reason.RECOVERY_CAP_REACHED if how == "cap" else Reason.ADMISSION_RECOMPUTE_CHEAPER for c, how in rejected}

        if best is swap_option and swap is not None:
            plan = self._run_swap_in(hashes, prompt_tokens, output_tokens, vetoes, swap, device, best)
            return Admitted(plan=self._with_ghosts(plan, hashes, vetoes), admission=Admission.SWAP_IN, predicted_seconds=predicted)
        chosen = next(p for c, p in options if c is best)
        used_vetoes = vetoes
        if chosen is None:  # cold: nothing reused
            used_vetoes = cold = dict.fromkeys((f.form for f in self.forms), Reason.ADMISSION_RECOMPUTE_CHEAPER)
            chosen = self.lookup(hashes, prompt_tokens, cold, output_tokens=output_tokens, replay=False)
        plan = chosen
        relabel: dict[Form, Reason] = {}
        if device.replayed_tokens and plan is not device and Admission.TAIL_REPLAY in why:
            relabel[Form.LINEAR_STATE] = why[Admission.TAIL_REPLAY]
        if swap is not None and Admission.SWAP_IN in why:
            relabel |= dict.fromkeys(swap.entries, why[Admission.SWAP_IN])
        plan = _relabel(plan, relabel)
        admission = best.admission
        if admission is not Admission.TAIL_REPLAY and swap is not None and plan.resume_tokens:
            admission = Admission.LOWER_RESUME
        self.recovery.acquire(0, plan.replayed_tokens)
        plan = self._with_ghosts(plan, hashes, used_vetoes)
        return Admitted(plan=plan, admission=admission, predicted_seconds=predicted, held_replay_tokens=plan.replayed_tokens)

    def _chunks(self, prompt_tokens: int, plan: ResumePlan) -> int:
        """Forward passes a prefill of ``plan`` runs: chunks of at most
        ``max_prefill_chunk_tokens`` that end at its checkpoint positions (as ``LLM._prefill``)."""
        start = plan.resume_tokens - plan.replayed_tokens
        cap = self.config.max_prefill_chunk_tokens
        stops = sorted(p for p in self.checkpoint_positions(plan) if start < p < prompt_tokens)
        count, at = 0, start
        for stop in [*stops, prompt_tokens]:
            count += -(-(stop - at) // cap)  # full chunks up to the next checkpoint
            at = stop
        return max(count, 1)

    def finish_recovery(self, admitted: Admitted) -> None:
        """Give back the recovery budget a request held while it recovered (Tail-Replay
        tokens are in flight until its prefill ends)."""
        self.recovery.release(0, admitted.held_replay_tokens)

    def _run_swap_in(
        self,
        hashes: Sequence[BlockHash],
        prompt_tokens: int,
        output_tokens: int,
        vetoes: Mapping[Form, Reason] | None,
        swap: _SwapPlan,
        device: ResumePlan,
        chosen: Candidate,
    ) -> ResumePlan:
        """Bring back every object of ``swap`` as one unit, then plan again on the device: the
        plan resumes at the deepest point where every form's objects arrived intact."""
        assert self.tiers is not None
        t0 = time.perf_counter()
        nbytes = chosen.total_swap_bytes
        self.recovery.acquire(nbytes, 0)
        leased: list[tuple[BlockPool, int]] = []
        failures: dict[Form, Reason] = {}
        swaps: list[tuple[Form, SwapIn]] = []
        pending: list[tuple[Form, BlockPool, TierEntry]] = []
        try:
            # lease what is already on the device first, so the swap-ins' allocations cannot
            # evict it (case C8), and reserve the entries so the tiers cannot drop them
            for f in self.forms:
                for pool, h in f.needed_keys(hashes, swap.plan.resume_tokens):
                    block = pool.lookup(h)
                    if block is not None:
                        pool.lease(block)
                        leased.append((pool, block))
            reserved = [(form, pool, e) for form, items in swap.entries.items() for pool, e in items]
            for _, _, entry in reserved:
                self.tiers.begin_swap_in(entry)
            pending = list(reserved)
            while pending:
                form, pool, entry = pending[0]
                try:
                    block = pool.allocate()
                except PoolExhausted:  # the device pools cannot take the whole unit
                    failures.setdefault(form, Reason.RECOVERY_CAP_REACHED)
                    break
                leased.append((pool, block))
                swap_in = self.tiers.copy_in(pool, entry, block)  # may raise: the entry is still pending
                pending.pop(0)
                swaps.append((form, swap_in))
            self.tiers.release()
            concurrent.futures.wait([s.future for _, s in swaps])
            while swaps:
                form, s = swaps.pop(0)
                reason = self.tiers.finish_swap_in(s)
                if reason is not None:
                    failures.setdefault(form, reason)
        finally:
            for _, _, entry in pending:  # reserved, never copied: intact
                self.tiers.cancel_swap_in(entry)
            # never give a block back while a copy into it may still run (an exception above)
            concurrent.futures.wait([s.future for _, s in swaps])
            for _, s in swaps:
                self.tiers.finish_swap_in(s)
            for pool, block in leased:
                pool.release(block)
            self.recovery.release(nbytes, 0)
        seconds = time.perf_counter() - t0
        plan = self.lookup(hashes, prompt_tokens, vetoes, output_tokens=output_tokens, replay=False)
        moved: dict[Form, tuple[Tier, int]] = {}
        for form, items in swap.entries.items():
            if form not in failures:
                tiers = {e.tier for _, e in items}
                moved[form] = (Tier.DISK if Tier.DISK in tiers else Tier.HOST, sum(e.nbytes for _, e in items))
        plan = _mark_recovered(plan, device, {form: (tier, b, seconds) for form, (tier, b) in moved.items()})
        return _relabel(plan, failures)

    def _in_flight_forms(self, hashes: Sequence[BlockHash], tokens: int) -> dict[Form, Reason]:
        """Forms that need, to resume at ``tokens``, an object whose swap-in is in flight."""
        assert self.tiers is not None
        tiers = self.tiers
        return {
            f.form: Reason.IN_FLIGHT_SWAP
            for f in self.forms
            if any(tiers.in_flight(pool.name, h) for pool, h in f.needed_keys(hashes, tokens))
        }

    def settle(self, *, wait: bool | None = None) -> None:
        """Before a lookup: complete the tiers' finished copies, and the swap-ins a prefetch
        started — waiting for those still in flight when ``wait`` (default:
        ``CacheConfig.swap_in_wait``)."""
        if self.tiers is None:
            return
        if self._prefetched and (self.config.swap_in_wait if wait is None else wait):
            self.tiers.release()
            concurrent.futures.wait([s.future for s in self._prefetched])
        self._commit_prefetched()
        self.tiers.poll()

    def prefetch(self, hashes: Sequence[BlockHash], prompt_tokens: int) -> int:
        """Start swapping in, without waiting, what a request with this prompt would need from
        the tiers (SGLang HiCache-style prefetch of a queued request). The objects become
        visible when a later :meth:`settle` commits them; until then they are in flight and
        their bytes count against the recovery cap. Returns the bytes enqueued (0 when nothing
        needs a swap-in, the cap refuses it, or the pools have no room)."""
        if self.tiers is None:
            return 0
        self.settle()
        device = self.lookup(hashes, prompt_tokens, replay=False)
        swap = self._swap_plan(hashes, prompt_tokens, None, device)
        if swap is None:
            return 0
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

    def _commit_prefetched(self) -> None:
        assert self.tiers is not None
        pending = []
        for s in self._prefetched:
            if not s.future.done():
                pending.append(s)
                continue
            self.tiers.finish_swap_in(s)
            self.recovery.release(s.entry.nbytes, 0)
            if s.published:
                key = (s.pool.name, s.entry.block_hash)
                self._restored[key] = (s.entry.tier, s.entry.nbytes, time.perf_counter() - s.started)
                if len(self._restored) > sum(p.num_blocks for f in self.forms for p in f.pools):
                    self._restored.pop(next(iter(self._restored)))
            s.pool.release(s.block)
        self._prefetched = pending

    def _claim_restored(self, hashes: Sequence[BlockHash], plan: ResumePlan) -> ResumePlan:
        """Forms whose objects at L* a prefetch brought back report ``recovered`` (once)."""
        if not self._restored or not plan.resume_tokens:
            return plan
        resume = plan.resume_tokens - plan.replayed_tokens
        found: dict[Form, tuple[Tier, int, float]] = {}
        for f in self.forms:
            for pool, h in f.needed_keys(hashes, resume):
                got = self._restored.pop((pool.name, h), None)
                if got is not None:
                    tier, b, sec = found.get(f.form, (Tier.HOST, 0, 0.0))
                    found[f.form] = (Tier.DISK if Tier.DISK in (tier, got[0]) else Tier.HOST, b + got[1], max(sec, got[2]))
        if not found:
            return plan
        prior = {f.form: dataclasses.replace(f, reason=_MISSING[f.form]) for f in plan.forms}
        return _mark_recovered(plan, dataclasses.replace(plan, forms=tuple(prior.values())), found)

    def offload_all(self, tier: Tier, *, evict: bool = True) -> int:
        """Copy every cached device object to ``tier`` and wait for the copies; with ``evict``
        the device copies of the objects the tier holds are then dropped (what memory pressure
        would do, at once). Objects leased by running requests stay. Returns how many of the
        copied objects the tier holds afterwards (fewer when it is smaller than the data).

        Raises:
            ValueError: that tier is off.
        """
        if tier is Tier.DEVICE:
            raise ValueError("offload copies objects down to the host or disk tier, not to the device")
        if self.tiers is None or not self.tiers.capacity[tier]:
            raise ValueError(f"the {tier} tier is off (set CacheConfig.{tier}_tier_bytes)")
        moved: list[tuple[BlockPool, int]] = []
        for f in self.forms:
            for pool in f.pools:
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

    def inject_eviction(self, plan: ResumePlan, hashes: Sequence[BlockHash]) -> None:
        """Fault ``evict_between_check_and_use``: invalidate the deepest page the plan matched
        in the first page-based form (as another thread evicting it between lookup and lease)."""
        resume = plan.resume_tokens - plan.replayed_tokens
        if not resume or not self.kv_forms:
            return
        form = self.kv_forms[0]
        block = form.pool.lookup(hashes[resume // self.unit_tokens - 1])
        if block is not None:
            form.pool.invalidate(block)

    def validation_failures(self) -> dict[Form, ValidationFailure]:
        """Per form, the first stored tensor that breaks its reader's kernel contract (layer 2:
        dtype, block shape, axis order, kernel ABI, model revision) or alignment (layer 4: byte
        offsets and strides against the vector width)."""
        declared = [(f, f.stored_tensors()) for f in self.forms]
        key = (
            self.stored_revision,
            self.stored_kernel_abi,
            *((t.name, t.tensor.data_ptr(), t.tensor.dtype, t.tensor.shape, t.tensor.stride()) for _, ts in declared for t in ts),
        )
        if self._validated is not None and self._validated[0] == key:
            return self._validated[1]  # nothing a reader depends on changed since the last check
        out: dict[Form, ValidationFailure] = {}
        for f, tensors in declared:
            for t in tensors:
                contract = self.contracts.get(t.name)
                if contract is None:
                    raise RuntimeError(f"{t.name}: a pool tensor without a kernel contract")
                stored = LayoutFingerprint.of(
                    t.tensor, axis_order=t.axis_order, kernel_abi=self.stored_kernel_abi, model_revision=self.stored_revision
                )
                failure = check_kernel_contract(stored, contract) or check_alignment(t.tensor, contract)
                if failure is not None:
                    if t.name not in self._reported:
                        self._reported.add(t.name)
                        log.warning("%s: stored blocks cannot be reused: %s", t.name, failure)
                    out[f.form] = failure
                    break
        self._validated = (key, out)
        return out

    def start(self, plan: ResumePlan, token_ids: Sequence[int], hashes: Sequence[BlockHash]) -> PagedSequence:
        """Lease every object the plan reuses, then build the request's sequence.

        Leases are taken before the sequence allocates anything, so the request's own
        allocations can never evict what its lookup matched (case C8).

        Raises:
            StaleResume: a form's pools changed since the lookup and it can no longer resume at
                L* (nothing is leased then).
            RuntimeError: an object the plan relies on is gone although its pool did not change
                (an internal invariant).
        """
        resume = plan.resume_tokens - plan.replayed_tokens  # where computation starts
        u = self.unit_tokens
        if resume:
            versions = dict(plan.pool_versions)
            for f in self.forms:
                changed = versions.get(f.form) != tuple(p.version for p in f.pools)
                rebuilt = plan.replayed_tokens and f.form == Form.LINEAR_STATE  # reads nothing stored
                if changed and not rebuilt and f.resume_at_most(hashes, resume) < resume:
                    raise StaleResume(f.form)
        seq = PagedSequence(
            self, token_ids, hashes[: len(token_ids) // u], resume, self.checkpoint_positions(plan)
        )
        self.running.add(seq)
        seq.approximate = plan.replayed_tokens > 0
        seq.window_evicted = {
            f for f in self.kv_forms if f.window is not None and plan.form(f.form).reason == Reason.SWA_EVICTED
        }
        try:
            for form in self.kv_forms:
                needed = form.needed_pages(resume)
                table = seq.tables[form]
                table.extend([SENTINEL_BLOCK] * (resume // u))
                seq.released_pages[form] = needed.start
                for page in needed:
                    block = form.pool.lookup(hashes[page])
                    if block is None:
                        raise RuntimeError(f"{form.form}: page {page} of the plan vanished before its lease")
                    form.pool.lease(block)
                    table[page] = block
            if plan.replayed_tokens:
                self._pin_replayed(plan, hashes, seq)
            if self.linear is not None and seq.approximate:
                seq.linear_states = self.linear.zero_state()  # Tail-Replay rebuilds it from here
            elif self.linear is not None:
                slot = self.linear.checkpoint_at(hashes, resume)
                if resume and slot is None:
                    raise RuntimeError(f"linear_state: checkpoint at {resume} vanished before its lease")
                if slot is None:
                    seq.linear_states = self.linear.zero_state()
                else:
                    self.linear.pool.lease(slot)
                    try:
                        seq.linear_states = self.linear.read(slot)
                    finally:
                        self.linear.pool.release(slot)
            if self.compressed is not None:
                seq.compressed_states = self._restore_compressed(hashes, resume, seq.entry_tables) if resume else {}
        except BaseException:
            seq.finish()  # give back the leases taken so far
            raise
        return seq

    def checkpoint_positions(self, plan: ResumePlan) -> frozenset[int]:
        """Where a request prefilling ``[L*, T)`` takes recurrent checkpoints: every multiple of
        the checkpoint interval, the last U boundary strictly before the prompt end (where a
        repeat of the prompt resumes), the prompt end itself when it is a U boundary (where a
        longer follow-up resumes), and the junction where the matched prefix ends when L* fell
        short of it (a sibling sharing that prefix then resumes there: case C1)."""
        start = plan.resume_tokens
        limit = resume_limit(plan.prompt_tokens, self.unit_tokens)
        interval = self.config.checkpoint_interval_tokens
        positions = set(range(start - start % interval + interval, limit + 1, interval))
        end = plan.prompt_tokens
        if end % self.unit_tokens == 0:
            positions.add(end)  # the state after the whole prompt: where a longer follow-up resumes
        for p in (limit, min(plan.hash_hit_tokens, limit)):
            if p > start:
                positions.add(p)
        return frozenset(positions)

    def _pin_replayed(self, plan: ResumePlan, hashes: Sequence[BlockHash], seq: PagedSequence) -> None:
        """Tail-Replay computes from L − R but its lookup matched up to L: lease the pages of
        ``[L − R, L)`` too (KV and compressed entries), outside the block tables so the replayed
        rows are never written into them, so the request's own allocations cannot evict them
        (case C8). Released by :meth:`PagedSequence.finish`."""
        point, start, u = plan.resume_tokens, plan.resume_tokens - plan.replayed_tokens, self.unit_tokens
        for form in self.kv_forms:
            for page in form.needed_pages(point):
                if page >= start // u:
                    block = form.pool.lookup(hashes[page])
                    if block is None:
                        raise RuntimeError(f"{form.form}: page {page} of the plan vanished before its lease")
                    form.pool.lease(block)
                    seq.pinned.append((form.pool, block))
        for pages in self.entry_groups():
            for page in range(pages.pages_needed(start), pages.pages_needed(point)):
                block = pages.block_of(hashes, page)
                if block is None:
                    raise RuntimeError(f"{pages.pool.name}: page {page} of the plan vanished before its lease")
                pages.pool.lease(block)
                seq.pinned.append((pages.pool, block))

    def _restore_compressed(self, hashes: Sequence[BlockHash], resume: int, tables: list[list[int]]) -> dict[int, CompressedLayerState]:
        """The working state of every CSA/HCA layer at ``resume``: entries from the
        ``compressed_kv`` and indexer key pages (which stay leased in the request's ``tables``
        until it finishes), rows from the tail and indexer slots (leased while copied).

        Raises:
            RuntimeError: an object the plan relies on is gone (an internal invariant).
        """
        assert self.compressed is not None and self.tail is not None
        entry_forms = [*self.compressed.groups, *(self.indexer.keys if self.indexer is not None else [])]
        slot_forms = [self.tail.slots, *([self.indexer.slots] if self.indexer is not None else [])]
        leased: list[tuple[BlockPool, int]] = []
        try:
            entries = []
            for pages, table in zip(entry_forms, tables, strict=True):
                table.extend(pages.lease_pages(hashes, resume))  # released by PagedSequence.finish
                entries.append((pages.group.which, pages.read(table)))
            states = restore_states(self.compressed_specs, resume, entries, self.device)
            for slots in slot_forms:
                slot = slots.slot_at(hashes, resume)
                if slot is None and slots.needed_at(resume):
                    raise RuntimeError(f"{slots.pool.name}: rows at {resume} vanished before their lease")
                if slot is not None:
                    slots.pool.lease(slot)
                    leased.append((slots.pool, slot))
                slots.read_into(slot, resume, states)
        finally:
            for pool, block in leased:
                pool.release(block)
        for state in states.values():
            state.check()
        return states

    def window_pages_needed(self, window_tokens: int, max_tokens: int) -> int:
        """Most pages one request can hold in a window pool: the window behind its last
        checkpoint (up to one interval back), one prefill chunk, and its decoded tokens."""
        c = self.config
        span = window_tokens + c.max_prefill_chunk_tokens + c.checkpoint_interval_tokens + max_tokens
        return -(-span // self.unit_tokens) + 2

    def form_epoch(self, seq: PagedSequence, form: CacheForm, resume_tokens: int) -> int:
        """Epoch of the deepest object a form contributed to the resume (0 when none)."""
        return form.epoch_at(seq.hashes, resume_tokens)

    def save_checkpoint(
        self,
        hashes: Sequence[BlockHash],
        tokens: int,
        linear_states: dict[int, LinearLayerState],
        compressed_states: dict[int, CompressedLayerState],
    ) -> bool:
        """Store what a resume at ``tokens`` needs besides pages: copies of the recurrent state
        (``linear_state``) and of the compressors' pending and previous-group rows
        (``uncompressed_tail``, ``indexer_state``), keyed by the hash of ``[0, tokens)``.

        Returns whether every such form holds that prefix afterwards (stored now or before);
        False when the model has none or a pool has every slot leased.
        """
        stored = self.has_checkpoint_forms
        h = hashes[tokens // self.unit_tokens - 1]
        if self.linear is not None and self.config.tail_replay != "only" and self.linear.pool.lookup(h) is None:
            try:
                slot = self.linear.pool.allocate()
            except PoolExhausted:
                log.warning("linear_state: every slot is leased; checkpoint skipped")
                stored = False
            else:
                self.linear.write(slot, linear_states)
                self.linear.pool.publish(slot, h)
                self.linear.pool.release(slot)
        for form in (self.tail, self.indexer):
            if form is None:
                continue
            if form is self.tail and self.faults.drop_tail:
                form.slots.remember_lost(hashes[tokens // self.unit_tokens - 1])
                stored = False
                continue
            lag = form is self.indexer and self.faults.lag_index
            if not form.slots.store(hashes, tokens, compressed_states, lag=lag):
                log.warning("%s: every slot is leased; rows at %d not stored", form.form, tokens)
                stored = False
        return stored

    def store_entries(self, hashes: Sequence[BlockHash], states: dict[int, CompressedLayerState], tables: list[list[int]]) -> None:
        """Store the complete entry pages of every compressed and indexer group past the
        request's leased pages ``tables[i]`` of group i (see :meth:`EntryPages.store`)."""
        if states:
            disagree = self.faults.groups_disagree and self.compressed is not None and len(self.compressed.groups) > 1
            for g, table in zip(self.entry_groups(), tables, strict=True):
                g.store(hashes, states, table, withhold=1 if disagree and g is self.compressed.groups[-1] else 0)  # type: ignore[union-attr]

    def entry_groups(self) -> list[EntryPages]:
        out = list(self.compressed.groups) if self.compressed is not None else []
        if self.indexer is not None:
            out += self.indexer.keys
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError unless the whole cache is consistent, between any two steps:

        * every pool's own invariants (states, ref counts, free queue, hash map);
        * the prefix index counts exactly the published objects of all forms;
        * leases are owned: a KV page's ref count equals the number of running requests whose
          block table holds it; a page being written (unpublished) belongs to exactly one
          request; compressed entry pages likewise (leased by the requests holding them);
          tail, indexer-row and checkpoint slots are leased only inside a step;
        * with a memory plan, the pools fit the byte budget.
        """
        expected: Counter[BlockHash] = Counter()
        for f in self.forms:
            for pool in f.pools:
                pool.check_invariants()
                expected.update(h for h in pool.block_hash if h is not None)
        if self.tiers is not None:
            self.tiers.check_invariants()
            expected.update(self.tiers.readable_hashes())
        assert dict(expected) == self.index.snapshot(), "prefix index disagrees with the pools and tiers"
        running = [seq for seq in self.running if not seq.finished]
        prefetching = Counter((id(s.pool), s.block) for s in self._prefetched)
        for form in self.kv_forms:
            held = Counter(b for seq in running for b in seq.tables[form] if b != SENTINEL_BLOCK)
            held.update(b for seq in running for pool, b in seq.pinned if pool is form.pool)
            held.update(b for (pool_id, b), n in prefetching.items() for _ in range(n) if pool_id == id(form.pool))
            for block in range(1, form.pool.num_blocks):
                rc = form.pool.ref_count[block]
                assert rc == held[block], f"{form.form}: block {block} has {rc} leases, {held[block]} running requests hold it"
                if rc and form.pool.block_hash[block] is None:
                    assert held[block] == 1, f"{form.form}: unpublished block {block} is written by {held[block]} requests"
        for i, pages in enumerate(self.entry_groups()):
            held = Counter(b for seq in running for b in seq.entry_tables[i])
            held.update(b for seq in running for pool, b in seq.pinned if pool is pages.pool)
            held.update(b for (pool_id, b), n in prefetching.items() for _ in range(n) if pool_id == id(pages.pool))
            for block in range(1, pages.pool.num_blocks):
                rc = pages.pool.ref_count[block]
                assert rc == held[block], f"{pages.pool.name}: block {block} has {rc} leases, {held[block]} running requests hold it"
        entry_pools = {id(g.pool) for g in self.entry_groups()}
        for f in self.forms:
            if isinstance(f, PagedKVForm):
                continue
            for pool in f.pools:
                if id(pool) not in entry_pools:
                    fetching = sum(n for (pool_id, _), n in prefetching.items() if pool_id == id(pool))
                    assert pool.num_leased == fetching, f"{pool.name}: {pool.num_leased} slots leased between steps"
        if self.budget is not None:
            total = sum(p.bytes for p in self.pool_plans())
            assert total <= self.budget[0], f"the pools take {total} bytes, over the {self.budget[0]}-byte budget"


_MISSING = {  # why a form's device copy was missing when a lower tier had to supply it
    Form.FULL_KV: Reason.KV_EVICTED,
    Form.SWA_WINDOW: Reason.SWA_EVICTED,
    Form.COMPRESSED_KV: Reason.COMPRESSED_EVICTED,
    Form.UNCOMPRESSED_TAIL: Reason.TAIL_MISSING,
    Form.INDEXER_STATE: Reason.INDEXER_STALE,
    Form.LINEAR_STATE: Reason.LINEAR_CHECKPOINT_MISSING,
}


def _relabel(plan: ResumePlan, reasons: Mapping[Form, Reason]) -> ResumePlan:
    """Give forms that lost tokens (not ``hit``) the reason the caller knows better (a failed
    swap-in, a refused plan); the limiting reason follows its form."""
    if not reasons:
        return plan
    forms = tuple(
        dataclasses.replace(f, reason=reasons[f.form]) if f.form in reasons and f.outcome is Outcome.INVALIDATED else f
        for f in plan.forms
    )
    limiting = plan.limiting_reason
    lim = plan.limiting_form
    if lim is not None and lim in reasons and plan.form(lim).outcome is Outcome.INVALIDATED:
        limiting = reasons[lim]
    return dataclasses.replace(plan, forms=forms, limiting_reason=limiting)


def _mark_recovered(plan: ResumePlan, before: ResumePlan, moved: Mapping[Form, tuple[Tier, int, float]]) -> ResumePlan:
    """Forms that resume in ``plan`` thanks to swapped-in objects: the tier, bytes and seconds
    of their swap-in, and outcome ``recovered`` with the reason their device copy was missing
    (from ``before``) unless they lost tokens past L* anyway."""
    forms = []
    for f in plan.forms:
        got = moved.get(f.form)
        if got is not None:
            tier, nbytes, seconds = got
            f = dataclasses.replace(f, tier=tier, bytes_moved=nbytes, recovery_seconds=seconds)
            if f.outcome is Outcome.HIT:  # one that still lost tokens past L* stays invalidated, with its bytes
                prior = before.form(f.form).reason
                reason = prior if prior not in (Reason.NONE, Reason.NO_PREFIX_MATCH, Reason.PROMPT_END) else _MISSING[f.form]
                f = dataclasses.replace(f, outcome=Outcome.RECOVERED, reason=reason)
        forms.append(f)
    return dataclasses.replace(plan, forms=tuple(forms))
