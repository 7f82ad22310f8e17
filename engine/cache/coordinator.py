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
from typing import Protocol

from engine.cache.hashing import BlockHash
from engine.events import Form, Outcome, Reason, Tier


class ResumableForm(Protocol):
    """What the coordinator needs of a cache form."""

    @property
    def form(self) -> Form: ...

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        """Largest multiple of U ≤ ``limit_tokens`` at which this form can resume exactly."""
        ...

    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int) -> Reason:
        """Why this form cannot resume at ``resume_tokens`` (called only where it cannot)."""
        ...


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
    replayed_tokens: int = 0
    """Tokens replayed to rebuild this form's state (Tail-Replay; outcome ``replayed``)."""
    tier: Tier = Tier.DEVICE
    """The lowest tier an object this form resumed from was found on (``recovered``)."""
    bytes_moved: int = 0
    """Bytes swapped in for this form."""
    recovery_seconds: float = 0.0
    """Wall seconds of the swap-in that recovered this form."""
    ghost_tokens: int = 0
    """When the form lost tokens to evictions: the resume point it would have had with
    ``ghost_bytes`` more device memory (its pools' eviction history; 0: no such point)."""
    ghost_bytes: int | None = None
    """The extra device memory for ``ghost_tokens`` (None: more memory would not have helped, or
    the loss is older than the pools remember)."""
    spare_bytes: int | None = None
    """When the form could resume (``usable_tokens`` > 0): how much less device memory it could
    have had and still held what that resume reads (None: it resumes nowhere)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumePlan:
    """The lookup result of one request, before any lease is taken."""

    prompt_tokens: int
    hash_hit_tokens: int
    resume_tokens: int
    limiting_form: Form | None
    limiting_reason: Reason
    forms: tuple[FormLookup, ...]
    replayed_tokens: int = 0
    """R > 0 for a Tail-Replay plan: computation starts at L* − R with the linear layers' state
    zeroed there, and the result is approximate."""
    pool_versions: tuple[tuple[Form, tuple[int, ...]], ...] = ()
    """Each form's pool versions when the plan was made (what ``start`` re-checks)."""

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
    forms: Sequence[ResumableForm],
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
    tokens (usable < the capped hash hit) or lowered L* during the fixed point → ``invalidated``
    with the reason it gives for the first point it could not serve; a matched prefix too short
    to leave a resume point before the last token → ``invalidated`` (``prompt_end``); otherwise
    ``hit``.

    The limiting form is the one that set L* (the last to lower it); when several forms cannot
    go above L* on their own, one whose loss is a real cause (evicted, missing checkpoint) is
    named before one that is only ``below_granularity``, then in :class:`Form` order. It is
    None when nothing lowered L*: the reason is then ``prompt_end`` if the prompt end capped
    L*, ``no_prefix_match`` without a hash hit, else ``none``.
    """
    target = min(hash_hit_tokens, resume_limit(prompt_tokens, unit_tokens))
    usable = {f.form: f.resume_at_most(hashes, target) for f in forms}
    first_loss = {f.form: target for f in forms if usable[f.form] < target}
    resume = target
    last: ResumableForm | None = None
    changed = True
    while changed:
        changed = False
        for f in forms:
            lowered = f.resume_at_most(hashes, resume)
            if lowered < resume:
                first_loss.setdefault(f.form, resume)
                resume, last, changed = lowered, f, True

    reasons = {f.form: f.loss_reason(hashes, first_loss[f.form]) for f in forms if f.form in first_loss}
    verdicts = []
    for f in forms:
        u = usable[f.form]
        if hash_hit_tokens == 0:
            outcome, reason = Outcome.MISS, Reason.NO_PREFIX_MATCH
        elif f.form in reasons:
            outcome, reason = Outcome.INVALIDATED, reasons[f.form]
        elif target == 0:
            outcome, reason = Outcome.INVALIDATED, Reason.PROMPT_END  # nothing before the last token
        else:
            outcome, reason = Outcome.HIT, Reason.NONE
        verdicts.append(
            FormLookup(form=f.form, outcome=outcome, reason=reason, usable_tokens=u, recoverable_tokens=min(u, resume))
        )

    limiting_form: Form | None
    if last is not None:
        order = [f.form for f in forms]
        binding = {last.form} | {form for form in reasons if usable[form] == resume}
        limiting_form = min(binding, key=lambda form: (reasons[form] == Reason.BELOW_GRANULARITY, order.index(form)))
        limiting_reason = reasons[limiting_form]
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
