"""A brute-force reason oracle for the prefix cache (issue 20, item 5).

INDEPENDENCE: the oracle shares no code with the cache's managers and never calls their resume
logic (no ``resume_at_most``, ``loss_reason``, ``needed_keys``, ``plan_resume``, planner, swap
controller plans, verdicts or Tail-Replay functions). It restates each form's resume rule from
docs/cache-forms.md over the raw contents a :class:`~tests.engine.reason_oracle_state.Snapshot`
holds, and tries every multiple of U. ``test_reason_oracle.py`` checks this with :mod:`ast`.

The rules it computes (the lead's statement of issue 20):

* target = min(hash hit, last multiple of U strictly before the prompt end);
* usable_f = the largest multiple of U ≤ target where every object form f reads exists intact
  (right hash and stamp) in the view: the device, plus readable tier copies for a swap-in;
* L* = the largest point ≤ target where every form can resume (Tail-Replay: the other forms'
  common point L, computation from L − R, as docs/cache-forms.md describes);
* a lost form's (usable < target) reason = why it cannot serve the HIGHEST point in
  (usable, target] where its state was ever stored (every object it lacks there was evicted,
  lost, is on a tier — also after a restart —, in flight or of another version);
  ``below_granularity`` when there is no such point. ``linear_state`` has none: a checkpoint
  evicted or never taken is ``linear_checkpoint_missing`` (case C1). An ``indexer_state`` point
  whose pending rows were never stored was never servable, whatever its key pages. At a
  point where every object the form lacks is being swapped in (waiting would serve it) the
  reason is ``in_flight_swap``; otherwise the copies in flight are left aside and the first
  other lacking object decides;
* a swap-in plan is judged in its tier view (tests/engine/reason_oracle_plans.py);
* limiting_forms = the lost forms with the smallest usable, in Form order; limiting_form = the
  first of them whose reason is not ``below_granularity``, else the first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.events import Form, Outcome, Reason, Tier
from tests.engine.reason_oracle_state import FormGeom, Snapshot, Stamp, TierState

FORM_ORDER = list(Form)
EVICTED = {
    Form.FULL_KV: Reason.KV_EVICTED,
    Form.SWA_WINDOW: Reason.SWA_EVICTED,
    Form.COMPRESSED_KV: Reason.COMPRESSED_EVICTED,
    Form.UNCOMPRESSED_TAIL: Reason.TAIL_MISSING,
    Form.INDEXER_STATE: Reason.INDEXER_STALE,
    Form.LINEAR_STATE: Reason.LINEAR_CHECKPOINT_MISSING,
}
"""The reason of a form whose object was evicted (also: what a recovered form reports)."""
STALE = {
    Form.COMPRESSED_KV: Reason.COMPRESSED_VERSION_MISMATCH,
    Form.UNCOMPRESSED_TAIL: Reason.TAIL_VERSION_MISMATCH,
    Form.INDEXER_STATE: Reason.INDEXER_STALE,
}


class Cause(Enum):
    OK = "ok"
    VERSION = "version"
    IN_FLIGHT = "in_flight"
    EVICTED = "evicted"
    FAILED = "failed"
    NEVER = "never"


@dataclass(frozen=True, slots=True)
class Obj:
    pool: str
    hash: bytes
    stamp: Stamp


@dataclass(slots=True)
class View:
    """Where objects count as present: the device, plus readable tier copies with ``tiers``;
    ``failed`` tier copies (a swap-in refused them) with their reason; ``vetoes``: forms that
    may resume nowhere (but at 0)."""

    snap: Snapshot
    tiers: bool = False
    failed: dict[tuple[str, bytes], Reason] = field(default_factory=dict)
    vetoes: dict[Form, Reason] = field(default_factory=dict)
    corrupt_disk: bool = False
    """Every disk file is corrupt (fault ``corrupt_offloaded_file``): no disk copy is intact."""


@dataclass(slots=True)
class Verdict:
    form: Form
    outcome: Outcome
    reason: Reason
    usable: int


@dataclass(slots=True)
class OraclePlan:
    hit: int
    target: int
    resume: int
    verdicts: dict[Form, Verdict]
    limiting_forms: tuple[Form, ...]
    limiting_form: Form | None
    limiting_reason: Reason
    replayed: int = 0


# -- the objects a resume reads -------------------------------------------------------------------
def _pages(g_pool: str, ratio: int, unit: int, hashes: list[bytes], p: int) -> list[Obj]:
    page = max(unit, ratio)
    b = p - p % ratio
    return [
        Obj(g_pool, hashes[(k + 1) * page // unit - 1], ((k + 1) * page,)) for k in range(b // page)
    ]


def _slot(geom: FormGeom, unit: int, hashes: list[bytes], p: int) -> list[Obj]:
    if p == 0 or geom.slot_pool is None:
        return []
    keeps = False
    versions: list[object] = []
    for g in geom.slot_groups:
        b = p - p % g.ratio
        keeps = keeps or p > b or (g.overlapping and b >= g.ratio)
        versions.append(hashes[b // unit - 1] if b else None)
    return [Obj(geom.slot_pool, hashes[p // unit - 1], (p, *versions))] if keeps else []


def needed(geom: FormGeom, unit: int, hashes: list[bytes], p: int) -> list[list[Obj]]:
    """The objects a resume at ``p`` reads, in groups (one per entry geometry, then the slot)."""
    f = geom.form
    if f is Form.FULL_KV:
        return [[Obj(geom.pools[0], hashes[i], ()) for i in range(p // unit)]]
    if f is Form.SWA_WINDOW:
        assert geom.window is not None
        first = max(0, p - geom.window + 1)
        return [[Obj(geom.pools[0], hashes[i], ()) for i in range(first // unit, p // unit)]]
    if f is Form.LINEAR_STATE:
        return [[Obj(geom.pools[0], hashes[p // unit - 1], ())] if p else []]
    groups = [_pages(g.pool or "", g.ratio, unit, hashes, p) for g in geom.entry_groups]
    if f is not Form.COMPRESSED_KV:
        groups.append(_slot(geom, unit, hashes, p))
    return groups


def status(obj: Obj, view: View) -> tuple[Cause, Reason | None]:
    raw = view.snap.pools[obj.pool]
    dev = raw.device.get(obj.hash)
    if dev is not None:
        return (Cause.OK, None) if dev == obj.stamp else (Cause.VERSION, None)
    failed = view.failed.get((obj.pool, obj.hash))
    if failed is not None:
        return Cause.FAILED, failed
    copy = raw.tier.get(obj.hash)
    if copy is not None and copy.stamp != obj.stamp:
        return Cause.VERSION, None
    if copy is not None and copy.state is TierState.READABLE:
        if view.tiers and view.corrupt_disk and copy.tier is Tier.DISK:
            return Cause.FAILED, Reason.OFFLOAD_CORRUPT
        return (Cause.OK, None) if view.tiers else (Cause.EVICTED, None)
    if copy is not None and copy.state is TierState.IN_FLIGHT:
        return Cause.IN_FLIGHT, None
    if copy is not None or obj.hash in raw.evicted:
        return Cause.EVICTED, None
    return Cause.NEVER, None


def _reason_of(form: Form, cause: Cause, failure: Reason | None) -> Reason:
    if cause is Cause.FAILED:
        assert failure is not None
        return failure
    if cause is Cause.IN_FLIGHT:
        return Reason.IN_FLIGHT_SWAP
    if cause is Cause.VERSION:
        return STALE.get(form, EVICTED[form])
    if cause is Cause.EVICTED:
        return EVICTED[form]
    return Reason.BELOW_GRANULARITY


def form_at(geom: FormGeom, p: int, view: View) -> tuple[bool, bool, Reason | None, Cause | None]:
    """(valid at p, state at p ever stored, the reason it cannot serve p when it was, and the
    cause of that reason)."""
    if geom.form in view.vetoes:
        return p == 0, p > 0, view.vetoes[geom.form] if p else None, Cause.FAILED if p else None
    snap = view.snap
    groups = [[status(o, view) for o in objs] for objs in needed(geom, snap.unit, snap.hashes, p)]
    bad = [[s for s in g if s[0] is not Cause.OK] for g in groups]
    if not any(bad):
        return True, True, None, None
    group_ok = (  # another group holds its own page on the device
        any(not b for b in bad[: len(geom.entry_groups)])
        if geom.form is Form.COMPRESSED_KV
        else False
    )
    if all(cause is Cause.IN_FLIGHT for b in bad for cause, _ in b):  # waiting would serve p
        return False, True, Reason.IN_FLIGHT_SWAP, Cause.IN_FLIGHT
    bad = [[s for s in b if s[0] is not Cause.IN_FLIGHT] for b in bad]  # what waiting would not fix
    reason: Reason | None = None
    first: Cause | None = None
    stored = True
    for b in bad:
        for cause, failure in b:
            if cause is Cause.NEVER and group_ok:
                r = Reason.GROUP_DISAGREE
            elif cause is Cause.NEVER and geom.form is Form.LINEAR_STATE:
                r = Reason.LINEAR_CHECKPOINT_MISSING  # never taken is missing too (case C1)
            elif cause is Cause.NEVER:
                stored = False
                continue
            else:
                r = _reason_of(geom.form, cause, failure)
            if reason is None:
                reason, first = r, cause
    return False, stored, reason if stored else None, first if stored else None


def left_device(geom: FormGeom, use: int, target: int, snap: Snapshot) -> bool:
    """Whether some object ``geom`` reads at a point in (``use``, ``target``] was stored and
    left the device (evicted, or only a lower tier holds it) — not never stored."""
    device = View(snap)
    u = snap.unit
    return any(
        status(o, device)[0] is Cause.EVICTED
        for p in range(target, use, -u)
        for objs in needed(geom, u, snap.hashes, p)
        for o in objs
    )


def usable(geom: FormGeom, target: int, view: View) -> int:
    u = view.snap.unit
    return next((p for p in range(target, 0, -u) if form_at(geom, p, view)[0]), 0)


def lost_cause(geom: FormGeom, use: int, target: int, view: View) -> tuple[Reason, Cause]:
    """A lost form's reason (module docstring) and the cause behind it (NEVER: none stored)."""
    u = view.snap.unit
    for p in range(target, use, -u):
        _, stored, reason, cause = form_at(geom, p, view)
        if stored and reason is not None and cause is not None:
            return reason, cause
    return Reason.BELOW_GRANULARITY, Cause.NEVER


def lost_reason(geom: FormGeom, use: int, target: int, view: View) -> Reason:
    return lost_cause(geom, use, target, view)[0]


def resume_limit(prompt_tokens: int, unit: int) -> int:
    return ((prompt_tokens - 1) // unit) * unit if prompt_tokens > 0 else 0


def hash_hit(snap: Snapshot) -> int:
    if not snap.caching:
        return 0
    last = max((i + 1 for i, held in enumerate(snap.held) if held), default=0)
    return last * snap.unit


def exact_plan(
    view: View, prompt_tokens: int, forms: list[FormGeom] | None = None, hit: int | None = None
) -> OraclePlan:
    """The exact plan over ``forms`` (default: every form of the snapshot); ``hit`` replaces
    the hash hit (tokens)."""
    snap = view.snap
    forms = snap.forms if forms is None else forms
    u = snap.unit
    hit = hash_hit(snap) if hit is None else hit
    target = min(hit, resume_limit(prompt_tokens, u))
    uses = {g.form: usable(g, target, view) for g in forms}
    # the points each form lost (low, high]: above its usable length, or for a form usable at
    # the target that lowered L* in the fixed point (docs step 3), where it landed to where asked
    lost = {g.form: (uses[g.form], target) for g in forms if uses[g.form] < target}
    resume, changed = target, True
    while changed:
        changed = False
        for g in forms:
            lowered = usable(g, resume, view)
            if lowered < resume:
                lost.setdefault(g.form, (lowered, resume))
                resume, changed = lowered, True
    verdicts: dict[Form, Verdict] = {}
    for g in forms:
        use = uses[g.form]
        if hit == 0:
            verdicts[g.form] = Verdict(g.form, Outcome.MISS, Reason.NO_PREFIX_MATCH, use)
        elif g.form in lost:
            low, high = lost[g.form]
            reason = lost_reason(g, low, high, view)
            verdicts[g.form] = Verdict(g.form, Outcome.INVALIDATED, reason, use)
        elif target == 0:
            verdicts[g.form] = Verdict(g.form, Outcome.INVALIDATED, Reason.PROMPT_END, use)
        else:
            verdicts[g.form] = Verdict(g.form, Outcome.HIT, Reason.NONE, use)
    plan = OraclePlan(hit, target, resume, verdicts, (), None, Reason.NONE)
    limiting(plan, list(lost) if hit and resume < target else [])
    return plan


def limiting(plan: OraclePlan, lost: list[Form]) -> None:
    """Set the plan's limiting forms, form and reason from its ``lost`` forms."""
    if lost:  # (forms usable at the target that lowered L* never have the smallest usable)
        low = min(plan.verdicts[f].usable for f in lost)
        tied = tuple(f for f in FORM_ORDER if f in lost and plan.verdicts[f].usable == low)
        real = [f for f in tied if plan.verdicts[f].reason is not Reason.BELOW_GRANULARITY]
        plan.limiting_forms = tied
        plan.limiting_form = (real or list(tied))[0]
        plan.limiting_reason = plan.verdicts[plan.limiting_form].reason
    else:
        plan.limiting_forms, plan.limiting_form = (), None
        if plan.hit == 0:
            plan.limiting_reason = Reason.NO_PREFIX_MATCH
        else:
            plan.limiting_reason = Reason.PROMPT_END if plan.target < plan.hit else Reason.NONE
