"""Tail-Replay for ``linear_state`` (off by default): when a missing recurrent checkpoint holds
the exact resume point back, the other forms resume at their common point L and the linear
layers' state is rebuilt by replaying the last R tokens from zero — approximate, flagged, and
never cached."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, CacheConfig, SamplingParams
from engine.events import CacheLookup, EventBatch, Form, Outcome, Reason, RequestEvent, check_batch
from engine.telemetry import ListSink
from tests.helpers import assert_no_leases, assert_warm_equals_cold, tokens

U = 16


def cache(**overrides: object) -> CacheConfig:
    base: dict[str, object] = {
        "unit_tokens": U,
        "checkpoint_interval_tokens": 64,
        "max_prefill_chunk_tokens": 64,
        "linear_checkpoints": 3,  # two slots: checkpoints are evicted long before KV pages
        "full_kv_blocks": 200,
        "replay_min_tokens": 32,
    }
    return CacheConfig(**(base | overrides))  # type: ignore[arg-type]


def evict_checkpoints(llm: LLM, prefix: list[int]) -> None:
    llm.score(prefix)
    for seed in range(3):  # unrelated prompts take every checkpoint slot
        llm.score(tokens(150, 100 + seed))


def test_replay_resumes_past_a_missing_checkpoint_flagged_and_uncached() -> None:
    sink = ListSink()
    llm = LLM("qwen3_next-tiny", cache=cache(tail_replay="fallback"), check_invariants=True, telemetry=sink)
    prefix = tokens(200, 60)
    evict_checkpoints(llm, prefix)
    follow_up = [*prefix, *tokens(30, 61)]
    index_before = llm.cache.index.snapshot()
    out = llm.score(follow_up)
    report = out.cache
    assert report.hash_hit_tokens == 192
    assert report.approximate and report.admission == "tail_replay"
    assert report.resume_tokens == 192 and report.replayed_tokens == 32  # 5 % of 192 → floor 32
    assert report.recoverable_tokens == 160
    assert report.recoverable_tokens + report.replayed_tokens + report.recomputed_tokens == len(follow_up)
    linear = report.form(Form.LINEAR_STATE)
    assert (linear.outcome, linear.reason, linear.replayed_tokens) == (
        Outcome.REPLAYED,
        Reason.LINEAR_CHECKPOINT_MISSING,
        32,
    )
    assert report.form(Form.FULL_KV).outcome == Outcome.HIT
    # logits for the computed positions L* − R … T − 1, close to (not equal to) a cold run
    cold = llm.prefill_logits(follow_up)
    assert out.logits.shape == (len(follow_up) - 160, llm.layout.vocab_size)
    assert torch.isfinite(out.logits).all()
    agree = (out.logits[32:].argmax(-1) == cold[192:].argmax(-1)).float().mean().item()
    assert agree > 0.5, agree
    # nothing the replayed request computed was cached, and nothing leaked
    assert llm.cache.index.snapshot() == index_before
    assert_no_leases(llm)
    # the events say the same, and pass the agent's checks
    lookup = next(e for e in sink.events if isinstance(e, CacheLookup) and e.form == Form.LINEAR_STATE and e.approximate)
    assert (lookup.outcome, lookup.replayed_tokens) == (Outcome.REPLAYED, 32)
    request = [e for e in sink.events if isinstance(e, RequestEvent)][-1]
    assert (request.approximate, request.replayed_tokens, request.recoverable_tokens) == (True, 32, 160)
    check_batch(EventBatch(schema_version=1, engine_id=llm.engine_id, seq=1, sent_at=1.0, events=sink.events[-3:]))


def test_off_by_default_and_exact_checkpoints_win() -> None:
    llm = LLM("qwen3_next-tiny", cache=cache(), check_invariants=True)
    prefix = tokens(200, 62)
    evict_checkpoints(llm, prefix)
    out = assert_warm_equals_cold(llm, [*prefix, *tokens(30, 63)])
    assert not out.approximate and out.cache.replayed_tokens == 0
    assert out.cache.form(Form.LINEAR_STATE).reason == Reason.LINEAR_CHECKPOINT_MISSING
    # with the option on, an exact checkpoint at the hit is used as it is
    replaying = LLM("qwen3_next-tiny", cache=cache(tail_replay="fallback"), check_invariants=True)
    replaying.score(prefix)
    exact = assert_warm_equals_cold(replaying, [*prefix, *tokens(30, 64)])
    assert not exact.approximate and exact.resume_tokens == 192


def test_replay_on_the_hybrid_only_where_every_other_form_can_start() -> None:
    """The hybrid's windows and compressor tails exist only at checkpoint positions (64, 128,
    192 here), so the replay start L − R must be one of them: R = 64 starts at 128 and
    replays; R = 32 would start at 160, where no window is stored, so the exact plan stands."""
    prefix, suffix = tokens(200, 65), tokens(30, 66)
    for replay_min, replays in ((64, True), (32, False)):
        config = cache(tail_replay="fallback", replay_min_tokens=replay_min, tail_slots=64, swa_blocks=128)
        llm = LLM(cache=config, check_invariants=True)
        evict_checkpoints(llm, prefix)
        out = llm.score([*prefix, *suffix])
        assert out.approximate == replays
        if replays:
            assert (out.resume_tokens, out.cache.replayed_tokens) == (192, 64)
            assert {f.form: f.outcome for f in out.forms} == {
                **{form: Outcome.HIT for form in Form},
                Form.LINEAR_STATE: Outcome.REPLAYED,
            }
        else:
            assert out.resume_tokens == 0
            cold = llm.prefill_logits([*prefix, *suffix])
            assert (out.logits - cold).abs().max().item() <= 1e-4
        assert_no_leases(llm)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"replay_fraction": 0.0}, "replay_fraction"),
        ({"replay_fraction": 1.5}, "replay_fraction"),
        ({"replay_min_tokens": 0}, "replay_min_tokens"),
        ({"replay_min_tokens": 128, "replay_max_tokens": 64}, "min <= max"),
    ],
)
def test_replay_settings_are_checked(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CacheConfig(**fields)  # type: ignore[arg-type]


def test_replayed_request_keeps_the_pages_it_matched() -> None:
    """The replay computes from L − R, but its lookup matched up to L: its own allocations must
    not evict the pages of [L − R, L) (case C8), so the prefix still hits afterwards."""
    llm = LLM("qwen3_next-tiny", cache=cache(tail_replay="fallback", full_kv_blocks=24), check_invariants=True)
    prefix = tokens(200, 60)
    llm.score(prefix)
    for seed in range(3):
        llm.score(tokens(40, 100 + seed))
    follow_up = [*prefix, *tokens(30, 61)]
    assert llm.cache.lookup(llm.cache.block_hashes(follow_up), len(follow_up)).hash_hit_tokens == 192
    out = llm.generate([follow_up], SamplingParams(max_tokens=8))[0]
    assert out.cache.approximate
    assert llm.cache.lookup(llm.cache.block_hashes(follow_up), len(follow_up)).hash_hit_tokens == 192
    assert_no_leases(llm)


def test_replay_length_stays_within_its_bounds() -> None:
    llm = LLM("qwen3_next-tiny", cache=cache(tail_replay="fallback", replay_min_tokens=40, replay_max_tokens=40))
    prefix = tokens(200, 67)
    evict_checkpoints(llm, prefix)
    out = llm.score([*prefix, *tokens(30, 68)])
    assert out.approximate and out.cache.replayed_tokens == 32  # 40 rounded down to U, never above


def test_replay_is_refused_where_its_extra_pages_would_not_fit() -> None:
    """The replayed rows need R/U pages of their own next to the pinned matched ones; with a
    full-KV pool that only fits the request itself the exact plan runs instead (no exhaustion)."""
    llm = LLM("qwen3_next-tiny", cache=cache(tail_replay="fallback", full_kv_blocks=17), check_invariants=True)
    prefix = tokens(200, 69)
    evict_checkpoints(llm, prefix)
    out = assert_warm_equals_cold(llm, [*prefix, *tokens(30, 70)])  # 15 pages + 2 replayed > 16
    assert not out.approximate
    assert_no_leases(llm)
