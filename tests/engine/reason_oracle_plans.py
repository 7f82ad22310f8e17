"""The oracle's plans for a lookup and for an admitted request (Tail-Replay, the claims of a
prefetch, swap-in, the admission's choice and its price), built on
:mod:`tests.engine.reason_oracle`.

INDEPENDENCE: as :mod:`tests.engine.reason_oracle` — raw contents and restated rules only. The
rules restated here (docs/cache-forms.md "Tail-Replay", "Host and disk tiers", "One request"):

* Tail-Replay: R = ``replay_fraction``·L rounded up to U, clamped; computation from L − R, where
  every other form must resume exactly; mode ``fallback`` only past the exact L*; refused when
  the replayed pages cannot fit the paged pools;
* an object in flight counts as stored: a lost form that lacks one at the highest point it
  lost where its state was stored says ``in_flight_swap`` (tests/engine/reason_oracle.py);
* a request's device plan: a form whose objects at the start a prefetch brought back is
  ``recovered``; a lost form whose matched prefix has a prefetched copy the tiers refused
  reports the refusal;
* admission: candidates device plan, exact plan (when the device plan replays, unless mode
  on/only forces the replay), swap-in (the tier view's deeper L*), cold; the cheapest one the
  recovery cap admits wins (ties: listed first); a refused deeper plan's forms report
  ``recovery_cap_reached`` (cap) or ``admission_recompute_cheaper``; ``lower_resume`` when a
  swap-in was possible and not taken;
* a swap-in is judged in its tier view: forms served that lost nothing there are ``recovered``
  with their tier-view usable; a copy that failed keeps the device verdict after the swap-in with
  the failure's reason; a lost form whose state left the device (an eviction reason; for
  ``linear_state`` a checkpoint taken and evicted) while another form reaches deeper:
  ``tier_incomplete``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from engine.cache.admission import CostModel
from engine.cache.config import CacheConfig
from engine.cache.memory_plan import window_pages_needed
from engine.events import Admission, Form, Outcome, Reason, Tier
from engine.faults import Faults
from tests.engine.reason_oracle import (
    EVICTED,
    Cause,
    OraclePlan,
    Verdict,
    View,
    exact_plan,
    form_at,
    left_device,
    limiting,
    needed,
    resume_limit,
    status,
)
from tests.engine.reason_oracle_state import PoolRaw, Snapshot, TierCopy

TIER_INCOMPLETE_FROM = frozenset(
    {Reason.KV_EVICTED, Reason.SWA_EVICTED, Reason.COMPRESSED_EVICTED, Reason.TAIL_MISSING}
)
"""Reasons that say a form's state left the device (``linear_state``: asked of its raw data)."""


@dataclasses.dataclass(slots=True)
class Expected:
    """The oracle's plan, admission and predicted seconds (None: not compared)."""

    plan: OraclePlan
    admission: Admission | None = None
    predicted_seconds: float | None = None


def replay_tokens(config: CacheConfig, point: int) -> int:
    u = config.unit_tokens
    low = -(-config.replay_min_tokens // u) * u
    high = max(u, config.replay_max_tokens - config.replay_max_tokens % u)
    return min(max(-(-math.ceil(config.replay_fraction * point) // u) * u, low), high)


def _lost(plan: OraclePlan) -> list[Form]:
    return [f for f, v in plan.verdicts.items() if v.outcome is Outcome.INVALIDATED]


def relimit(plan: OraclePlan) -> None:
    """Name the limiting form again among the same limiting forms (their reasons changed)."""
    if plan.limiting_forms:
        limiting(plan, list(plan.limiting_forms))


def device_plan(
    view: View, prompt: int, config: CacheConfig, output: int = 0, replay: bool = True
) -> OraclePlan:
    """The device's plan (what ``lookup`` answers): exact, or Tail-Replay when it applies."""
    return _device_plan(view, prompt, config, output, replay)


def _device_plan(
    view: View, prompt: int, config: CacheConfig, output: int, replay: bool
) -> OraclePlan:
    exact = exact_plan(view, prompt)
    snap = view.snap
    forms = {g.form: g for g in snap.forms}
    if not replay or config.tail_replay == "off" or Form.LINEAR_STATE not in forms or not exact.hit:
        return exact
    if Form.LINEAR_STATE in view.vetoes:
        return exact
    others = [g for g in snap.forms if g.form is not Form.LINEAR_STATE]
    if not others:
        return exact
    alt = exact_plan(view, prompt, others)
    point = alt.resume
    r = replay_tokens(config, point)
    start = point - r
    if point <= exact.resume or start <= 0 or not all(form_at(g, start, view)[0] for g in others):
        return exact
    if config.tail_replay == "fallback" and start <= exact.resume:
        return exact
    u = snap.unit
    total = prompt + output
    for g in others:
        if g.form is Form.FULL_KV and -(-total // u) + r // u > config.full_kv_blocks - 1:
            return exact
        if g.form is Form.SWA_WINDOW and g.window is not None:
            pinned = point // u - max(0, point - g.window + 1) // u
            if pinned + window_pages_needed(config, g.window, output) > config.swa_blocks - 1:
                return exact
    lin = exact.verdicts[Form.LINEAR_STATE]
    reason = lin.reason if lin.reason is not Reason.NONE else Reason.LINEAR_CHECKPOINT_MISSING
    verdicts = dict(alt.verdicts)
    verdicts[Form.LINEAR_STATE] = Verdict(Form.LINEAR_STATE, Outcome.REPLAYED, reason, lin.usable)
    plan = OraclePlan(
        exact.hit, exact.target, point, {f: verdicts[f] for f in forms}, (), None, Reason.NONE,
        replayed=r,
    )  # fmt: skip
    plan.limiting_forms = alt.limiting_forms  # the other forms' limit, else the replayed form
    plan.limiting_form, plan.limiting_reason = alt.limiting_form, alt.limiting_reason
    if alt.limiting_form is None:
        plan.limiting_forms, plan.limiting_form = (Form.LINEAR_STATE,), Form.LINEAR_STATE
        plan.limiting_reason = reason
    return plan


def moved(view: View, resume: int) -> dict[Form, list[tuple[str, bytes, TierCopy]]]:
    """Per form, the tier copies a swap-in to ``resume`` brings back (not on the device)."""
    snap = view.snap
    device = View(snap)
    out: dict[Form, list[tuple[str, bytes, TierCopy]]] = {}
    for g in snap.forms:
        for objs in needed(g, snap.unit, snap.hashes, resume):
            for o in objs:
                if status(o, device)[0] is not Cause.OK:
                    copy = snap.pools[o.pool].tier[o.hash]
                    out.setdefault(g.form, []).append((o.pool, o.hash, copy))
    return out


def claims(snap: Snapshot, plan: OraclePlan) -> None:
    """What a request's admission adds to its device plan: ``recovered`` for forms whose objects
    at the start a prefetch brought back; a lost form that lacks, at the first point it lost, an
    object whose prefetched copy the tiers refused reports the refusal."""
    start = plan.resume - plan.replayed
    for g in snap.forms:
        v = plan.verdicts[g.form]
        objs = [o for grp in needed(g, snap.unit, snap.hashes, start) for o in grp] if start else []
        if v.outcome is Outcome.HIT and any(o.hash in snap.pools[o.pool].restored for o in objs):
            v.outcome, v.reason = Outcome.RECOVERED, EVICTED[g.form]
    for g in snap.forms:
        v = plan.verdicts[g.form]
        first = v.usable + snap.unit  # the first point it lost
        if v.outcome is not Outcome.INVALIDATED or first > plan.hit:
            continue
        objs = [o for grp in needed(g, snap.unit, snap.hashes, first) for o in grp]
        raws = [snap.pools[o.pool] for o in objs]
        refused = [r.refused[o.hash] for o, r in zip(objs, raws, strict=True) if o.hash in r.refused and o.hash not in r.device]
        if refused:
            v.reason = refused[0]
    relimit(plan)


def _after(snap: Snapshot, items: dict[Form, list[tuple[str, bytes, TierCopy]]], failed: set[tuple[str, bytes]]) -> Snapshot:
    """The snapshot after a swap-in: every copy not in ``failed`` on the device, the failed
    copies' entries dropped."""
    pools: dict[str, PoolRaw] = dict(snap.pools)
    for objs in items.values():
        for pool, h, copy in objs:
            raw = pools[pool]
            if (pool, h) in failed:
                tier = {k: c for k, c in raw.tier.items() if k != h}
                pools[pool] = dataclasses.replace(raw, tier=tier)
            else:
                pools[pool] = dataclasses.replace(raw, device=raw.device | {h: copy.stamp})
    return dataclasses.replace(snap, pools=pools)


def swap_in(
    snap: Snapshot, prompt: int, device: OraclePlan, vetoes: Mapping[Form, Reason], faults: Faults
) -> OraclePlan:
    """The verdicts of a request that ran the swap-in (module docstring)."""
    tier = exact_plan(View(snap, tiers=True, vetoes=dict(vetoes)), prompt, hit=device.hit)
    items = moved(View(snap, tiers=True), tier.resume)
    failures: dict[Form, Reason] = {}
    failed: set[tuple[str, bytes]] = set()
    for form, objs in items.items():
        for pool, h, c in objs:
            if faults.corrupt_offloaded_file and c.tier is Tier.DISK:  # every disk file is corrupt
                failures[form] = Reason.OFFLOAD_CORRUPT
                failed.add((pool, h))
    geoms = {g.form: g for g in snap.forms}
    after_snap = _after(snap, items, failed)
    after = exact_plan(View(after_snap, vetoes=dict(vetoes)), prompt, hit=device.hit)
    verdicts: dict[Form, Verdict] = {}
    for form, v in tier.verdicts.items():
        if form in failures:
            w = dataclasses.replace(after.verdicts[form])
            if w.outcome is Outcome.INVALIDATED:
                w.reason = failures[form]
            verdicts[form] = w
            continue
        w = dataclasses.replace(v)
        if form in items and w.outcome is Outcome.HIT:
            prior = device.verdicts[form].reason
            keep = prior not in (Reason.NONE, Reason.NO_PREFIX_MATCH, Reason.PROMPT_END)
            w.outcome, w.reason = Outcome.RECOVERED, prior if keep else EVICTED[form]
        verdicts[form] = w
    deepest = max(v.usable for v in verdicts.values())
    target = min(device.hit, resume_limit(prompt, snap.unit))
    for form, w in verdicts.items():
        if form in failures or w.outcome is not Outcome.INVALIDATED or w.usable >= deepest:
            continue
        linear = form is Form.LINEAR_STATE and left_device(geoms[form], w.usable, target, snap)
        if w.reason in TIER_INCOMPLETE_FROM or linear:
            w.reason = Reason.TIER_INCOMPLETE
    plan = dataclasses.replace(after, verdicts=verdicts)
    lost = _lost(plan)
    if lost:
        limiting(plan, lost)
    return plan


def swap_bytes(snap: Snapshot, tier_resume: int) -> dict[Tier, int]:
    out: dict[Tier, int] = {}
    for objs in moved(View(snap, tiers=True), tier_resume).values():
        for _, _, c in objs:
            out[c.tier] = out.get(c.tier, 0) + c.nbytes
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class _Option:
    admission: Admission
    start: int
    nbytes: dict[Tier, int]
    replay: int
    seconds: float


def _price(costs: CostModel, admission: Admission, start: int, prompt: int, nbytes: dict[Tier, int], replay: int) -> _Option:
    """The price of one plan: prefill from ``start`` plus the bytes over each tier's bandwidth
    (the driver's cost models have no per-chunk and no per-object cost)."""
    assert not costs.seconds_per_chunk and not costs.seconds_per_token_pair
    swap = sum(n / costs.tier_bytes_per_second[t] for t, n in nbytes.items() if n)
    return _Option(admission, start, nbytes, replay, costs.seconds_per_token * max(0, prompt - start) + swap)


def _admits(snap: Snapshot, config: CacheConfig, o: _Option) -> bool:
    nbytes = sum(o.nbytes.values())
    if config.max_recovery_bytes is not None and nbytes and snap.bytes_in_flight + nbytes > config.max_recovery_bytes:
        return False
    cap = config.max_replay_tokens
    return not (cap is not None and o.replay and snap.replay_in_flight + o.replay > cap)


def request_plan(
    snap: Snapshot,
    prompt: int,
    config: CacheConfig,
    costs: CostModel | None,
    faults: Faults,
    vetoes: Mapping[Form, Reason] | None = None,
    output: int = 0,
) -> Expected:
    """What a request's events must say, admitted over ``snap`` (taken when its admission
    started) with ``vetoes`` (a stale lease's ``epoch_changed``, validation failures)."""
    vetoes = dict(vetoes or {})
    device = device_plan(View(snap, vetoes=vetoes), prompt, config, output)
    if snap.tiers_on:
        claims(snap, device)
    exact = device
    if device.replayed:
        exact = device_plan(View(snap, vetoes=vetoes), prompt, config, output, replay=False)
    model = costs or CostModel(seconds_per_token=1.0)
    start = device.resume - device.replayed
    kind = Admission.TAIL_REPLAY if device.replayed else Admission.EXACT if device.resume else Admission.COLD
    if kind is Admission.EXACT and any(v.outcome is Outcome.RECOVERED for v in device.verdicts.values()):
        kind = Admission.SWAP_IN
    options = [_price(model, kind, start, prompt, {}, device.replayed)]
    forced = config.tail_replay in ("on", "only") and _admits(snap, config, options[0])
    if exact is not device and not forced:
        kind_exact = Admission.EXACT if exact.resume else Admission.COLD
        options.append(_price(model, kind_exact, exact.resume, prompt, {}, 0))
    tier: OraclePlan | None = None
    if snap.tiers_on and device.hit:
        tier = exact_plan(View(snap, tiers=True, vetoes=vetoes), prompt, hit=device.hit)
        if tier.resume <= start:
            tier = None
        else:
            options.append(_price(model, Admission.SWAP_IN, tier.resume, prompt, swap_bytes(snap, tier.resume), 0))
    options.append(_price(model, Admission.COLD, 0, prompt, {}, 0))
    admitted = [o for o in options if _admits(snap, config, o)]
    best = min(admitted, key=lambda o: o.seconds)
    why = {o.admission: Reason.ADMISSION_RECOMPUTE_CHEAPER for o in admitted if o is not best}
    why |= {o.admission: Reason.RECOVERY_CAP_REACHED for o in options if o not in admitted}
    predicted = best.seconds if costs is not None else 0.0
    if best.admission is Admission.SWAP_IN and tier is not None and best is options[-2]:
        return Expected(swap_in(snap, prompt, device, vetoes, faults), Admission.SWAP_IN, predicted)
    index = options.index(best)
    if index == 0:
        plan = device
    elif index == len(options) - 1:
        cold = dict.fromkeys((g.form for g in snap.forms), Reason.ADMISSION_RECOMPUTE_CHEAPER)
        plan = exact_plan(View(snap, vetoes=cold), prompt)
    else:
        plan = exact
    relabels: dict[Form, Reason] = {}
    if device.replayed and plan is not device and Admission.TAIL_REPLAY in why:
        relabels[Form.LINEAR_STATE] = why[Admission.TAIL_REPLAY]
    if tier is not None and Admission.SWAP_IN in why:
        relabels |= dict.fromkeys(moved(View(snap, tiers=True), tier.resume), why[Admission.SWAP_IN])
    for form, reason in relabels.items():
        v = plan.verdicts[form]
        if v.outcome is Outcome.INVALIDATED:
            v.reason = reason
    relimit(plan)
    admission = best.admission
    if admission is not Admission.TAIL_REPLAY and tier is not None and plan.resume:
        admission = Admission.LOWER_RESUME
    return Expected(plan, admission, predicted)
