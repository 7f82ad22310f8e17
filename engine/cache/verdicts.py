"""Rewrites of a plan's per-form verdicts by callers that know more than the coordinator: a
refused deeper plan, a failed or in-flight swap-in (:func:`relabel`), objects a swap-in brought
back (:func:`mark_recovered`). Pure functions of frozen :class:`ResumePlan` values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from engine.cache.coordinator import ResumePlan, limiting_set, name_limiting
from engine.events import EVICTION_REASONS, Form, Outcome, Reason, Tier


def relabel(
    plan: ResumePlan, reasons: Mapping[Form, Reason], outcomes: Collection[Outcome] = (Outcome.INVALIDATED,)
) -> ResumePlan:
    """Give forms that lost tokens (outcome in ``outcomes``) the reason the caller knows better
    (a failed swap-in, a refused plan, a swap-in in flight); the limiting reason follows its
    form."""
    if not reasons:
        return plan
    forms = tuple(
        dataclasses.replace(f, reason=reasons[f.form]) if f.form in reasons and f.outcome in outcomes else f
        for f in plan.forms
    )
    if plan.limiting_forms:  # the named form may change with the reasons
        lost = {f.form: f.reason for f in forms if f.form in plan.limiting_forms}
        named = name_limiting(plan.limiting_forms, lost)
        return dataclasses.replace(plan, forms=forms, limiting_form=named, limiting_reason=lost[named])
    limiting = plan.limiting_reason
    lim = plan.limiting_form
    if lim is not None and lim in reasons and plan.form(lim).outcome in outcomes:
        limiting = reasons[lim]
    return dataclasses.replace(plan, forms=forms, limiting_reason=limiting)


def swapped_verdicts(
    after: ResumePlan,
    tier_view: ResumePlan,
    device: ResumePlan,
    moved: Mapping[Form, tuple[Tier, int, float]],
    failures: Mapping[Form, Reason],
    missing: Mapping[Form, Reason],
    left_device: Collection[Form] = (),
) -> ResumePlan:
    """The verdicts of a request that ran a swap-in: L* is ``after``'s (the device plan made
    again once the copies finished); every form whose copies arrived is judged in the tier view
    it was planned in (``tier_view``: device and lower tiers together), so its usable tokens
    are what it could have restored, not the part this swap-in needed.

    Per form: a failed copy keeps ``after``'s verdict with the failure's reason (``failures``);
    otherwise ``tier_view``'s verdict, with the tier, bytes and seconds of its swap-in
    (``moved``) and outcome ``recovered`` (reason: why its device copy was missing, from
    ``device``, else ``missing``) when it lost nothing in the tier view. A form that lost tokens
    because its state left the device (:data:`EVICTION_REASONS`, or a form in ``left_device``)
    while another form's state reached deeper reports ``tier_incomplete``: the tiers kept the
    others' objects, not its own.
    The limiting forms follow the usable tokens (:func:`~engine.cache.coordinator.limiting_set`).
    """
    forms = []
    for f in after.forms:
        if f.form in failures:
            if f.outcome is Outcome.INVALIDATED:
                f = dataclasses.replace(f, reason=failures[f.form])
            forms.append(f)
            continue
        v = tier_view.form(f.form)
        v = dataclasses.replace(v, recoverable_tokens=min(v.usable_tokens, after.resume_tokens))
        got = moved.get(f.form)
        if got is not None:
            tier, nbytes, seconds = got
            v = dataclasses.replace(v, tier=tier, bytes_moved=nbytes, recovery_seconds=seconds)
            if v.outcome is Outcome.HIT:
                prior = device.form(f.form).reason
                reason = prior if prior not in (Reason.NONE, Reason.NO_PREFIX_MATCH, Reason.PROMPT_END) else missing[f.form]
                v = dataclasses.replace(v, outcome=Outcome.RECOVERED, reason=reason)
        forms.append(v)
    deepest = max(f.usable_tokens for f in forms)
    forms = [
        dataclasses.replace(f, reason=Reason.TIER_INCOMPLETE)
        if f.outcome is Outcome.INVALIDATED
        and f.form not in failures
        and (f.reason in EVICTION_REASONS or f.form in left_device)
        and f.usable_tokens < deepest
        else f
        for f in forms
    ]
    lost = {f.form: f.reason for f in forms if f.outcome is Outcome.INVALIDATED}
    plan = dataclasses.replace(after, forms=tuple(forms))
    if not lost:
        return plan
    usable = {f.form: f.usable_tokens for f in forms}
    limiting = limiting_set(usable, lost, [f.form for f in forms])
    lim = name_limiting(limiting, lost)
    return dataclasses.replace(plan, limiting_form=lim, limiting_reason=lost[lim], limiting_forms=limiting)


def mark_recovered(
    plan: ResumePlan,
    before: ResumePlan,
    moved: Mapping[Form, tuple[Tier, int, float]],
    missing: Mapping[Form, Reason],
) -> ResumePlan:
    """Forms that resume in ``plan`` thanks to swapped-in objects (``moved``: the tier, bytes
    and seconds of their swap-in): those values, and outcome ``recovered`` with the reason their
    device copy was missing — from ``before``, else the form's ``missing`` reason
    (:attr:`FormSpec.missing_reason`) — unless they lost tokens past L* anyway."""
    forms = []
    for f in plan.forms:
        got = moved.get(f.form)
        if got is not None:
            tier, nbytes, seconds = got
            f = dataclasses.replace(f, tier=tier, bytes_moved=nbytes, recovery_seconds=seconds)
            if f.outcome is Outcome.HIT:  # one that still lost tokens past L* stays invalidated, with its bytes
                prior = before.form(f.form).reason
                reason = prior if prior not in (Reason.NONE, Reason.NO_PREFIX_MATCH, Reason.PROMPT_END) else missing[f.form]
                f = dataclasses.replace(f, outcome=Outcome.RECOVERED, reason=reason)
        forms.append(f)
    return dataclasses.replace(plan, forms=tuple(forms))
