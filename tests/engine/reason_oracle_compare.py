"""Compare what the engine answered (a lookup's plan, a request's events) with the oracle.

INDEPENDENCE: as :mod:`tests.engine.reason_oracle` — this module reads the engine's answers and
the oracle's plans, and computes nothing of its own about resume points.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.events import Admission, CacheLookup, Form, Outcome, Reason, RequestEvent
from tests.engine.reason_oracle_plans import Expected


@dataclass(frozen=True, slots=True)
class EngineForm:
    form: Form
    outcome: Outcome
    usable: int
    reason: Reason


@dataclass(frozen=True, slots=True)
class EngineAnswer:
    """One lookup's or request's answer, whatever produced it."""

    resume: int
    forms: tuple[EngineForm, ...]
    limiting_form: Form | None
    limiting_reason: Reason
    limiting_forms: tuple[Form, ...]
    admission: Admission | None = None
    """The request's admission (None for a plain lookup)."""
    predicted_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Mismatch:
    scenario: str
    what: str
    form: str
    engine: str
    oracle: str
    detail: str = ""
    """Both answers in full (for the first mismatch of each class)."""

    @property
    def key(self) -> tuple[str, str, str, str]:
        """The mismatch class: what differs, for which form, engine's value vs the oracle's."""
        return (self.what, self.form, self.engine, self.oracle)

    def __str__(self) -> str:
        return f"{self.what} [{self.form}] engine={self.engine} oracle={self.oracle} :: {self.scenario}\n    {self.detail}"


@dataclass(slots=True)
class Tally:
    """Every comparison of a run: how many lookups and requests, and what differed."""

    lookups: int = 0
    requests: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    seen: Counter[str] = field(default_factory=Counter)
    """How often each admission, outcome and reason was compared (coverage)."""

    def add(self, answer: EngineAnswer, expected: Expected, mismatches: list[Mismatch]) -> None:
        """Count one compared answer (a request when it has an admission) and its mismatches."""
        if answer.admission is None:
            self.lookups += 1
        else:
            self.requests += 1
            self.seen[f"admission:{answer.admission}"] += 1
        for f in answer.forms:
            self.seen[f"{f.outcome}:{f.reason}"] += 1
        self.mismatches += mismatches

    def classes(self) -> Counter[tuple[str, str, str, str]]:
        return Counter(m.key for m in self.mismatches)

    def render(self, limit: int = 40) -> str:
        lines = [f"{n}x {key}" for key, n in self.classes().most_common()]
        first: dict[tuple[str, str, str, str], Mismatch] = {}
        for m in self.mismatches:
            first.setdefault(m.key, m)
        lines += ["-- first of each class:"] + [str(m) for m in list(first.values())[:limit]]
        return "\n".join(lines)


def from_plan(plan: object) -> EngineAnswer:
    """A ``ResumePlan`` (what ``PrefixCache.lookup`` returns) as an answer."""
    forms = tuple(EngineForm(f.form, f.outcome, f.usable_tokens, f.reason) for f in plan.forms)  # type: ignore[attr-defined]
    return EngineAnswer(
        plan.resume_tokens,  # type: ignore[attr-defined]
        forms,
        plan.limiting_form,  # type: ignore[attr-defined]
        plan.limiting_reason,  # type: ignore[attr-defined]
        tuple(plan.limiting_forms),  # type: ignore[attr-defined]
    )


def from_events(events: Sequence[object], request_id: str) -> EngineAnswer:
    """A request's ``cache_lookup`` and ``request`` events as an answer.

    Raises:
        AssertionError: the request has no ``request`` event.
    """
    req = [e for e in events if isinstance(e, RequestEvent) and e.request_id == request_id]
    assert len(req) == 1, f"{request_id}: {len(req)} request events"
    r = req[0]
    forms = tuple(
        EngineForm(e.form, e.outcome, e.usable_tokens, e.reason)
        for e in events
        if isinstance(e, CacheLookup) and e.request_id == request_id
    )
    return EngineAnswer(
        r.resume_tokens,
        forms,
        r.limiting_form,
        r.limiting_reason,
        tuple(r.limiting_forms),
        r.admission,
        r.predicted_seconds,
    )


def compare(answer: EngineAnswer, expected: Expected, scenario: str) -> list[Mismatch]:
    """Every field of ``answer`` that differs from the oracle's plan."""
    plan = expected.plan
    out: list[Mismatch] = []

    def miss(what: str, form: object, engine: object, oracle: object) -> None:
        out.append(
            Mismatch(
                scenario, what, str(form), str(engine), str(oracle), describe(answer, expected)
            )
        )

    if expected.admission is not None and answer.admission != expected.admission:
        miss("admission", "-", answer.admission, expected.admission)
    if (
        expected.predicted_seconds is not None
        and answer.predicted_seconds is not None
        and not math.isclose(answer.predicted_seconds, expected.predicted_seconds, rel_tol=1e-9)
    ):
        miss("predicted_seconds", "-", answer.predicted_seconds, expected.predicted_seconds)
    if answer.resume != plan.resume:
        miss("resume_tokens", "-", answer.resume, plan.resume)
    got = {f.form: f for f in answer.forms}
    if set(got) != set(plan.verdicts):
        miss("forms", "-", sorted(got), sorted(plan.verdicts))
    for form, v in plan.verdicts.items():
        e = got.get(form)
        if e is None:
            continue
        if e.usable != v.usable:
            miss("usable_tokens", form, e.usable, v.usable)
        if e.outcome != v.outcome:
            miss("outcome", form, e.outcome, v.outcome)
        if e.reason != v.reason:
            miss("reason", form, e.reason, v.reason)
    if answer.limiting_form != plan.limiting_form:
        miss("limiting_form", "-", answer.limiting_form, plan.limiting_form)
    if answer.limiting_reason != plan.limiting_reason:
        miss("limiting_reason", answer.limiting_form, answer.limiting_reason, plan.limiting_reason)
    if tuple(answer.limiting_forms) != plan.limiting_forms:
        miss(
            "limiting_forms",
            "-",
            list(map(str, answer.limiting_forms)),
            list(map(str, plan.limiting_forms)),
        )
    return out


def describe(answer: EngineAnswer, expected: Expected) -> str:
    """Both answers on two lines: L*, then per form (outcome, usable, reason), the limiting form."""
    plan = expected.plan
    eng = " ".join(f"{f.form}={f.outcome}/{f.usable}/{f.reason}" for f in answer.forms)
    ora = " ".join(
        f"{f}={v.outcome}/{v.usable}/{v.reason}"
        for f, v in plan.verdicts.items()
    )
    return (
        f"engine L*={answer.resume} {eng} lim={answer.limiting_form}/{answer.limiting_reason} "
        f"tied={[str(f) for f in answer.limiting_forms]} adm={answer.admission}\n"
        f"    oracle L*={plan.resume} hit={plan.hit} target={plan.target} R={plan.replayed} {ora} "
        f"lim={plan.limiting_form}/{plan.limiting_reason} tied={[str(f) for f in plan.limiting_forms]} "
        f"adm={expected.admission}"
    )


def summarize(tallies: Iterable[Tally]) -> Tally:
    total = Tally()
    for t in tallies:
        total.lookups += t.lookups
        total.requests += t.requests
        total.mismatches += t.mismatches
        total.seen += t.seen
    return total
