"""The resume point L* every form agrees on, and the per-form verdicts (DESIGN.md §3).

L* is a fixed point: start from the hash hit (capped at the last U boundary strictly before the
prompt end, so at least one token is computed and no state that already includes the last token
is applied again — case C3), let each form lower it to its own largest valid point, repeat until
no form lowers it. For a downward-closed form (``full_kv``) one pass suffices; a window or a set
of checkpoints is not downward closed, hence the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.cache.forms import CacheForm
from engine.cache.hashing import BlockHash
from engine.events import Form, Outcome, Reason


@dataclass(frozen=True, slots=True, kw_only=True)
class FormLookup:
    """One form's verdict for one request (becomes a ``cache_lookup`` event).

    ``usable_tokens``: this form's own longest exact resume ≤ the hash hit (capped at the prompt's
    resume limit); ``recoverable_tokens``: min(usable, L*).
    """

    form: Form
    outcome: Outcome
    reason: Reason
    usable_tokens: int
    recoverable_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumePlan:
    """The lookup result of one request, before any lease is taken."""

    prompt_tokens: int
    hash_hit_tokens: int
    resume_tokens: int
    limiting_form: Form | None
    limiting_reason: Reason
    forms: tuple[FormLookup, ...]

    def form(self, form: Form) -> FormLookup:
        for f in self.forms:
            if f.form == form:
                return f
        raise KeyError(form)


def resume_limit(prompt_tokens: int, unit_tokens: int) -> int:
    """The last multiple of U strictly before the prompt end (0 for an empty prompt)."""
    if prompt_tokens <= 0:
        return 0
    return ((prompt_tokens - 1) // unit_tokens) * unit_tokens


def plan_resume(
    forms: Sequence[CacheForm],
    hashes: Sequence[BlockHash],
    prompt_tokens: int,
    hash_hit_tokens: int,
    unit_tokens: int,
) -> ResumePlan:
    """Compute L* and every form's verdict.

    Args:
        forms: the model's cache forms, in :class:`Form` order.
        hashes: the prompt's block hashes (``prompt_tokens // U`` of them).
        hash_hit_tokens: length of the longest indexed prefix (a multiple of U).

    Verdicts: no hash hit → ``miss`` (``no_prefix_match``) for every form; a form that lost
    tokens (usable < the capped hash hit) or that lowered L* during the fixed point →
    ``invalidated`` with its reason; a matched prefix too short to leave a resume point before
    the last token → ``invalidated`` (``prompt_end``); otherwise ``hit``.

    The limiting form is the one that lowered L last (None when nothing did); its reason is the
    request's ``limiting_reason``. When only the prompt end caps L*, the reason is
    ``prompt_end``; with no hash hit at all it is ``no_prefix_match``.
    """
    target = min(hash_hit_tokens, resume_limit(prompt_tokens, unit_tokens))
    usable = {f.form: f.resume_at_most(hashes, target) for f in forms}
    resume = target
    limiting: CacheForm | None = None
    lowered_by: set[Form] = set()
    changed = True
    while changed:
        changed = False
        for f in forms:
            lowered = f.resume_at_most(hashes, resume)
            if lowered < resume:
                resume, limiting, changed = lowered, f, True
                lowered_by.add(f.form)

    verdicts = []
    for f in forms:
        u = usable[f.form]
        if hash_hit_tokens == 0:
            outcome, reason = Outcome.MISS, Reason.NO_PREFIX_MATCH
        elif u < target or f.form in lowered_by:
            # lost tokens itself, or vetoed a point the others offered (a window or checkpoint
            # set valid at the hash hit but not below it)
            outcome, reason = Outcome.INVALIDATED, f.reason
        elif target == 0:
            outcome, reason = Outcome.INVALIDATED, Reason.PROMPT_END  # nothing before the last token
        else:
            outcome, reason = Outcome.HIT, Reason.NONE
        verdicts.append(
            FormLookup(form=f.form, outcome=outcome, reason=reason, usable_tokens=u, recoverable_tokens=min(u, resume))
        )

    if limiting is not None:
        limiting_form, limiting_reason = limiting.form, limiting.reason
    elif hash_hit_tokens == 0:
        limiting_form, limiting_reason = None, Reason.NO_PREFIX_MATCH
    elif target < hash_hit_tokens:
        limiting_form, limiting_reason = None, Reason.PROMPT_END
    else:
        limiting_form, limiting_reason = None, Reason.NONE
    return ResumePlan(
        prompt_tokens=prompt_tokens,
        hash_hit_tokens=hash_hit_tokens,
        resume_tokens=resume,
        limiting_form=limiting_form,
        limiting_reason=limiting_reason,
        forms=tuple(verdicts),
    )
