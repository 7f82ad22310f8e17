"""The layout contract between a pool's writer and the kernel that reads it (DESIGN.md §4).

A writer records what its stored blocks look like (:class:`LayoutFingerprint`: element type,
block shape, axis order, kernel ABI version, model revision); the consuming kernel declares what
it expects (:class:`KernelContract`: a fingerprint and the byte width of its vector loads).
Layers 2 and 4 of :mod:`engine.cache.validation` compare the two; the tier files of
:mod:`engine.cache.tier_files` carry a fingerprint per stored tensor.

Sources: vLLM v1's ``KVCacheSpec`` per attention type; FlashInfer / FlashAttention, whose kernels
move K/V with 16-byte (128-bit) vector loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

DEFAULT_VECTOR_BYTES = 16
"""The width of one vector load of the attention kernels (128 bits)."""


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

