"""The in-process summary (``kvscope replay`` without an agent) ranks tokens lost by limiting form
and reason as the agent's ``tokens_lost`` query does: a tie under every tied form, each with its
own reason."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from engine.events import Form, Outcome, Reason
from engine.trace.replay import ReplayTally
from kvscope.summary import Summary


def _output(hash_hit: int, recoverable: int, limiting: Form | None, reason: Reason, tied: tuple[Form, ...], forms: list[SimpleNamespace]) -> SimpleNamespace:
    cache = SimpleNamespace(
        prompt_tokens=1000, hash_hit_tokens=hash_hit, recoverable_tokens=recoverable, replayed_tokens=0,
        recomputed_tokens=1000 - recoverable, limiting_form=limiting, limiting_reason=reason, limiting_forms=tied, forms=forms,
    )  # fmt: skip
    return SimpleNamespace(cache=cache, output_token_ids=[1])


def _lookup(form: Form, outcome: Outcome, reason: Reason, usable: int) -> SimpleNamespace:
    return SimpleNamespace(form=form, outcome=outcome, reason=reason, usable_tokens=usable)


def test_losses_rank_ties_under_each_form_with_its_own_reason() -> None:
    tally = ReplayTally()
    swa = _lookup(Form.SWA_WINDOW, Outcome.INVALIDATED, Reason.SWA_EVICTED, 200)
    linear_low = _lookup(Form.LINEAR_STATE, Outcome.INVALIDATED, Reason.LINEAR_CHECKPOINT_MISSING, 200)
    linear_high = _lookup(Form.LINEAR_STATE, Outcome.HIT, Reason.NONE, 800)
    tally.add(_output(800, 200, Form.SWA_WINDOW, Reason.SWA_EVICTED, (Form.SWA_WINDOW, Form.LINEAR_STATE), [swa, linear_high, linear_low]))  # type: ignore[arg-type]
    tally.add(_output(800, 0, Form.SWA_WINDOW, Reason.SWA_EVICTED, (Form.SWA_WINDOW,), [swa]))  # type: ignore[arg-type]
    tally.add(_output(800, 800, None, Reason.NONE, (), []))  # type: ignore[arg-type]  # nothing lost
    summary = Summary.from_tally(tally)
    assert summary.losses == [
        {"form": "swa_window", "reason": "swa_evicted", "tokens_lost": 1400, "requests": 2, "tied_requests": 1},
        {"form": "linear_state", "reason": "linear_checkpoint_missing", "tokens_lost": 600, "requests": 1, "tied_requests": 1},
    ]
    assert summary.to_json()["losses"] == summary.losses
    out = io.StringIO()
    summary.render(Console(file=out, width=200))
    text = out.getvalue()
    assert "tokens lost (hash hit, not recoverable) by limiting form and reason" in text
    assert text.index("swa_evicted") < text.index("linear_checkpoint_missing")
