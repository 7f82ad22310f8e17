"""The indexer's sync delay (issue 23): how far a CSA indexer's state trails the main compressed
KV boundary where a lookup meets it, in tokens and in seconds.

A CSA layer keeps compressed KV (``compressed_kv``) and an indexer (``indexer_state``) whose
key pages and pending rows must be at the same boundary version (DESIGN.md §3). Key pages are
immutable once formed and stamped with the boundary they end at, so they never trail; the
indexer's pending rows are stored per boundary L (:class:`BoundarySlots`) and stamped with the
L they were taken at. A healthy engine stamps them with the L they are stored under; the
``lag_index`` fault (and any bug that stores the index late) stamps them behind, and such a
stale slot stays until the right rows replace it — later still when a request holds it.

The measurement (:func:`sync_delay`), once per request on the admitted plan
(:func:`with_sync_delay`, as :class:`~engine.cache.ghosts.GhostPricer`): from the main
compressed KV's own resume point (``compressed_kv``'s usable tokens) down to the indexer's, the
first point where a slot of the indexer is stored under the prefix's hash (on the device or a
lower tier) is the indexer state the lookup met. Per indexer group g (the CSA layers sharing one
indexer geometry, ratio r_g), its delay is ``⌊L/r_g⌋·r_g − ⌊S/r_g⌋·r_g`` tokens, S the slot's
stamped L: the main boundary minus the indexer's synced boundary, ≥ 0. Seconds: since that
slot was first stored out of step (:attr:`BoundarySlots.stale_since`; the slot never matched
since). A slot in step there, or none stored (evicted, below granularity), is delay 0: only a
trailing stamp is a sync delay, never an eviction.

Per layer: every layer of one indexer group shares its slots and stamps, so its delay is the
group's; an event carries the group trailing most (``layer_group``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from engine.cache.compressed import IndexerStateForm, boundary
from engine.cache.coordinator import ResumePlan
from engine.cache.hashing import BlockHash
from engine.events import Form

SCAN_POINTS = 64
"""Resume points (every U tokens down from the main compressed KV's) the scan tries at most."""


@dataclass(frozen=True, slots=True)
class SyncDelay:
    """The indexer's delay behind the main compressed KV boundary at one lookup."""

    layer_group: int
    """Index of the indexer group (``compressor_groups(specs, INDEXER)`` order) trailing most."""
    tokens: int
    """Main boundary minus the indexer's synced boundary, tokens (≥ 0; 0: in sync)."""
    seconds: float
    """Seconds since the indexer state there last matched (0: in sync, or not known)."""


IN_SYNC = SyncDelay(layer_group=0, tokens=0, seconds=0.0)


def sync_delay(indexer: IndexerStateForm, hashes: Sequence[BlockHash], main_tokens: int, indexer_tokens: int) -> SyncDelay:
    """The delay of ``indexer`` at the first point in ``(indexer_tokens, main_tokens]`` (every
    U from the top, at most :data:`SCAN_POINTS`) where one of its slots is stored under the
    prefix's hash (module docstring).

    Args:
        hashes: the prompt's hash chain (one hash per U tokens).
        main_tokens: the main compressed KV's own resume point (``compressed_kv``'s usable
            tokens), tokens.
        indexer_tokens: the indexer's own resume point (its usable tokens); at or below it the
            indexer is in step.

    Returns :data:`IN_SYNC` when nothing trails (never raises).
    """
    slots = indexer.slots
    u = slots.unit_tokens
    top = min(main_tokens - main_tokens % u, len(hashes) * u)
    for cand in range(top, indexer_tokens, -u)[:SCAN_POINTS]:
        stamp = slots.stamp_at(hashes, cand)
        if stamp is None or not isinstance(stamp[0], int):
            continue
        stamped = stamp[0]
        lags = [max(boundary(cand, g.spec.ratio) - boundary(stamped, g.spec.ratio), 0) for g in slots.groups]
        worst = max(range(len(lags)), key=lags.__getitem__, default=0)
        if not lags or lags[worst] == 0:
            return IN_SYNC  # in step there: the indexer lost something else (evicted, its keys)
        since = slots.stale_since.get(hashes[cand // u - 1])
        seconds = max(slots.clock() - since, 0.0) if since is not None else 0.0
        return SyncDelay(layer_group=worst, tokens=lags[worst], seconds=seconds)
    return IN_SYNC


def with_sync_delay(plan: ResumePlan, hashes: Sequence[BlockHash], indexer: IndexerStateForm | None) -> ResumePlan:
    """``plan`` with its ``indexer_state`` verdict carrying :func:`sync_delay` (measured between
    the plan's ``compressed_kv`` and ``indexer_state`` usable tokens); ``plan`` itself when the
    model has no indexer or nothing trails."""
    if indexer is None or not plan.hash_hit_tokens:
        return plan
    by_form = {f.form: f for f in plan.forms}
    main, own = by_form.get(Form.COMPRESSED_KV), by_form.get(Form.INDEXER_STATE)
    if main is None or own is None:
        return plan
    delay = sync_delay(indexer, hashes, main.usable_tokens, own.usable_tokens)
    if delay == IN_SYNC:
        return plan
    measured = dataclasses.replace(
        own, sync_delay_tokens=delay.tokens, sync_delay_seconds=delay.seconds, layer_group=delay.layer_group
    )
    return dataclasses.replace(plan, forms=tuple(measured if f is own else f for f in plan.forms))
