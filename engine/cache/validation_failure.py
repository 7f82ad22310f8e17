"""What a failed validation check reports: the layer and the reason code (DESIGN.md §4).

Every check of :mod:`engine.cache.validation` returns a :class:`ValidationFailure` (or None);
the four layers are numbered by :class:`ValidationLayer` in the order they run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.events import Reason


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


