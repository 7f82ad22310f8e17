"""Ghosts: what more (or less) device memory would have done for one request's resume — the
per-form input of the telemetry's Capacity what-if (``FormLookup.ghost_tokens``,
``ghost_bytes``, ``spare_bytes``).

A form's memory is taken to grow or shrink over its pools in proportion to their size, so one
block of a pool stands for the form's bytes over the pool's blocks. The pools remember their
recent evictions (:meth:`BlockPool.ghost_depth`) and how far each cached block is from eviction
(:meth:`BlockPool.spare_blocks`). Source of the idea: the ghost lists of ARC (Megiddo and Modha,
2003), which remember recently evicted keys to tell what a larger cache would have hit.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

from engine.cache.block_pool import BlockPool
from engine.cache.coordinator import ResumePlan, resume_limit
from engine.cache.form_set import CacheForm, FormSet
from engine.cache.hashing import BlockHash
from engine.events import Form, Reason

GHOST_CANDIDATES = 64
"""Resume points (every U tokens down from the target) a form's ghost search tries at most."""


class GhostPricer:
    """Prices a plan's forms in device bytes over the pools of ``form_set`` (whose sizes never
    change, so each pool's bytes per block of its form are computed once)."""

    def __init__(self, form_set: FormSet) -> None:
        self.form_set = form_set
        entries = form_set.pool_entries()
        form_bytes: Counter[Form] = Counter()
        for e in entries:
            form_bytes[e.form] += e.pool.num_blocks * e.bytes_per_block
        self._bytes_per_block = {id(e.pool): form_bytes[e.form] / e.pool.num_blocks for e in entries}
        """id(pool) → its form's bytes per block of it."""

    def with_ghosts(self, plan: ResumePlan, hashes: Sequence[BlockHash], vetoes: Mapping[Form, Reason] | None) -> ResumePlan:
        """``plan`` (run once per request, on the admitted plan) with: for each form that could
        resume, how much less device memory would still have served that resume
        (``spare_bytes``, :meth:`spare`); for each form that lost tokens, the resume point it
        would have had with more device memory and how much more (``ghost_tokens`` /
        ``ghost_bytes``, :meth:`ghost`). A vetoed form (a validation failure, or ``vetoes``)
        gets none: memory would not help."""
        if not plan.hash_hit_tokens:
            return plan
        target = min(plan.hash_hit_tokens, resume_limit(plan.prompt_tokens, self.form_set.unit_tokens))
        vetoed = set(self.form_set.validation_failures()) | set(vetoes or {})  # memory would not help these
        by_form = {f.form: f for f in self.form_set.forms}
        forms = []
        for lookup in plan.forms:
            form = by_form[lookup.form]
            if lookup.form in vetoed:
                forms.append(lookup)
                continue
            if lookup.usable_tokens > 0:
                lookup = dataclasses.replace(lookup, spare_bytes=self.spare(form, hashes, lookup.usable_tokens))
            if lookup.usable_tokens < target:
                ghost = self.ghost(form, hashes, target, lookup.usable_tokens)
                if ghost is not None:
                    lookup = dataclasses.replace(lookup, ghost_tokens=ghost[0], ghost_bytes=ghost[1])
            forms.append(lookup)
        return dataclasses.replace(plan, forms=tuple(forms))

    def spare(self, form: CacheForm, hashes: Sequence[BlockHash], usable: int) -> int:
        """The device memory ``form`` could lose and still hold every object a resume at
        ``usable`` reads: per pool, the fewest spare blocks among those objects
        (:meth:`BlockPool.spare_blocks`) in form bytes; the smallest over the pools."""
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

    def ghost(self, form: CacheForm, hashes: Sequence[BlockHash], target: int, usable: int) -> tuple[int, int] | None:
        """The highest point ≤ ``target`` (at most :data:`GHOST_CANDIDATES` tried, every U down,
        above ``usable``) whose every needed object is cached or was evicted recently, and the
        bytes that would have kept it: the largest over the pools of the deepest such eviction,
        in form bytes. None when there is none, or when nothing was evicted there (memory is
        not why the form could not resume)."""
        u = self.form_set.unit_tokens
        for cand in range(target, usable, -u)[:GHOST_CANDIDATES]:
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
