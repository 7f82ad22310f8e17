"""Raw cache contents for the reason oracle (tests/engine/reason_oracle.py).

INDEPENDENCE: this module and every ``reason_oracle*`` module share no code with the cache's
managers. They read raw data only — which hashes each device pool caches and with which stamp
(``page_end``, ``slot_tokens``, ``slot_boundaries``), the pools' eviction memory
(``was_evicted``), the objects a store lost, the tier entries (tier, lifecycle state, stamp,
doomed), the prefix index's holders and what a prefetch brought back — and never call a resume
rule, a plan, a loss reason or a verdict of the engine (``resume_at_most``, ``loss_reason``,
``needed_keys``, ``plan_resume``, the planner, the swap controller's plans, ``verdicts``,
``tail_replay``). ``tests/engine/test_reason_oracle.py`` checks this with :mod:`ast`.

A :class:`Snapshot` is taken for one prompt's hash chain (only those hashes matter), before the
request that is compared with the oracle runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from engine.cache.lifecycle import BlockState
from engine.events import Form, Reason, Tier

Stamp = tuple[object, ...]


class TierState(Enum):
    """What a lower-tier entry can do for a lookup now."""

    READABLE = "readable"
    IN_FLIGHT = "in_flight"
    """Being swapped in (``SWAPPING_IN``)."""
    WRITING = "writing"
    """Being copied down (``SWAPPING_OUT``): not readable yet, its device copy evicted."""
    DOOMED = "doomed"


@dataclass(frozen=True, slots=True)
class TierCopy:
    tier: Tier
    state: TierState
    stamp: Stamp
    nbytes: int = 0
    moving: bool = False
    """A copy is in flight on it (``SWAPPING_IN`` or ``SWAPPING_OUT``), doomed or not."""


@dataclass(slots=True)
class PoolRaw:
    """One pool's raw contents for the prompt's hashes."""

    name: str
    device: dict[bytes, Stamp] = field(default_factory=dict)
    """Hash → stamp of every object cached on the device under a prompt hash."""
    evicted: set[bytes] = field(default_factory=set)
    """Prompt hashes the pool remembers evicting (or a store lost / could not store)."""
    tier: dict[bytes, TierCopy] = field(default_factory=dict)
    restored: set[bytes] = field(default_factory=set)
    """Prompt hashes a prefetch brought back, not yet claimed by a request."""
    refused: dict[bytes, Reason] = field(default_factory=dict)
    """Prompt hashes whose prefetched copy the tiers refused (with the refusal), not yet
    claimed by a request."""


@dataclass(frozen=True, slots=True)
class Group:
    """One compressor geometry: its entry pool (None for a slot group) and ratio."""

    ratio: int
    overlapping: bool
    pool: str | None = None


@dataclass(frozen=True, slots=True)
class FormGeom:
    """What the oracle needs to know of a form's layout (no behaviour)."""

    form: Form
    pools: tuple[str, ...]
    window: int | None = None
    entry_groups: tuple[Group, ...] = ()
    """Entry-page groups (``compressed_kv`` main groups, ``indexer_state`` key groups)."""
    slot_groups: tuple[Group, ...] = ()
    """Groups whose rows live in the form's boundary slots (tail, indexer pending rows)."""
    slot_pool: str | None = None


@dataclass(slots=True)
class Snapshot:
    """Everything the oracle reads, for one prompt."""

    unit: int
    hashes: list[bytes]
    held: list[bool]
    """Per prompt hash: whether the prefix index counts a holder for it."""
    forms: list[FormGeom]
    pools: dict[str, PoolRaw]
    caching: bool
    prefetching: bool
    tiers_on: bool = False
    """Whether the cache has a host or disk tier."""
    bytes_in_flight: int = 0
    """Recovery bytes in flight (prefetches not yet committed)."""
    replay_in_flight: int = 0
    """Replayed tokens in flight (Tail-Replay requests still prefilling)."""


def form_geoms(cache: Any) -> list[FormGeom]:
    """The layout of every form of ``cache`` (a ``PrefixCache``), in its form order."""
    out: list[FormGeom] = []
    for f in cache.forms:
        form = f.form
        if form in (Form.FULL_KV, Form.SWA_WINDOW):
            out.append(FormGeom(form, (f.pool.name,), window=f.window))
        elif form is Form.LINEAR_STATE:
            out.append(FormGeom(form, (f.pool.name,)))
        elif form is Form.COMPRESSED_KV:
            groups = tuple(Group(g.ratio, g.group.spec.overlapping, g.pool.name) for g in f.groups)
            out.append(FormGeom(form, tuple(g.pool for g in groups if g.pool), entry_groups=groups))
        elif form is Form.UNCOMPRESSED_TAIL:
            slots = f.slots
            sg = tuple(Group(g.spec.ratio, g.spec.overlapping) for g in slots.groups)
            out.append(
                FormGeom(form, (slots.pool.name,), slot_groups=sg, slot_pool=slots.pool.name)
            )
        else:
            keys = tuple(Group(k.ratio, k.group.spec.overlapping, k.pool.name) for k in f.keys)
            slots = f.slots
            sg = tuple(Group(g.spec.ratio, g.spec.overlapping) for g in slots.groups)
            pools = (*(k.pool for k in keys if k.pool), slots.pool.name)
            out.append(
                FormGeom(form, pools, entry_groups=keys, slot_groups=sg, slot_pool=slots.pool.name)
            )
    return out


def _stores(cache: Any) -> list[tuple[Any, Any]]:
    """(pool, its stamp source) of every device pool: entry pages, boundary slots or None."""
    out: list[tuple[Any, Any]] = []
    for f in cache.forms:
        if f.form in (Form.FULL_KV, Form.SWA_WINDOW, Form.LINEAR_STATE):
            out.append((f.pool, None))
        elif f.form is Form.COMPRESSED_KV:
            out += [(g.pool, g) for g in f.groups]
        elif f.form is Form.UNCOMPRESSED_TAIL:
            out.append((f.slots.pool, f.slots))
        else:
            out += [(k.pool, k) for k in f.keys]
            out.append((f.slots.pool, f.slots))
    return out


def _stamp(source: Any, block: int) -> Stamp:
    if source is None:
        return ()
    if hasattr(source, "page_end"):
        return (source.page_end[block],)
    return (source.slot_tokens[block], *source.slot_boundaries[block])


def _lost(source: Any) -> Any:
    """The hashes a store remembers losing: entry pages left unstored, slots dropped."""
    if source is None:
        return ()
    if hasattr(source, "page_end"):
        return source._not_stored  # raw data, not a rule
    return source.lost


def snapshot(llm: Any, token_ids: Sequence[int]) -> Snapshot:
    """The raw contents of ``llm``'s cache (an ``engine.LLM``) for one prompt."""
    cache = llm.cache
    hashes = list(cache.block_hashes(token_ids))
    tiers = cache.tiers
    swap = cache.swap
    restored = set(swap._restored) if swap is not None else set()  # raw data, not a rule
    refused = dict(swap._refused) if swap is not None else {}  # raw data, not a rule
    pools: dict[str, PoolRaw] = {}
    for pool, source in _stores(cache):
        raw = PoolRaw(pool.name)
        cached = pool.cached_blocks
        lost = _lost(source)
        for h in hashes:
            block = cached.get(h)
            if block is not None:
                raw.device[h] = _stamp(source, block)
            if pool.was_evicted(h) or h in lost:
                raw.evicted.add(h)
            if (pool.name, h) in restored:
                raw.restored.add(h)
            if (pool.name, h) in refused:
                raw.refused[h] = refused[(pool.name, h)]
            entry = tiers.entries.get((pool.name, h)) if tiers is not None else None
            if entry is not None:
                state = tiers.states[entry.row]
                if entry.doomed:
                    kind = TierState.DOOMED
                elif state is BlockState.OFFLOADED:
                    kind = TierState.READABLE
                elif state is BlockState.SWAPPING_IN:
                    kind = TierState.IN_FLIGHT
                else:
                    kind = TierState.WRITING
                moving = state in (BlockState.SWAPPING_IN, BlockState.SWAPPING_OUT)
                raw.tier[h] = TierCopy(entry.tier, kind, tuple(entry.stamp), entry.nbytes, moving)
        pools[pool.name] = raw
    return Snapshot(
        unit=cache.unit_tokens,
        hashes=hashes,
        held=[cache.index.holders(h) > 0 for h in hashes],
        forms=form_geoms(cache),
        pools=pools,
        caching=cache.config.enable_prefix_caching,
        prefetching=swap is not None and swap.prefetching,
        tiers_on=tiers is not None,
        bytes_in_flight=cache.recovery.bytes_in_flight,
        replay_in_flight=cache.recovery.replay_tokens_in_flight,
    )
