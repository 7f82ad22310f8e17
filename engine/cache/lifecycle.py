"""The block/object lifecycle: one transition table and the one function that applies it.

Every cached object (a page of a KV form, a recurrent checkpoint slot) moves through

``FREE → WRITING → RESIDENT (in use) ↔ CACHED (evictable) → SWAPPING_OUT → OFFLOADED (host or
disk) → SWAPPING_IN (in flight) → RESIDENT``, plus ``INVALID``

(DESIGN.md §4, "Cache core"; the in-use / evictable split and the ref-count rules follow vLLM
v1's block pool). :data:`TRANSITIONS` maps ``(state, event)`` to the next state, with each
step's precondition and rollback path; :func:`transition` is the only code that changes a
state. ``python -m engine.cache.lifecycle > docs/cache-lifecycle.md`` renders the table.

**Epoch rule.** A block's epoch names one incarnation of what it holds. It is bumped by every
transition after which a lease holder that read the epoch before could see different bytes, or
an object that no longer exists: a new object is written (``allocate``), the object is dropped
(``evict``) or declared wrong (``invalidate``); a tier entry's also when it is created
(``swap_out_begin``) or dropped after a failed copy (``swap_fail``). Publishing, leasing, releasing
and copying keep the bytes, so they keep the epoch. Epochs are reported with every lookup. Between a lookup and its leases the cache
re-checks the pools it planned on (``BlockPool.version``) and degrades a form that changed to
recompute with reason ``epoch_changed`` (DESIGN.md §4, red line 3 "TOCTOU"); once leased, an
object can only be invalidated, which bumps its epoch.

**Tiers.** A device block only ever holds an object in ``WRITING``, ``RESIDENT`` or ``CACHED``;
the swap states belong to *tier entries* (:mod:`engine.cache.tiers`), the copies of objects in
host memory or on disk, which go through the same table. An object's path down and back up is
``CACHED`` (device block) → evicted with a tier: entry ``SWAPPING_OUT → OFFLOADED``, device block
``FREE`` → swap-in: entry ``SWAPPING_IN``, a freshly allocated device block ``WRITING`` → copy
verified: device block ``RESIDENT``, entry ``OFFLOADED`` again (tiers are inclusive).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, MutableSequence
from dataclasses import dataclass
from types import MappingProxyType


class BlockState(enum.StrEnum):
    """Where a block's object is in its lifecycle (DESIGN.md §4); meanings in :data:`MEANING`."""

    FREE = "FREE"
    WRITING = "WRITING"
    RESIDENT = "RESIDENT"
    CACHED = "CACHED"
    SWAPPING_OUT = "SWAPPING_OUT"
    OFFLOADED = "OFFLOADED"
    SWAPPING_IN = "SWAPPING_IN"
    INVALID = "INVALID"


MEANING: Mapping[BlockState, str] = MappingProxyType(
    {
        BlockState.FREE: "holds nothing; ref 0; handed out before any evictable block",
        BlockState.WRITING: "leased by its writer and being filled; not findable by hash",
        BlockState.RESIDENT: "published (findable by hash) and leased by at least one request",
        BlockState.CACHED: "published, ref 0: findable and evictable",
        BlockState.SWAPPING_OUT: "being copied to a lower tier (host or disk); the device copy is intact",
        BlockState.OFFLOADED: "only a lower tier (host or disk) holds the bytes; a hit costs a swap-in",
        BlockState.SWAPPING_IN: "being copied back from a lower tier into a device block",
        BlockState.INVALID: "not findable, never to be read again; its remaining leases drain, then "
        "it is FREE (the sentinel block is permanently INVALID)",
    }
)


class Event(enum.StrEnum):
    """What happens to a block; the table below says from which states it is allowed."""

    ALLOCATE = "allocate"
    PUBLISH = "publish"
    LEASE = "lease"
    RELEASE = "release"
    RELEASE_LAST = "release_last"
    EVICT = "evict"
    INVALIDATE = "invalidate"
    RECLAIM = "reclaim"
    SWAP_OUT_BEGIN = "swap_out_begin"
    SWAP_OUT_DONE = "swap_out_done"
    SWAP_IN_BEGIN = "swap_in_begin"
    SWAP_IN_DONE = "swap_in_done"
    SWAP_FAIL = "swap_fail"
    SWAP_CANCEL = "swap_cancel"


@dataclass(frozen=True, slots=True, kw_only=True)
class Transition:
    """One row of the table: ``source --event--> target``.

    ``precondition`` is what the caller guarantees (ref counts, queues, hash map);
    ``rollback`` says what undoes the step or what happens when it fails.
    """

    source: BlockState
    event: Event
    target: BlockState
    bumps_epoch: bool
    precondition: str
    rollback: str


S = BlockState
E = Event

_ROWS = (
    Transition(
        source=S.FREE, event=E.ALLOCATE, target=S.WRITING, bumps_epoch=True,
        precondition="ref 0, unpublished, taken from the front of the free queue; ref becomes 1",
        rollback="release_last returns it to FREE (front of the queue); nothing was published",
    ),
    Transition(
        source=S.WRITING, event=E.PUBLISH, target=S.RESIDENT, bumps_epoch=False,
        precondition="leased by its writer, fully written, no other block cached under the hash",
        rollback="on a hash collision the publish is refused and the block stays WRITING; "
        "afterwards invalidate withdraws it",
    ),
    Transition(
        source=S.WRITING, event=E.LEASE, target=S.WRITING, bumps_epoch=False,
        precondition="ref > 0 (another holder of an unpublished block); ref + 1",
        rollback="release",
    ),
    Transition(
        source=S.WRITING, event=E.RELEASE, target=S.WRITING, bumps_epoch=False,
        precondition="ref > 1; ref − 1",
        rollback="lease",
    ),
    Transition(
        source=S.WRITING, event=E.RELEASE_LAST, target=S.FREE, bumps_epoch=False,
        precondition="ref 1 → 0, never published: the content is discarded, front of the free queue",
        rollback="none: the bytes are garbage; the next allocate bumps the epoch",
    ),
    Transition(
        source=S.RESIDENT, event=E.LEASE, target=S.RESIDENT, bumps_epoch=False,
        precondition="ref > 0 (a lookup hit on a block in use); ref + 1",
        rollback="release",
    ),
    Transition(
        source=S.RESIDENT, event=E.RELEASE, target=S.RESIDENT, bumps_epoch=False,
        precondition="ref > 1; ref − 1",
        rollback="lease",
    ),
    Transition(
        source=S.RESIDENT, event=E.RELEASE_LAST, target=S.CACHED, bumps_epoch=False,
        precondition="ref 1 → 0: joins the evictable queue of its priority at the most recently "
        "used end",
        rollback="lease (a later hit) takes it out of the queue again",
    ),
    Transition(
        source=S.RESIDENT, event=E.INVALIDATE, target=S.INVALID, bumps_epoch=True,
        precondition="ref > 0; the hash is unmapped and on_evict is called",
        rollback="none: holders see the epoch change and recompute; the last release reclaims it",
    ),
    Transition(
        source=S.CACHED, event=E.LEASE, target=S.RESIDENT, bumps_epoch=False,
        precondition="ref 0 → 1 (a lookup hit): leaves the evictable queue",
        rollback="release_last puts it back at the most recently used end",
    ),
    Transition(
        source=S.CACHED, event=E.EVICT, target=S.FREE, bumps_epoch=True,
        precondition="ref 0, the lowest-priority least recently used evictable block, taken "
        "by an allocation; hash unmapped, on_evict called",
        rollback="none: the object is gone; a request that needs it recomputes it",
    ),
    Transition(
        source=S.CACHED, event=E.INVALIDATE, target=S.FREE, bumps_epoch=True,
        precondition="ref 0: leaves the evictable queue, hash unmapped, on_evict called; front "
        "of the free queue",
        rollback="none: the object is gone; a request that needs it recomputes it",
    ),
    Transition(
        source=S.FREE, event=E.SWAP_OUT_BEGIN, target=S.SWAPPING_OUT, bumps_epoch=True,
        precondition="(a tier entry) a cached device block is about to be evicted or offloaded on "
        "request: its bytes are snapshotted into a staging buffer (fenced after every write to the "
        "source) before the device block can be reused; the copy to host memory or a file runs",
        rollback="swap_fail drops the entry; the device copy was intact until its eviction",
    ),
    Transition(
        source=S.SWAPPING_OUT, event=E.SWAP_OUT_DONE, target=S.OFFLOADED, bumps_epoch=False,
        precondition="(a tier entry) the copy completed (a file: written, checksummed, renamed into "
        "place); the entry becomes findable by hash in its tier; the staging buffer is reusable",
        rollback="evict or invalidate drops it",
    ),
    Transition(
        source=S.SWAPPING_OUT, event=E.SWAP_FAIL, target=S.FREE, bumps_epoch=True,
        precondition="(a tier entry) the copy failed (disk full, write error); nothing was published",
        rollback="none: the object is gone; a request that needs it recomputes it",
    ),
    Transition(
        source=S.OFFLOADED, event=E.SWAP_IN_BEGIN, target=S.SWAPPING_IN, bumps_epoch=False,
        precondition="(a tier entry) a device block was allocated for it (WRITING, leased by the "
        "swap-in, not findable) and the copy enqueued; a lookup that needs it waits or lowers L* "
        "(in_flight_swap)",
        rollback="swap_fail drops the entry and gives the device block back",
    ),
    Transition(
        source=S.SWAPPING_IN, event=E.SWAP_IN_DONE, target=S.OFFLOADED, bumps_epoch=False,
        precondition="(a tier entry) the copy completed and the checksum and layout fingerprint "
        "matched; the device block is published (RESIDENT) with the entry's stamp; the tier keeps "
        "its copy (inclusive), so a later eviction of the device copy copies nothing",
        rollback="none needed: the device copy is a new incarnation (its allocate bumped the epoch)",
    ),
    Transition(
        source=S.SWAPPING_IN, event=E.SWAP_CANCEL, target=S.OFFLOADED, bumps_epoch=False,
        precondition="(a tier entry) the swap-in was called off before its copy was enqueued (no "
        "device block could be had); the entry is intact",
        rollback="swap_in_begin may be retried",
    ),
    Transition(
        source=S.SWAPPING_IN, event=E.SWAP_FAIL, target=S.FREE, bumps_epoch=True,
        precondition="(a tier entry) checksum or fingerprint mismatch, or an unreadable file: the "
        "entry is dropped, the device block is given back unpublished; the request's form lowers "
        "L* (offload_corrupt / layout_mismatch)",
        rollback="none: the object is gone; a request that needs it recomputes it",
    ),
    Transition(
        source=S.OFFLOADED, event=E.EVICT, target=S.FREE, bumps_epoch=True,
        precondition="(a tier entry) the tier needs the room: the least recently used entry is "
        "dropped (a host entry may move to disk instead); hash unmapped",
        rollback="none: the object is gone; a request that needs it recomputes it",
    ),
    Transition(
        source=S.OFFLOADED, event=E.INVALIDATE, target=S.FREE, bumps_epoch=True,
        precondition="(a tier entry) its device copy was declared wrong, or its file failed to "
        "verify: the lower-tier copy is dropped; hash unmapped",
        rollback="none: the object is gone; a request that needs it recomputes it",
    ),
    Transition(
        source=S.INVALID, event=E.RELEASE, target=S.INVALID, bumps_epoch=False,
        precondition="ref > 1; ref − 1",
        rollback="none: an INVALID block takes no new lease",
    ),
    Transition(
        source=S.INVALID, event=E.RECLAIM, target=S.FREE, bumps_epoch=False,
        precondition="its last lease dropped (ref 1 → 0); front of the free queue",
        rollback="none: the next allocate bumps the epoch",
    ),
)
del S, E

TRANSITIONS: Mapping[tuple[BlockState, Event], Transition] = MappingProxyType(
    {(t.source, t.event): t for t in _ROWS}
)
"""The transition table: ``(state, event) → Transition``. A pair that is absent is illegal."""

_HINTS: Mapping[tuple[BlockState, Event], str] = MappingProxyType(
    {
        (BlockState.FREE, Event.RELEASE_LAST): "double free: it holds no lease",
        (BlockState.CACHED, Event.RELEASE_LAST): "double free: it holds no lease",
        (BlockState.FREE, Event.LEASE): "it is free and holds nothing",
        (BlockState.INVALID, Event.LEASE): "it was invalidated; look the hash up again",
        (BlockState.FREE, Event.PUBLISH): "it is not leased",
        (BlockState.CACHED, Event.PUBLISH): "it is not leased (and already published)",
        (BlockState.RESIDENT, Event.PUBLISH): "it is already published",
        (BlockState.INVALID, Event.PUBLISH): "it was invalidated",
    }
)
"""Why a common illegal pair is wrong, for the error message (the table alone decides)."""


class IllegalTransition(RuntimeError):
    """An event that the transition table does not allow from the block's current state.

    This is an internal invariant violation (a caller bug), never a user error.
    """

    def __init__(self, owner: str, block: int, state: BlockState, event: Event) -> None:
        self.owner = owner
        self.block = block
        self.state = state
        self.event = event
        allowed = ", ".join(sorted(e for (s, e) in TRANSITIONS if s is state)) or "none"
        hint = _HINTS.get((state, event))
        why = f": {hint}" if hint else ""
        super().__init__(
            f"{owner}: block {block} is {state}; event {event} is not allowed{why} "
            f"(allowed from {state}: {allowed})"
        )


def rule(owner: str, block: int, state: BlockState, event: Event) -> Transition:
    """The table row for ``(state, event)``; changes nothing.

    Raises:
        IllegalTransition: the pair is not in :data:`TRANSITIONS`.
    """
    t = TRANSITIONS.get((state, event))
    if t is None:
        raise IllegalTransition(owner, block, state, event)
    return t


def transition(
    states: MutableSequence[BlockState],
    epochs: MutableSequence[int],
    block: int,
    event: Event,
    *,
    owner: str = "",
) -> BlockState:
    """Apply ``event`` to ``block``: check the table, set the new state, bump the epoch when the
    row says so (see the module's epoch rule). Returns the new state.

    Ref counts, queues and the hash map are the caller's; the row's precondition says what the
    caller must have checked.

    Raises:
        IllegalTransition: the event is not allowed from the block's state (nothing changes).
    """
    t = rule(owner, block, states[block], event)
    states[block] = t.target
    if t.bumps_epoch:
        epochs[block] += 1
    return t.target


def render_markdown() -> str:
    """The lifecycle as Markdown: a Mermaid ``stateDiagram-v2`` and the table of transitions
    with their preconditions and rollback paths (``docs/cache-lifecycle.md``)."""
    edges: dict[tuple[BlockState, BlockState], list[str]] = {}
    for t in _ROWS:
        edges.setdefault((t.source, t.target), []).append(t.event.value)
    lines = [
        "# Cache block lifecycle",
        "",
        "<!-- Generated by `python -m engine.cache.lifecycle > docs/cache-lifecycle.md`; "
        "do not edit by hand. -->",
        "",
        "Every state change of a cached object goes through `engine.cache.lifecycle.transition`, "
        "which checks this table (DESIGN.md §4, \"Cache core\"). A pair not listed raises "
        "`IllegalTransition`. Device blocks (`BlockPool`) use every event except the swap events; "
        "those belong to tier entries, the copies of objects in host memory or on disk "
        "(`engine.cache.tiers`). An object goes down and back up as: device block `CACHED` → "
        "evicted with a tier: entry `SWAPPING_OUT → OFFLOADED`, device block `FREE` → swap-in: "
        "entry `SWAPPING_IN`, a new device block `WRITING` → verified: device block `RESIDENT`, "
        "entry `OFFLOADED` again (the tiers are inclusive). The sentinel block 0 is permanently "
        "`INVALID`.",
        "",
        "**Epoch rule.** The epoch is bumped by `allocate`, `evict`, `invalidate`, and for a "
        "tier entry `swap_out_begin` and `swap_fail`: after them a lease holder could see different bytes or an object that "
        "no longer exists. Between a lookup and its leases the cache re-checks the pools it "
        "planned on and degrades a changed form to recompute (`epoch_changed`).",
        "",
        "```mermaid",
        "stateDiagram-v2",
        "    [*] --> FREE",
    ]
    for (source, target), events in edges.items():
        lines.append(f"    {source} --> {target}: {' / '.join(events)}")
    lines += [
        "```",
        "",
        "| state | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{state}` | {meaning} |" for state, meaning in MEANING.items()]
    lines += [
        "",
        "| from | event | to | epoch | precondition | rollback |",
        "|---|---|---|---|---|---|",
    ]
    for t in _ROWS:
        bump = "+1" if t.bumps_epoch else ""
        lines.append(
            f"| `{t.source}` | `{t.event}` | `{t.target}` | {bump} | {t.precondition} | {t.rollback} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(render_markdown())
