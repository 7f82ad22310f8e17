"""Accounting: how full every pool and lower tier is, and the memory plan of the pools.

:class:`Accounting` reads block counts and bytes — it changes nothing — for the
``engine_stats`` events (:meth:`Accounting.occupancy`, :meth:`Accounting.tier_occupancy`) and
the plan logged at start (:meth:`Accounting.memory_plan`; its rows come from
:func:`engine.cache.what_if.pool_plans`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from engine.cache.config import CacheConfig
from engine.cache.form_set import FormSet
from engine.cache.memory_plan import MemoryPlan, PoolPlan
from engine.cache.tiers import TierStore
from engine.cache.what_if import pool_plans
from engine.events import Form, Tier


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


class Accounting:
    """Occupancy and the memory plan of the pools of ``form_set`` and of ``tiers`` (None when
    both lower tiers are off)."""

    def __init__(self, form_set: FormSet, tiers: TierStore | None, config: CacheConfig) -> None:
        self.form_set = form_set
        self.tiers = tiers
        self.config = config
        self.budget: tuple[int, int] | None = None
        """(budget bytes, capacity tokens) when the pools came from a memory plan."""

    def pool_plans(self) -> list[PoolPlan]:
        """Every pool with its blocks, bytes per block, the prefix tokens one block holds and its
        headroom (:func:`engine.cache.what_if.pool_plans`)."""
        fs = self.form_set
        specs = [(spec, pool.num_blocks - 1) for spec, pool in fs.pools_with_specs()]
        return pool_plans(specs, self.config, fs.layout.sliding_window, fs.has_checkpoint_forms)

    def memory_plan(self) -> MemoryPlan:
        """The pools, their resume granularity, the budget they were sized for (None: from the
        config's block counts) and the prefix length every form holds beyond headroom."""
        budget, tokens = self.budget if self.budget is not None else (None, 0)
        pools = self.pool_plans()
        if budget is None:  # capacity implied by the explicit block counts
            tokens = min((p.blocks - p.headroom_blocks) * p.tokens_per_block for p in pools) if pools else 0
        return MemoryPlan(pools=tuple(pools), granularity=self.form_set.resume_granularity(), budget_bytes=budget, capacity_tokens=max(0, tokens))

    def tail_replay_savings_bytes(self) -> int:
        """In Tail-Replay-only mode, the bytes the ``linear_state`` checkpoints would take
        (``CacheConfig.linear_checkpoints`` slots) and are not allocated; else 0."""
        linear = self.form_set.linear
        if linear is None or self.config.tail_replay != "only":
            return 0
        return (self.config.linear_checkpoints - linear.pool.num_blocks) * linear.bytes_per_block

    def tier_occupancy(self) -> list[FormOccupancy]:
        """Per (form, lower tier) holding anything: its objects (all cached, none leased) and
        their bytes."""
        if self.tiers is None:
            return []
        form_of = {e.pool.name: e.form for e in self.form_set.pool_entries()}
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
        for f in self.form_set.forms:
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
