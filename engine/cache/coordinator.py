"""The resume point L* every form agrees on, and the per-form verdicts (DESIGN.md §3).

L* is a fixed point: start from the hash hit (capped at the last U boundary strictly before the
prompt end, so at least one token is computed and no state that already includes the last token
is applied again — case C3), let each form lower it to its own largest valid point, repeat until
no form lowers it. For a downward-closed form (``full_kv``) one pass suffices; a window or a set
of checkpoints is not downward closed, hence the loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.cache.hashing import BlockHash
from engine.events import Form, Outcome, Reason, Tier


class ResumableForm(Protocol):
    """What the coordinator needs of a cache form."""

    @property
    def form(self) -> Form: ...

    @property
    def downward_closed(self) -> bool:
        """Whether the objects a resume reads form a prefix (entry or KV pages from the start):
        every point above the usable one then lacks the same object first, so one loss reason
        serves all of them."""
        ...

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
    tp_rank: int = 0
    """The tensor-parallel rank this verdict is about: the rank that held the form back for
    ``tp_disagree``, else 0 (rank 0's own pools; always 0 in a single process)."""
    reason_tokens: int = 0
    """The resume point ``reason`` is about (:func:`stored_loss_reason`): the highest point the
    form lost where its state was ever stored (0: none was, or the form lost nothing)."""
    sync_delay_tokens: int = 0
    """``indexer_state`` only: tokens the indexer's state trails the main compressed KV
    boundary where this lookup met it (:mod:`engine.cache.indexer_sync`; 0: in sync)."""
    sync_delay_seconds: float = 0.0
    """``indexer_state`` only: seconds since that indexer state last matched the boundary (0:
    in sync, or not known)."""
    layer_group: int = 0
    """The layer group the figures are about: for ``indexer_state`` the indexer group (CSA
    layers sharing one indexer geometry) that trails most, else 0."""


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
    limiting_forms: tuple[Form, ...] = ()
    """Every limiting form (:func:`limiting_set`), ``limiting_form`` among them; empty when no
    form lowered L*."""

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

    A lost form's reason is the one at the highest point it lost where its state was ever stored
    (:func:`stored_loss_reason`): the points above its usable length, or for a form usable at
    the target that lowered L* in the fixed point, those from where it landed to where it was
    asked. The limiting forms are those of :func:`limiting_set`, the
    named one is :func:`name_limiting`'s. None (and no limiting forms) when nothing lowered L*:
    the reason is then ``prompt_end`` if the prompt end capped L*, ``no_prefix_match`` without a
    hash hit, else ``none``.
    """
    target = min(hash_hit_tokens, resume_limit(prompt_tokens, unit_tokens))
    usable = {f.form: f.resume_at_most(hashes, target) for f in forms}
    # per form that lost tokens, the points it lost: (low, high]
    lost = {f.form: (usable[f.form], target) for f in forms if usable[f.form] < target}
    resume = target
    last: ResumableForm | None = None
    changed = True
    while changed:
        changed = False
        for f in forms:
            lowered = f.resume_at_most(hashes, resume)
            if lowered < resume:
                lost.setdefault(f.form, (lowered, resume))  # usable at the target, not below it
                resume, last, changed = lowered, f, True

    found = {f.form: stored_loss_reason(f, hashes, *lost[f.form], unit_tokens) for f in forms if f.form in lost}
    reasons = {form: reason for form, (reason, _) in found.items()}
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
            FormLookup(
                form=f.form, outcome=outcome, reason=reason, usable_tokens=u, recoverable_tokens=min(u, resume),
                reason_tokens=found[f.form][1] if f.form in found and hash_hit_tokens else 0,
            )
        )

    limiting_forms: tuple[Form, ...] = ()
    limiting_form: Form | None
    if last is not None:
        limiting_forms = limiting_set(usable, reasons, [f.form for f in forms])
        limiting_form = name_limiting(limiting_forms, reasons)
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
        limiting_forms=limiting_forms,
    )


def stored_loss_reason(
    form: ResumableForm, hashes: Sequence[BlockHash], low: int, high: int, unit_tokens: int
) -> tuple[Reason, int]:
    """Why ``form`` cannot serve the points (``low``, ``high``] (multiples of U), and the point
    that reason is about: its reason at the highest of them where its state was ever stored (a
    point that never was gives ``below_granularity``); ``(below_granularity, 0)`` only when none
    ever was. A downward-closed form (``downward_closed``) is asked at ``low`` + U, the first
    point it lacks: every higher point lacks the same object first. Cost: one ``loss_reason``
    per point scanned."""
    if form.downward_closed:  # the first gap's reason holds up to ``high``
        reason = form.loss_reason(hashes, low + unit_tokens)
        return reason, 0 if reason == Reason.BELOW_GRANULARITY else high
    for point in range(high, low, -unit_tokens):
        reason = form.loss_reason(hashes, point)
        if reason != Reason.BELOW_GRANULARITY:
            return reason, point
    return Reason.BELOW_GRANULARITY, 0


def limiting_set(usable: Mapping[Form, int], reasons: Mapping[Form, Reason], order: Sequence[Form]) -> tuple[Form, ...]:
    """The limiting forms: of the forms that lost tokens (``reasons``' keys), those whose own
    usable length is the smallest — the forms whose usable length equals L* whenever one does
    (when none does, the forms disagree and the shortest ones bound L* the most) — in
    ``order``."""
    lowest = min(usable[form] for form in reasons)
    return tuple(form for form in order if form in reasons and usable[form] == lowest)


def name_limiting(limiting: Sequence[Form], reasons: Mapping[Form, Reason]) -> Form:
    """The limiting form a request names among ``limiting`` (docs/cache-forms.md): one whose
    reason is a real cause before one that is only ``below_granularity``, then :class:`Form`
    order."""
    return min(limiting, key=lambda form: (reasons[form] == Reason.BELOW_GRANULARITY, list(Form).index(form)))
