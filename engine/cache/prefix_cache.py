"""The prefix cache of one model: the object the engine talks to.

:class:`PrefixCache` is a facade: it wires the parts, each owning its own state
(docs/cache-forms.md, "Module map"), delegates to them and checks the invariants that span them:

* :class:`~engine.cache.form_set.FormSet` — the forms, their pools, the prefix index, kernel
  contracts and validation;
* :class:`~engine.cache.swap.SwapController` — the host and disk tiers, swap-in, prefetch;
* :class:`~engine.cache.planner.Planner` — lookup, Tail-Replay, priced admission, ghosts;
* :class:`~engine.cache.checkpoint_writer.CheckpointWriter` — checkpoints and entry pages;
* :class:`~engine.cache.accounting.Accounting` — occupancy and the memory plan;
* :class:`~engine.cache.leases.Leases` — starting a request on its plan, and who holds what.

The engine calls :meth:`PrefixCache.block_hashes` (the prompt's hash chain, once per request),
:meth:`PrefixCache.admit` (or :meth:`PrefixCache.lookup`), then :meth:`PrefixCache.start` — lease
what the plan reuses and hand back a :class:`~engine.cache.sequence.PagedSequence` that
allocates as the request runs; :meth:`PrefixCache.check_invariants` checks pools, free queues,
prefix index and lease ownership agree.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence

import torch

from engine.cache.accounting import Accounting, FormOccupancy
from engine.cache.admission import CostModel, RecoveryBudget
from engine.cache.checkpoint_writer import CheckpointWriter
from engine.cache.compressed import EntryPages
from engine.cache.config import CacheConfig
from engine.cache.coordinator import ResumePlan
from engine.cache.form_set import CacheForm, FormSet, PoolEntry
from engine.cache.form_spec import FormSpec
from engine.cache.ghosts import GHOST_CANDIDATES
from engine.cache.hashing import BlockHash
from engine.cache.leases import Leases, StaleResume
from engine.cache.memory_plan import MemoryPlan, PoolPlan
from engine.cache.planner import Admitted, Planner
from engine.cache.rank_agreement import RankAgreement
from engine.cache.sequence import PagedSequence
from engine.cache.swap import SwapController, check_offload_tier, open_tiers
from engine.cache.validation import ValidationFailure
from engine.cache.what_if import planned_config
from engine.events import Form, Reason, Tier
from engine.faults import Faults
from engine.model.base import ModelLayout
from engine.model.state import CompressedLayerState, LinearLayerState

__all__ = ["Admitted", "CacheForm", "FormOccupancy", "FormSpec", "PoolEntry", "PrefixCache", "StaleResume"]

log = logging.getLogger(__name__)


class PrefixCache:
    """Every cache form of one model, sized by a :class:`CacheConfig`.

    Args:
        layout: the layers the forms serve (:meth:`CausalLM.layout`).
        config: pool sizes and policies.
        model_name: part of the hash root (with the layout's revision), so two models never
            share a prefix.
        device, dtype: where the KV pools live and their element type.

    The forms and their pools (``kv_forms``, ``linear``, ``compressed``, ``tail``, ``indexer``,
    ``forms``, ``index``, ``contracts``, ...) are the form set's; ``tiers`` and ``recovery`` are
    shared by the parts that move and price objects.
    """

    GHOST_CANDIDATES = GHOST_CANDIDATES
    """Resume points (every U tokens down from the target) a form's ghost search tries at most."""

    def __init__(self, layout: ModelLayout, config: CacheConfig, model_name: str, device: torch.device, dtype: torch.dtype) -> None:
        self.form_set = fs = FormSet(layout, config, model_name, device, dtype)
        self.layout, self.unit_tokens, self.device, self.index, self.root = layout, fs.unit_tokens, device, fs.index, fs.root
        self.kv_forms, self.kv_form_of_layer, self.linear = fs.kv_forms, fs.kv_form_of_layer, fs.linear
        self.compressed_specs, self.compressed, self.tail, self.indexer = fs.compressed_specs, fs.compressed, fs.tail, fs.indexer
        self.forms, self.contracts = fs.forms, fs.contracts
        self.recovery = RecoveryBudget(config.max_recovery_bytes, config.max_replay_tokens)
        """The global cap on recovery work in flight (DESIGN.md §4, red line 1)."""
        self.tiers = open_tiers(config, fs)
        """The host and disk tiers (None when both are off)."""
        self.swap = SwapController(fs, self.tiers, self.recovery, config) if self.tiers is not None else None
        self.writer = CheckpointWriter(fs, config)
        self.planner = Planner(fs, self.swap, self.recovery, config)
        self.accounting = Accounting(fs, self.tiers, config)
        self.leases = Leases(fs, self.writer)
        self.running = self.leases.running
        """Requests started and not finished (for the ownership check of check_invariants)."""

    @classmethod
    def planned(cls, layout: ModelLayout, config: CacheConfig, model_name: str, device: torch.device, dtype: torch.dtype) -> PrefixCache:
        """A cache whose pools come from ``config.memory_bytes`` when it is set (one memory plan
        for every form, :func:`engine.cache.what_if.planned_config`), else from the config's
        block counts.

        Raises:
            ValueError: the budget cannot hold the headroom of every pool.
        """
        if config.memory_bytes is None:
            return cls(layout, config, model_name, device, dtype)
        sized, tokens = planned_config(layout, config, dtype)
        cache = cls(layout, sized, model_name, device, dtype)
        cache.budget = (config.memory_bytes, tokens)
        return cache

    # -- state held by the parts ---------------------------------------------------------------
    @property
    def config(self) -> CacheConfig:
        """Pool sizes and policies; a replaced config's policies apply from the next call on
        (its pool sizes do not: the pools are allocated)."""
        return self.form_set.config

    @config.setter
    def config(self, config: CacheConfig) -> None:
        for part in (self.form_set, self.swap, self.writer, self.planner, self.accounting):
            if part is not None:
                part.config = config

    @property
    def faults(self) -> Faults:
        """Injected faults (engine/faults.py); none unless a test or config enables them."""
        return self.writer.faults

    @faults.setter
    def faults(self, faults: Faults) -> None:
        self.writer.faults = faults

    @property
    def agreement(self) -> RankAgreement | None:
        """The cross-rank agreement of a tensor-parallel rank's lookups and leases (None in a
        single process); see :mod:`engine.cache.rank_agreement`."""
        return self.planner.agreement

    @agreement.setter
    def agreement(self, agreement: RankAgreement | None) -> None:
        self.planner.agreement = agreement
        if self.swap is not None:
            self.swap.agreement = agreement

    @property
    def budget(self) -> tuple[int, int] | None:
        """(budget bytes, capacity tokens) when the pools came from a memory plan."""
        return self.accounting.budget

    @budget.setter
    def budget(self, budget: tuple[int, int] | None) -> None:
        self.accounting.budget = budget

    @property
    def stored_revision(self) -> str:
        """The weights every stored object was computed with (a stamp of the writer)."""
        return self.form_set.stored_revision

    @stored_revision.setter
    def stored_revision(self, revision: str) -> None:
        self.form_set.stored_revision = revision

    @property
    def stored_kernel_abi(self) -> int:
        """The reader interface the stored objects were written for."""
        return self.form_set.stored_kernel_abi

    @stored_kernel_abi.setter
    def stored_kernel_abi(self, abi: int) -> None:
        self.form_set.stored_kernel_abi = abi

    @property
    def has_checkpoint_forms(self) -> bool:
        """Whether some form resumes only at stored checkpoints: resume points are then the
        checkpoint positions, not every U boundary."""
        return self.form_set.has_checkpoint_forms

    # -- the forms (FormSet) ---------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        return self.form_set.block_hashes(token_ids)

    def resume_granularity(self) -> dict[Form, int]:
        return self.form_set.resume_granularity()

    def form_specs(self) -> dict[Form, FormSpec]:
        return self.form_set.form_specs()

    def pool_entries(self) -> list[PoolEntry]:
        return self.form_set.pool_entries()

    def entry_groups(self) -> list[EntryPages]:
        return self.form_set.entry_groups()

    def validation_failures(self) -> dict[Form, ValidationFailure]:
        return self.form_set.validation_failures()

    def limit_cached(self, form: Form, max_cached_blocks: int | None) -> int:
        return self.form_set.limit_cached(form, max_cached_blocks)

    def inject_eviction(self, plan: ResumePlan, hashes: Sequence[BlockHash]) -> None:
        self.form_set.inject_eviction(plan, hashes)

    def checkpoint_positions(self, plan: ResumePlan) -> frozenset[int]:
        return self.form_set.checkpoint_positions(plan)

    def window_pages_needed(self, window_tokens: int, max_tokens: int) -> int:
        return self.form_set.window_pages_needed(window_tokens, max_tokens)

    def form_epoch(self, seq: PagedSequence, form: CacheForm, resume_tokens: int) -> int:
        """Epoch of the deepest object a form contributed to the resume (0 when none)."""
        return form.epoch_at(seq.hashes, resume_tokens)

    # -- accounting ------------------------------------------------------------------------------
    def pool_plans(self) -> list[PoolPlan]:
        return self.accounting.pool_plans()

    def memory_plan(self) -> MemoryPlan:
        return self.accounting.memory_plan()

    def tail_replay_savings_bytes(self) -> int:
        return self.accounting.tail_replay_savings_bytes()

    def occupancy(self) -> list[FormOccupancy]:
        return self.accounting.occupancy()

    def tier_occupancy(self) -> list[FormOccupancy]:
        return self.accounting.tier_occupancy()

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

    # -- planning and swap-in --------------------------------------------------------------------
    def lookup(
        self,
        hashes: Sequence[BlockHash],
        prompt_tokens: int,
        vetoes: Mapping[Form, Reason] | None = None,
        *,
        output_tokens: int = 0,
        replay: bool = True,
    ) -> ResumePlan:
        """:meth:`Planner.lookup`: the hash hit and the resume plan, changing nothing."""
        return self.planner.lookup(hashes, prompt_tokens, vetoes, output_tokens=output_tokens, replay=replay)

    def admit(
        self,
        hashes: Sequence[BlockHash],
        prompt_tokens: int,
        costs: CostModel | None,
        *,
        output_tokens: int = 0,
        vetoes: Mapping[Form, Reason] | None = None,
    ) -> Admitted:
        """:meth:`Planner.admit`: choose (and run a chosen swap-in of) a request's plan."""
        return self.planner.admit(hashes, prompt_tokens, costs, output_tokens=output_tokens, vetoes=vetoes)

    def finish_recovery(self, admitted: Admitted) -> None:
        self.planner.finish_recovery(admitted)

    def prefetch(self, hashes: Sequence[BlockHash], prompt_tokens: int) -> int:
        """:meth:`Planner.prefetch`: start a queued request's swap-ins; the bytes enqueued."""
        return self.planner.prefetch(hashes, prompt_tokens)

    def settle(self, *, wait: bool | None = None) -> None:
        """:meth:`SwapController.settle` (nothing without tiers)."""
        if self.swap is not None:
            self.swap.settle(wait=wait)

    def offload_all(self, tier: Tier, *, evict: bool = True) -> int:
        """:meth:`SwapController.offload_all`.

        Raises:
            ValueError: ``tier`` is the device, or is off.
        """
        check_offload_tier(self.tiers, tier)
        assert self.swap is not None
        return self.swap.offload_all(tier, evict=evict)

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(
        self,
        hashes: Sequence[BlockHash],
        tokens: int,
        linear_states: dict[int, LinearLayerState],
        compressed_states: dict[int, CompressedLayerState],
    ) -> bool:
        return self.writer.save_checkpoint(hashes, tokens, linear_states, compressed_states)

    def store_entries(self, hashes: Sequence[BlockHash], states: dict[int, CompressedLayerState], tables: list[list[int]]) -> None:
        self.writer.store_entries(hashes, states, tables)

    # -- leases ----------------------------------------------------------------------------------
    def start(self, plan: ResumePlan, token_ids: Sequence[int], hashes: Sequence[BlockHash]) -> PagedSequence:
        """:meth:`Leases.start`: lease every object the plan reuses, then build the request's
        sequence.

        Raises:
            StaleResume: a form's pools changed since the lookup and it can no longer resume at
                L* (nothing is leased then).
            RuntimeError: an object the plan relies on is gone (an internal invariant).
        """
        return self.leases.start(plan, token_ids, hashes)

    def check_invariants(self) -> None:
        """Raise AssertionError unless the whole cache is consistent, between any two steps:

        * every pool's own invariants (states, ref counts, free queue, hash map), and the tiers';
        * the prefix index counts exactly the published objects of all forms and tiers;
        * leases are owned (:meth:`Leases.check_owned`): a KV page's ref count equals the number
          of running requests whose block table holds it; a page being written (unpublished)
          belongs to exactly one request; compressed entry pages likewise; tail, indexer-row and
          checkpoint slots are leased only inside a step;
        * with a memory plan, the pools fit the byte budget.
        """
        expected: Counter[BlockHash] = Counter()
        for pool in self.form_set.pools():
            pool.check_invariants()
            expected.update(h for h in pool.block_hash if h is not None)
        if self.tiers is not None:
            self.tiers.check_invariants()
            expected.update(self.tiers.readable_hashes())
        assert dict(expected) == self.index.snapshot(), "prefix index disagrees with the pools and tiers"
        self.leases.check_owned(self.swap.prefetched_blocks() if self.swap is not None else Counter())
        if self.budget is not None:
            total = sum(p.bytes for p in self.pool_plans())
            assert total <= self.budget[0], f"the pools take {total} bytes, over the {self.budget[0]}-byte budget"
