"""Four-layer validation of a stored cache object before it is reused (DESIGN.md §4).

A form that can resume at L by hash (its pages, checkpoint or snapshot are indexed) may still be
unusable there. Four checks, run in this order, each give a reason code of
:class:`engine.events.Reason` when they fail:

1. *granularity* (:func:`check_granularity`): L is a multiple of the form's unit U and, for a
   form that resumes only where it stored state (checkpoints, pending rows), that state exists
   at L → ``below_granularity``;
2. *kernel contract* (:func:`check_kernel_contract`): the stored object's
   :class:`LayoutFingerprint` equals what the consuming kernel expects (:class:`KernelContract`)
   → ``model_revision_changed`` or ``layout_mismatch``;
3. *group intersection* (:func:`intersect_groups`): L is the minimum over the form's cache
   groups and over tensor-parallel ranks; a group mid-swap or missing its tail vetoes
   → the veto's reason, or ``group_disagree`` when one group or rank lowered L;
4. *alignment* (:func:`check_alignment`): the byte offset and strides of the stored tensor (and
   of its scales, for quantized layouts) meet the kernel's vector width → ``misaligned``.

:func:`validate` runs the four in order and returns the first failure, so a form carries one
reason. Every check returns a :class:`ValidationFailure` (or None) for a stored object that is
not reusable; it raises ``ValueError`` only when called with inputs no correct caller passes
(negative token counts, an unknown group, a block id outside the pool).

This module owns layers 1 and 2 and :func:`validate`; the other pieces live in their own
modules and are re-exported here: the layout contract (:class:`LayoutFingerprint`,
:class:`KernelContract`) in :mod:`engine.cache.layout_contract`, the failure type in
:mod:`engine.cache.validation_failure`, layer 3 in :mod:`engine.cache.group_intersection` and
layer 4 in :mod:`engine.cache.alignment`.

Units: token counts are ``*_tokens``, byte sizes ``*_bytes``; tensor strides from torch are in
elements and are converted to bytes before any alignment test.

Sources: DESIGN.md §4 "Four-layer validation"; vLLM v1's ``KVCacheSpec`` per attention type and
its hybrid KV-cache coordinator, which intersects the longest hit of every KV-cache group;
FlashInfer / FlashAttention, whose kernels move K/V with 16-byte (128-bit) vector loads and so
need 16-byte aligned rows.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from engine.cache.alignment import check_alignment
from engine.cache.group_intersection import GroupIntersection, intersect_groups
from engine.cache.layout_contract import DEFAULT_VECTOR_BYTES, KernelContract, LayoutFingerprint
from engine.cache.validation_failure import ValidationFailure, ValidationLayer
from engine.events import Reason

__all__ = [
    "DEFAULT_VECTOR_BYTES",
    "GroupIntersection",
    "KernelContract",
    "LayoutFingerprint",
    "ValidationFailure",
    "ValidationLayer",
    "check_alignment",
    "check_granularity",
    "check_kernel_contract",
    "intersect_groups",
    "validate",
]


# --- layer 1: granularity ---------------------------------------------------------------------


def check_granularity(
    resume_tokens: int, unit_tokens: int, stored_at: Callable[[int], bool] | None = None
) -> ValidationFailure | None:
    """Layer 1: can this form resume at ``resume_tokens`` at all?

    Args:
        resume_tokens: the candidate resume point L, in tokens.
        unit_tokens: U, the form's resume granularity in tokens (the prefix-match unit).
        stored_at: for forms that resume only where they stored state (checkpoints, pending
            tail rows), whether state was stored at a given token position; None for forms that
            can resume at any multiple of U.

    Returns ``below_granularity`` when L is not a multiple of U, or when ``stored_at(L)`` is
    false. L = 0 always passes (it needs no state). Raises ValueError when L < 0 or U ≤ 0.
    """
    if resume_tokens < 0:
        raise ValueError(f"resume_tokens = {resume_tokens} must be ≥ 0")
    if unit_tokens <= 0:
        raise ValueError(f"unit_tokens = {unit_tokens} must be positive")
    if resume_tokens % unit_tokens:
        lower = resume_tokens - resume_tokens % unit_tokens
        return ValidationFailure(
            layer=ValidationLayer.GRANULARITY,
            reason=Reason.BELOW_GRANULARITY,
            detail=f"resume point {resume_tokens} tokens is not a multiple of the unit U = "
            f"{unit_tokens} tokens (the point below is {lower})",
        )
    if resume_tokens and stored_at is not None and not stored_at(resume_tokens):
        return ValidationFailure(
            layer=ValidationLayer.GRANULARITY,
            reason=Reason.BELOW_GRANULARITY,
            detail=f"no stored state at {resume_tokens} tokens: this form resumes only where "
            "its state was stored",
        )
    return None


# --- layer 2: kernel contract -----------------------------------------------------------------

_CONTRACT_FIELDS = ("model_revision", "kernel_abi", "dtype", "axis_order", "block_shape")
"""The order fields are compared and reported in: a different revision or ABI makes the rest
meaningless; the axis order comes before the shape because a shape is read through it."""


def check_kernel_contract(
    stored: LayoutFingerprint, contract: KernelContract
) -> ValidationFailure | None:
    """Layer 2: does the stored object's layout equal what the kernel expects?

    Returns ``model_revision_changed`` when the stored state was computed with other weights,
    else ``layout_mismatch`` when the kernel ABI version, dtype, axis order or block shape
    differ. The detail lists every differing field as ``field: expected X, got Y``, the first
    one (in the order revision, ABI, dtype, axis order, block shape) leading. Raises nothing.
    """
    expected = contract.layout
    diffs = [
        f"{name}: expected {getattr(expected, name)!r}, got {getattr(stored, name)!r}"
        for name in _CONTRACT_FIELDS
        if getattr(stored, name) != getattr(expected, name)
    ]
    if not diffs:
        return None
    changed_revision = stored.model_revision != expected.model_revision
    return ValidationFailure(
        layer=ValidationLayer.KERNEL_CONTRACT,
        reason=Reason.MODEL_REVISION_CHANGED if changed_revision else Reason.LAYOUT_MISMATCH,
        detail="; ".join(diffs),
    )


# --- all four ---------------------------------------------------------------------------------


def validate(
    *,
    resume_tokens: int,
    unit_tokens: int,
    stored: LayoutFingerprint,
    contract: KernelContract,
    tensor: Tensor,
    stored_at: Callable[[int], bool] | None = None,
    groups: GroupIntersection | None = None,
    scales: Tensor | None = None,
    block_id: int | None = None,
) -> ValidationFailure | None:
    """Run layers 1–4 for one form at ``resume_tokens`` and return the first failure, or None.

    ``groups`` is the result of :func:`intersect_groups` for this form (None for a form with a
    single group in a single process); layer 3 fails only when it lies below ``resume_tokens``
    (a disagreement that does not reach down to the checked point does not matter there). The
    other arguments go to :func:`check_granularity`, :func:`check_kernel_contract` and
    :func:`check_alignment`, whose errors it raises; it also raises ValueError when ``groups``
    lies below ``resume_tokens`` without a failure (every group agreed on a lower point: the
    caller checked a point no group allows).
    """
    failure = check_granularity(resume_tokens, unit_tokens, stored_at)
    if failure is not None:
        return failure
    failure = check_kernel_contract(stored, contract)
    if failure is not None:
        return failure
    if groups is not None and groups.resume_tokens < resume_tokens:
        if groups.failure is None:
            raise ValueError(
                f"resume point {resume_tokens} tokens is above the {groups.resume_tokens} tokens "
                "every group agreed on"
            )
        return groups.failure
    return check_alignment(tensor, contract, scales=scales, block_id=block_id)
