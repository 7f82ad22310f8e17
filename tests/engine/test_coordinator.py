"""L* as a fixed point over forms, the per-form verdicts and the request's limiting form."""

from __future__ import annotations

from collections.abc import Sequence

from engine.cache.coordinator import plan_resume, resume_limit
from engine.events import Form, Outcome, Reason


class FakeForm:
    """A form valid exactly at the given resume points (plus 0)."""

    downward_closed = False

    def __init__(self, form: Form, reason: Reason, valid: set[int]) -> None:
        self.form = form
        self.reason = reason
        self.valid = valid | {0}

    def resume_at_most(self, hashes: Sequence[bytes], limit_tokens: int) -> int:
        return max(v for v in self.valid if v <= limit_tokens)

    def loss_reason(self, hashes: Sequence[bytes], resume_tokens: int) -> Reason:
        assert resume_tokens not in self.valid, "asked why it cannot resume where it can"
        return self.reason


def test_resume_limit_is_strictly_before_prompt_end() -> None:
    assert resume_limit(64, 16) == 48  # exact multiple: the last token is always computed
    assert resume_limit(65, 16) == 64
    assert resume_limit(1, 16) == 0
    assert resume_limit(0, 16) == 0


def test_fixed_point_needs_more_than_one_pass() -> None:
    full = FakeForm(Form.FULL_KV, Reason.KV_EVICTED, {16, 32, 48, 64, 80})
    swa = FakeForm(Form.SWA_WINDOW, Reason.SWA_EVICTED, {80, 32})  # window present at 80 and 32 only
    lin = FakeForm(Form.LINEAR_STATE, Reason.LINEAR_CHECKPOINT_MISSING, {80, 48})
    plan = plan_resume([full, swa, lin], [b""] * 6, prompt_tokens=100, hash_hit_tokens=80, unit_tokens=16)
    # usable: full 80, swa 80, lin 80 → all hit at 80
    assert plan.resume_tokens == 80 and plan.limiting_form is None

    lin2 = FakeForm(Form.LINEAR_STATE, Reason.LINEAR_CHECKPOINT_MISSING, {48})
    plan = plan_resume([full, swa, lin2], [b""] * 6, prompt_tokens=100, hash_hit_tokens=80, unit_tokens=16)
    # linear lowers to 48; the window is not valid at 48 → 32; linear at 32 → 0 (only 48 and 0)
    assert plan.resume_tokens == 0
    assert plan.limiting_form == Form.LINEAR_STATE
    assert plan.limiting_reason == Reason.LINEAR_CHECKPOINT_MISSING
    verdicts = {f.form: (f.outcome, f.reason, f.usable_tokens, f.recoverable_tokens) for f in plan.forms}
    assert verdicts == {
        Form.FULL_KV: (Outcome.HIT, Reason.NONE, 80, 0),
        Form.SWA_WINDOW: (Outcome.INVALIDATED, Reason.SWA_EVICTED, 80, 0),  # it vetoed 48
        Form.LINEAR_STATE: (Outcome.INVALIDATED, Reason.LINEAR_CHECKPOINT_MISSING, 48, 0),
    }


def test_no_hash_hit_is_a_miss_for_every_form() -> None:
    forms = [FakeForm(Form.FULL_KV, Reason.KV_EVICTED, set()), FakeForm(Form.LINEAR_STATE, Reason.LINEAR_CHECKPOINT_MISSING, set())]
    plan = plan_resume(forms, [], prompt_tokens=10, hash_hit_tokens=0, unit_tokens=16)
    assert plan.resume_tokens == 0
    assert plan.limiting_reason == Reason.NO_PREFIX_MATCH
    assert {(f.outcome, f.reason) for f in plan.forms} == {(Outcome.MISS, Reason.NO_PREFIX_MATCH)}


def test_whole_prompt_hit_is_capped_by_prompt_end() -> None:
    forms = [FakeForm(Form.FULL_KV, Reason.KV_EVICTED, {16, 32, 48, 64})]
    plan = plan_resume(forms, [b""] * 4, prompt_tokens=64, hash_hit_tokens=64, unit_tokens=16)
    assert plan.resume_tokens == 48
    assert plan.limiting_form is None and plan.limiting_reason == Reason.PROMPT_END
    assert plan.forms[0].outcome == Outcome.HIT and plan.forms[0].usable_tokens == 48


def test_matched_prefix_shorter_than_one_resume_point_is_not_a_hit() -> None:
    """A 16-token prompt sent twice: the hash hit is the whole prompt, but no resume point lies
    strictly before its last token, so nothing is reusable — ``prompt_end``, not ``hit``."""
    forms = [FakeForm(Form.FULL_KV, Reason.KV_EVICTED, {16})]
    plan = plan_resume(forms, [b""], prompt_tokens=16, hash_hit_tokens=16, unit_tokens=16)
    assert plan.resume_tokens == 0 and plan.limiting_reason == Reason.PROMPT_END
    assert (plan.forms[0].outcome, plan.forms[0].reason, plan.forms[0].usable_tokens) == (
        Outcome.INVALIDATED,
        Reason.PROMPT_END,
        0,
    )


def test_a_real_cause_is_named_before_below_granularity() -> None:
    """Two forms cannot go above 0 on their own; the one whose loss is only
    ``below_granularity`` (never stored) is not named as the limiting form."""
    full = FakeForm(Form.FULL_KV, Reason.KV_EVICTED, {16, 32, 48, 64})
    swa = FakeForm(Form.SWA_WINDOW, Reason.BELOW_GRANULARITY, set())
    lin = FakeForm(Form.LINEAR_STATE, Reason.LINEAR_CHECKPOINT_MISSING, set())
    plan = plan_resume([full, swa, lin], [b""] * 5, prompt_tokens=80, hash_hit_tokens=64, unit_tokens=16)
    assert plan.resume_tokens == 0
    assert (plan.limiting_form, plan.limiting_reason) == (Form.LINEAR_STATE, Reason.LINEAR_CHECKPOINT_MISSING)
    assert plan.form(Form.SWA_WINDOW).reason == Reason.BELOW_GRANULARITY


def test_a_form_the_fixed_point_lowered_is_asked_over_every_point_it_lost() -> None:
    """Found in review. The window is usable at the target 96 but not at 64, 48 or below; the
    recurrent form lowers L* 96 → 64, the window 64 → 0. The window's lost points are (0, 64]:
    its reason is the one at 48 (its pages there were evicted), the highest stored point, not
    ``below_granularity`` from 64 alone."""
    class ByPoint:
        downward_closed = False

        def __init__(self, form: Form, points: set[int], reasons: dict[int, Reason]) -> None:
            self.form, self.points, self.reasons = form, points, reasons

        def resume_at_most(self, hashes: object, limit_tokens: int) -> int:
            return max(p for p in self.points if p <= limit_tokens)

        def loss_reason(self, hashes: object, resume_tokens: int) -> Reason:
            return self.reasons.get(resume_tokens, Reason.LINEAR_CHECKPOINT_MISSING)

    granular = {64: Reason.BELOW_GRANULARITY, 32: Reason.BELOW_GRANULARITY, 16: Reason.BELOW_GRANULARITY}
    window = ByPoint(Form.SWA_WINDOW, {0, 96}, granular | {48: Reason.SWA_EVICTED})
    linear = ByPoint(Form.LINEAR_STATE, {0, 48, 64}, {})
    plan = plan_resume([window, linear], [b"h"] * 7, 100, 96, 16)
    assert plan.resume_tokens == 0
    assert plan.form(Form.SWA_WINDOW).reason == Reason.SWA_EVICTED
