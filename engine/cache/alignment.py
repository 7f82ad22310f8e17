"""Layer 4 of validation: can a kernel read a stored tensor with its vector loads (DESIGN.md §4
"Four-layer validation")?

The byte address, the strides and the row size of a pool tensor (and of its scales, for
quantized layouts) must be multiples of the kernel's vector width. Units: torch gives strides
in elements; every rule is tested in bytes.

Source: FlashInfer / FlashAttention, whose kernels move K/V with 16-byte (128-bit) vector loads
and so need 16-byte aligned rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from engine.cache.layout_contract import KernelContract
from engine.cache.validation_failure import ValidationFailure, ValidationLayer
from engine.events import Reason


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
