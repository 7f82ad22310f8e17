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

Units: token counts are ``*_tokens``, byte sizes ``*_bytes``; tensor strides from torch are in
elements and are converted to bytes before any alignment test.

Sources: DESIGN.md §4 "Four-layer validation"; vLLM v1's ``KVCacheSpec`` per attention type and
its hybrid KV-cache coordinator, which intersects the longest hit of every KV-cache group;
FlashInfer / FlashAttention, whose kernels move K/V with 16-byte (128-bit) vector loads and so
need 16-byte aligned rows.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from engine.events import Reason

DEFAULT_VECTOR_BYTES = 16
"""The width of one vector load of the attention kernels (128 bits)."""


class ValidationLayer(enum.IntEnum):
    """The validation layer that failed, numbered in the order they run."""

    GRANULARITY = 1
    KERNEL_CONTRACT = 2
    GROUP_INTERSECTION = 3
    ALIGNMENT = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationFailure:
    """Why a stored object cannot be reused at the resume point that was checked.

    Attributes:
        layer: the layer that failed.
        reason: the reason code carried by the form's ``cache_lookup`` event (never ``none``).
        detail: a human-readable message naming the field, the expected and the found value.
    """

    layer: ValidationLayer
    reason: Reason
    detail: str

    def __post_init__(self) -> None:
        if self.reason == Reason.NONE:
            raise ValueError("ValidationFailure.reason must not be 'none'")

    def __str__(self) -> str:
        return f"layer {int(self.layer)} ({self.layer.name.lower()}): {self.reason}: {self.detail}"


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutFingerprint:
    """What a pool's stored blocks look like, recorded by the writer.

    Attributes:
        dtype: element type of the stored tensor.
        block_shape: the shape of one block (slot) of the pool, without the leading block axis;
            e.g. ``(n_layers, 2, U, H_kv, D)`` for a paged KV pool ``[N, n_layers, 2, U, H_kv, D]``.
        axis_order: one name per axis of ``block_shape``, outermost first, e.g.
            ``("layer", "kv", "token", "head", "dim")``.
        kernel_abi: version of the kernel interface the object was written for; bumped whenever
            a kernel changes how it reads a block.
        model_revision: the weights the state was computed with (state of other weights is wrong
            even when the layout fits).

    Raises ValueError on a non-positive extent, an ``axis_order`` whose length differs from
    ``block_shape`` or that repeats a name, a negative ABI version or an empty revision.
    """

    dtype: torch.dtype
    block_shape: tuple[int, ...]
    axis_order: tuple[str, ...]
    kernel_abi: int
    model_revision: str

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"LayoutFingerprint.dtype = {self.dtype!r} is not a torch.dtype")
        shape = tuple(int(d) for d in self.block_shape)
        if any(d <= 0 for d in shape):
            raise ValueError(f"LayoutFingerprint.block_shape = {shape} has a non-positive extent")
        object.__setattr__(self, "block_shape", shape)
        order = tuple(self.axis_order)
        if len(order) != len(shape):
            raise ValueError(
                f"LayoutFingerprint.axis_order = {order} names {len(order)} axes, "
                f"block_shape = {shape} has {len(shape)}"
            )
        if len(set(order)) != len(order) or not all(order):
            raise ValueError(
                f"LayoutFingerprint.axis_order = {order} must be distinct non-empty names"
            )
        object.__setattr__(self, "axis_order", order)
        if self.kernel_abi < 0:
            raise ValueError(f"LayoutFingerprint.kernel_abi = {self.kernel_abi} must be ≥ 0")
        if not self.model_revision:
            raise ValueError("LayoutFingerprint.model_revision must not be empty")

    @classmethod
    def of(
        cls, pool: Tensor, *, axis_order: Sequence[str], kernel_abi: int, model_revision: str
    ) -> LayoutFingerprint:
        """The fingerprint of a pool tensor ``[num_blocks, *block_shape]``.

        ``axis_order`` names the axes after the block axis, as the writer laid them out; it is a
        declaration (a tensor cannot tell which of two equal-sized axes is which). Raises
        ValueError for a 0-dim tensor or a wrong number of names.
        """
        if pool.dim() < 1:
            raise ValueError("a pool tensor needs a leading block axis, got a 0-dim tensor")
        return cls(
            dtype=pool.dtype,
            block_shape=tuple(pool.shape[1:]),
            axis_order=tuple(axis_order),
            kernel_abi=kernel_abi,
            model_revision=model_revision,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelContract:
    """What the kernel that consumes a form's blocks expects.

    Attributes:
        layout: the fingerprint a stored object must equal, field by field.
        vector_bytes: the alignment its vector loads need, in bytes (a power of two; 16 for
            128-bit loads).

    Raises ValueError when ``vector_bytes`` is not a positive power of two.
    """

    layout: LayoutFingerprint
    vector_bytes: int = DEFAULT_VECTOR_BYTES

    def __post_init__(self) -> None:
        vb = self.vector_bytes
        if vb <= 0 or vb & (vb - 1):
            raise ValueError(f"KernelContract.vector_bytes = {vb} must be a positive power of two")


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


# --- layer 3: group intersection --------------------------------------------------------------


class GroupIntersection(NamedTuple):
    """The resume point every cache group and tensor-parallel rank agrees on.

    ``resume_tokens``: min over groups and ranks (0 after a veto); ``failure``: the veto, or
    ``group_disagree`` when a group or rank lowered it below another's, else None.
    """

    resume_tokens: int
    failure: ValidationFailure | None


def intersect_groups(
    usable_by_group: Mapping[str, int],
    vetoes: Mapping[str, Reason] | None = None,
    tp_usable: Sequence[int] = (),
) -> GroupIntersection:
    """Layer 3: the resume point common to every cache group and tensor-parallel rank.

    Args:
        usable_by_group: each cache group's own longest resume point, in tokens (a group is the
            set of layers sharing one block table, as vLLM's ``KVCacheGroupSpec``).
        vetoes: groups that cannot be used at any L > 0, with the reason (a group mid-swap →
            ``in_flight_swap``, missing its uncompressed tail → ``tail_missing``, …).
        tp_usable: the resume point each tensor-parallel rank computed for this form, indexed
            by rank, as gathered by the all-reduce MIN; empty in a single process.

    Returns L = min(groups, ranks). A veto forces L = 0 and is reported with its own reason
    (the first veto in mapping order; the detail names every vetoing group). Otherwise, when
    the ranks' minimum is below the groups' minimum the lowest rank is named, and when groups
    disagree the lowest group is named, both as ``group_disagree``.

    Raises ValueError for no groups, a negative count, a veto for an unknown group or with
    reason ``none`` — the caller built the mappings.
    """
    vetoes = vetoes or {}
    if not usable_by_group:
        raise ValueError("intersect_groups needs at least one cache group")
    for name, tokens in usable_by_group.items():
        if tokens < 0:
            raise ValueError(f"group {name!r}: usable tokens {tokens} must be ≥ 0")
    for rank, tokens in enumerate(tp_usable):
        if tokens < 0:
            raise ValueError(f"tensor-parallel rank {rank}: usable tokens {tokens} must be ≥ 0")
    for name, reason in vetoes.items():
        if name not in usable_by_group:
            raise ValueError(
                f"veto for unknown group {name!r}; groups are {sorted(usable_by_group)}"
            )
        if reason == Reason.NONE:
            raise ValueError(f"veto for group {name!r} needs a reason other than 'none'")

    if vetoes:
        named = ", ".join(f"{name!r} ({reason})" for name, reason in vetoes.items())
        subject = f"group {named} vetoes" if len(vetoes) == 1 else f"groups {named} veto"
        return GroupIntersection(
            0,
            ValidationFailure(
                layer=ValidationLayer.GROUP_INTERSECTION,
                reason=next(iter(vetoes.values())),
                detail=f"{subject} reuse; resume point forced to 0 tokens",
            ),
        )

    low_group = min(usable_by_group, key=lambda name: usable_by_group[name])
    high_group = max(usable_by_group, key=lambda name: usable_by_group[name])
    groups_tokens = usable_by_group[low_group]
    if tp_usable and min(tp_usable) < groups_tokens:
        low_rank = min(range(len(tp_usable)), key=lambda rank: tp_usable[rank])
        resume = tp_usable[low_rank]
        detail = (
            f"tensor-parallel rank {low_rank} allows {resume} tokens, below the {groups_tokens} "
            f"tokens of this rank's groups (ranks: {list(tp_usable)}); resume point lowered to {resume} tokens"
        )
    elif groups_tokens < usable_by_group[high_group]:
        resume = groups_tokens
        detail = (
            f"group {low_group!r} allows {resume} tokens, below group {high_group!r} at "
            f"{usable_by_group[high_group]} tokens; resume point lowered to {resume} tokens"
        )
    else:
        return GroupIntersection(groups_tokens, None)
    failure = ValidationFailure(
        layer=ValidationLayer.GROUP_INTERSECTION, reason=Reason.GROUP_DISAGREE, detail=detail
    )
    return GroupIntersection(resume, failure)


# --- layer 4: alignment -----------------------------------------------------------------------


def check_alignment(
    tensor: Tensor,
    contract: KernelContract,
    *,
    scales: Tensor | None = None,
    block_id: int | None = None,
) -> ValidationFailure | None:
    """Layer 4: can the kernel read the stored tensor with ``contract.vector_bytes`` loads?

    Args:
        tensor: a pool ``[num_blocks, *block_shape]`` (checking the pool covers every block:
            the block stride is checked too) or, with ``block_id``, the pool of that block.
        contract: gives the vector width in bytes (and the axis names used in messages).
        scales: for quantized layouts (int8 / fp8 elements), the separate scales tensor, checked
            by the same rules (indexed by ``block_id`` too when given). A 0-dim per-tensor scale
            has no rows, so only its address is checked.
        block_id: check only ``tensor[block_id]`` (and ``scales[block_id]``).

    Rules, in bytes, for each checked tensor: its address (storage base + storage offset ×
    element size) is a multiple of the vector width; the innermost axis has stride 1
    (contiguous rows); every other axis of extent > 1 has a stride that is a multiple of the
    vector width; a row (innermost extent × element size) is a multiple of the vector width.
    Returns ``misaligned`` naming the first rule broken. Raises ValueError for a ``block_id``
    outside the pool or the scales.
    """
    vb = contract.vector_bytes
    axes = contract.layout.axis_order
    what = "pool"
    if block_id is not None:
        tensor = _block(tensor, block_id, "pool")
        what = f"block {block_id}"
        if scales is not None:
            scales = _block(scales, block_id, "scales")
    else:
        axes = ("block", *axes)
    names = axes if len(axes) == tensor.dim() else None
    detail = _vector_access_problem(tensor, vb, names)
    if detail is None and scales is not None:
        detail = _vector_access_problem(scales, vb, None)
        what = f"scales of {what}"
    if detail is None:
        return None
    return ValidationFailure(
        layer=ValidationLayer.ALIGNMENT, reason=Reason.MISALIGNED, detail=f"{what}: {detail}"
    )


def _block(tensor: Tensor, block_id: int, what: str) -> Tensor:
    if tensor.dim() < 1 or not 0 <= block_id < tensor.shape[0]:
        raise ValueError(
            f"block_id {block_id} is outside the {what} of shape {tuple(tensor.shape)}"
        )
    return tensor[block_id]


def _vector_access_problem(t: Tensor, vector_bytes: int, names: Sequence[str] | None) -> str | None:
    """The first alignment rule ``t`` breaks, as a message, or None."""
    elem_bytes = t.element_size()
    base = t.untyped_storage().data_ptr()
    offset_bytes = t.storage_offset() * elem_bytes
    if base % vector_bytes:
        return f"storage base address {base:#x} is not a multiple of {vector_bytes} bytes"
    if offset_bytes % vector_bytes:
        return (
            f"byte offset {offset_bytes} (storage offset {t.storage_offset()} elements × "
            f"{elem_bytes} bytes) is not a multiple of {vector_bytes} bytes"
        )
    if t.dim() == 0:
        return None

    def axis(i: int) -> str:
        return f"axis {i} ({names[i]})" if names is not None else f"axis {i}"

    last = t.dim() - 1
    if t.shape[last] > 1 and t.stride(last) != 1:
        return f"innermost {axis(last)} has stride {t.stride(last)} elements, expected 1 (contiguous rows)"
    for i in range(last - 1, -1, -1):
        stride_bytes = t.stride(i) * elem_bytes
        if t.shape[i] > 1 and stride_bytes % vector_bytes:
            return f"stride of {axis(i)} is {stride_bytes} bytes, not a multiple of {vector_bytes} bytes"
    row_bytes = t.shape[last] * elem_bytes
    if row_bytes % vector_bytes:
        return (
            f"innermost extent of {axis(last)} is {row_bytes} bytes ({t.shape[last]} × "
            f"{elem_bytes}), not a multiple of {vector_bytes} bytes"
        )
    return None


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
