"""Layer 3 across tensor-parallel ranks: the resume point every rank can serve, agreed before any
rank reads state (DESIGN.md §4; docs/tensor-parallel.md has the protocol).

Each rank holds its shard of every sharded form (and a full copy of a replicated one) in its own
pools, validates it itself and may lose or corrupt it on its own. Every rank runs the same
lookup in lockstep; at each point where the lookup asks a form how far it can resume, the ranks
exchange what they found and every rank continues with the minimum:

1. the hash hit is rank 0's (the prefix index of record);
2. veto bits: each rank's whole-form vetoes (kernel contract, alignment, ...) are all-gathered;
   a form vetoed on any rank is vetoed on every rank, with ``tp_disagree`` on the others;
3. usable lengths: whenever the fixed point of :func:`~engine.cache.coordinator.plan_resume`
   (or Tail-Replay's) asks the forms at a new limit L, each rank computes every form's own
   longest resume ≤ L and the ranks all-gather the vector; each form then answers the minimum
   over ranks. Every decision of the lookup depends only on these agreed values, so every rank
   reaches the same L*; a form whose own state would have served more than another rank's
   reports ``tp_disagree``, naming the lowest rank (``FormLookup.tp_rank``);
4. the admission's choice among the priced plans is rank 0's (the structure of the candidates
   is agreed, their prices may differ by where each rank's tiers put its shards);
5. leases: each rank leases on its own pools, then the ranks all-gather whether a leased object
   changed since the lookup (``epoch_changed``); if one did on any rank, every rank releases and
   plans again with that form vetoed; a second change makes every rank recompute from 0.

Collectives run only in lockstep (every rank makes the same calls in the same order), bounded by
the group's timeout.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Protocol

from engine.cache.coordinator import FormLookup, ResumableForm, ResumePlan
from engine.cache.hashing import BlockHash
from engine.events import Form, Reason

_CODES = (None, *Reason)
"""A reason's code in an exchange: its index here (0: no veto)."""


class Collectives(Protocol):
    """What the agreement needs of a tensor-parallel group (:class:`~engine.parallel.group.TensorParallelGroup`)."""

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]: ...
    def broadcast_ints(self, values: Sequence[int], root: int = 0) -> list[int]: ...


class _Exchange:
    """The usable lengths of one lookup's forms, gathered once per limit asked."""

    def __init__(self, forms: Sequence[ResumableForm], hashes: Sequence[BlockHash], group: Collectives, vetoers: dict[Form, int]) -> None:
        self.forms, self.hashes, self.group, self.vetoers = forms, hashes, group, vetoers
        self.agreed: dict[int, list[int]] = {}

    def usable(self, index: int, limit: int) -> int:
        if limit not in self.agreed:
            local = [f.resume_at_most(self.hashes, limit) for f in self.forms]
            by_rank = self.group.all_gather_ints(local)
            agreed = [min(column) for column in zip(*by_rank, strict=True)]
            for i, f in enumerate(self.forms):
                if agreed[i] < local[i] and f.form not in self.vetoers:
                    self.vetoers[f.form] = min(r for r, row in enumerate(by_rank) if row[i] == agreed[i])
            self.agreed[limit] = agreed
        return self.agreed[limit][index]


class AgreedForm:
    """A form whose :meth:`resume_at_most` is the minimum over ranks (one exchange per limit,
    shared by the lookup's forms); its :meth:`loss_reason` is ``tp_disagree`` at a point this
    rank's own state serves, else this rank's own reason."""

    def __init__(self, inner: ResumableForm, index: int, exchange: _Exchange) -> None:
        self.inner, self.index, self.exchange = inner, index, exchange

    @property
    def form(self) -> Form:
        return self.inner.form

    @property
    def downward_closed(self) -> bool:
        return self.inner.downward_closed

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        if hashes is not self.exchange.hashes:
            raise RuntimeError("an agreed form was asked about another prompt than its lookup's")
        return self.exchange.usable(self.index, limit_tokens)

    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int) -> Reason:
        if self.inner.resume_at_most(hashes, resume_tokens) >= resume_tokens:
            return Reason.TP_DISAGREE
        return self.inner.loss_reason(hashes, resume_tokens)


class RankAgreement:
    """The cross-rank steps of one rank's lookups (module docstring).

    ``vetoers`` maps each form another rank held back in the current lookup to that rank (the
    lowest one); ``disagreements`` counts, over this engine's life, the (form, rank) pairs that
    did.
    """

    def __init__(self, group: Collectives) -> None:
        self.group = group
        self.vetoers: dict[Form, int] = {}
        self.disagreements: Counter[tuple[Form, int]] = Counter()

    @property
    def rank(self) -> int:
        return self.group.rank

    def begin(self) -> None:
        """Start a new lookup: forget the previous one's vetoers."""
        self.vetoers = {}

    def hash_hit(self, tokens: int) -> int:
        """Rank 0's hash hit, on every rank."""
        return self.from_rank0(tokens)

    def from_rank0(self, value: int) -> int:
        """Rank 0's ``value``, on every rank (a decision rank 0 makes for all: the admission's
        choice among the priced plans)."""
        return self.group.broadcast_ints([value])[0]

    def vetoes(self, reasons: Mapping[Form, Reason], order: Sequence[Form]) -> dict[Form, Reason]:
        """The union of every rank's vetoes: a form this rank does not veto but another does
        gets ``tp_disagree`` (the lowest such rank recorded as its vetoer)."""
        by_rank = self.group.all_gather_ints([_CODES.index(reasons.get(form)) for form in order])
        out = dict(reasons)
        for i, form in enumerate(order):
            if form in out:
                continue
            vetoing = [r for r, row in enumerate(by_rank) if row[i]]
            if vetoing:
                out[form] = Reason.TP_DISAGREE
                self.vetoers.setdefault(form, vetoing[0])
        return out

    def forms(self, forms: Sequence[ResumableForm], hashes: Sequence[BlockHash]) -> list[ResumableForm]:
        """``forms`` answering the minimum over ranks, exchanged once per limit asked."""
        exchange = _Exchange(forms, hashes, self.group, self.vetoers)
        return [AgreedForm(f, i, exchange) for i, f in enumerate(forms)]

    def annotate(self, plan: ResumePlan) -> ResumePlan:
        """``plan`` with the vetoing rank on every ``tp_disagree`` verdict."""
        verdicts: list[FormLookup] = []
        for f in plan.forms:
            if f.reason is Reason.TP_DISAGREE:
                f = dataclasses.replace(f, tp_rank=self.vetoers.get(f.form, 0))
            verdicts.append(f)
        return dataclasses.replace(plan, forms=tuple(verdicts))

    def count(self, plan: ResumePlan) -> None:
        """Count the admitted ``plan``'s disagreements in :attr:`disagreements`."""
        for f in plan.forms:
            if f.reason is Reason.TP_DISAGREE:
                self.disagreements[(f.form, f.tp_rank)] += 1

    def remote_failures(self, failures: Mapping[Form, Reason], order: Sequence[Form]) -> dict[Form, int]:
        """After a swap-in ran on every rank: each form whose copy failed on another rank
        (``offload_corrupt``, ``epoch_changed``, ...) but not here, with the lowest such rank
        (the caller reports ``tp_disagree`` for it)."""
        by_rank = self.group.all_gather_ints([_CODES.index(failures.get(form)) for form in order])
        out: dict[Form, int] = {}
        for i, form in enumerate(order):
            failing = [r for r, row in enumerate(by_rank) if row[i]]
            if failing and form not in failures:
                out[form] = failing[0]
        return out

    def stale(self, form: Form | None, order: Sequence[Form]) -> tuple[Form, int] | None:
        """After each rank tried its leases: the first form (and the lowest rank) whose leased
        object changed since the lookup on some rank, or None when every rank leased cleanly."""
        by_rank = self.group.all_gather_ints([-1 if form is None else list(order).index(form)])
        for rank, (index,) in enumerate(by_rank):
            if index >= 0:
                return order[index], rank
        return None
