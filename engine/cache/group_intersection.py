"""Layer 3 of validation: the resume point every cache group and tensor-parallel rank agrees on
(DESIGN.md §4 "Four-layer validation").

A form whose layers sit in several cache groups (each its own block table, or pages of another
compression ratio) resumes where all of them can: the minimum over the groups and over the
tensor-parallel ranks. A group that cannot be used at all (mid-swap, missing its tail) vetoes.

Source: vLLM v1's hybrid KV-cache coordinator, which intersects the longest hit of every
KV-cache group (``KVCacheGroupSpec``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from engine.cache.validation_failure import ValidationFailure, ValidationLayer
from engine.events import Reason


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
