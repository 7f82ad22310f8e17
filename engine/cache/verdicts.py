"""Rewrites of a plan's per-form verdicts by callers that know more than the coordinator: a
refused deeper plan, a failed or in-flight swap-in (:func:`relabel`), objects a swap-in brought
back (:func:`mark_recovered`). Pure functions of frozen :class:`ResumePlan` values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from engine.cache.coordinator import ResumePlan
from engine.events import Form, Outcome, Reason, Tier


def relabel(plan: ResumePlan, reasons: Mapping[Form, Reason]) -> ResumePlan:
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
