"""Warm equals cold: ``score()`` through the prefix cache gives the logits of a full recompute
(float32, max abs difference ≤ 1e-4), and each form reports why it could or could not resume."""

from __future__ import annotations

import pytest

from engine import LLM, CacheConfig, SamplingParams
from engine.events import CacheLookup, Form, Outcome, Reason, RequestEvent
from engine.telemetry import ListSink
from tests.helpers import assert_warm_equals_cold, tokens

U = 16
SMALL = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64)


@pytest.fixture
def llm() -> LLM:
    return LLM(cache=SMALL, check_invariants=True, telemetry=ListSink())


def test_shared_prefixes_of_many_lengths(llm: LLM) -> None:
    base = tokens(200, 0)
    assert_warm_equals_cold(llm, base)
    for n in (15, 16, 17, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 191, 192, 199):
        ids = base[:n] + tokens(23, n)
        out = assert_warm_equals_cold(llm, ids)
        assert out.resume_tokens <= out.cache.hash_hit_tokens
        assert out.cache.hash_hit_tokens >= (n // U) * U  # the shared full blocks are indexed


def test_resume_points_are_exact(llm: LLM) -> None:
    base = tokens(200, 1)
    first = assert_warm_equals_cold(llm, base)
    assert first.resume_tokens == 0
    assert {f.outcome for f in first.forms} == {Outcome.MISS}
    # checkpoints were taken at 32, 64, ..., 192 (interval) and 192 (the last boundary < 200)
    out = assert_warm_equals_cold(llm, base + tokens(10, 2))
    assert out.cache.hash_hit_tokens == 192 and out.resume_tokens == 192
    assert {(f.form, f.outcome) for f in out.forms} == {
        (Form.FULL_KV, Outcome.HIT),
        (Form.SWA_WINDOW, Outcome.HIT),
        (Form.COMPRESSED_KV, Outcome.HIT),
        (Form.UNCOMPRESSED_TAIL, Outcome.HIT),
        (Form.INDEXER_STATE, Outcome.HIT),
        (Form.LINEAR_STATE, Outcome.HIT),
    }


def test_linear_checkpoint_missing_lowers_resume_point(llm: LLM) -> None:
    a = tokens(100, 3)  # checkpoints at 32, 64 and 96 (the last boundary before 100)
    assert_warm_equals_cold(llm, a)
    out = assert_warm_equals_cold(llm, a[:90] + tokens(30, 4))
    assert out.cache.hash_hit_tokens == 80
    lin = out.cache.form(Form.LINEAR_STATE)
    assert (lin.outcome, lin.reason, lin.usable_tokens) == (Outcome.INVALIDATED, Reason.LINEAR_CHECKPOINT_MISSING, 64)
    full = out.cache.form(Form.FULL_KV)
    assert (full.outcome, full.usable_tokens, full.recoverable_tokens) == (Outcome.HIT, 80, 64)
    assert out.resume_tokens == 64
    assert out.cache.limiting_form == Form.LINEAR_STATE


def test_prompt_length_exact_multiple_of_block(llm: LLM) -> None:
    """Case C3: a cached prompt of k·U tokens sent again resumes strictly before its end."""
    ids = tokens(12 * U, 5)
    assert_warm_equals_cold(llm, ids)
    again = assert_warm_equals_cold(llm, ids)
    assert again.cache.hash_hit_tokens == 12 * U
    assert again.resume_tokens == 11 * U  # the checkpoint at the last boundary before the end
    assert again.cache.limiting_reason == Reason.PROMPT_END
    for n in (12 * U - 1, 12 * U + 1, 11 * U):
        assert_warm_equals_cold(llm, ids[:n])


def test_whole_prompt_hit(llm: LLM) -> None:
    ids = tokens(150, 6)
    assert_warm_equals_cold(llm, ids)
    again = assert_warm_equals_cold(llm, ids)
    assert again.resume_tokens == 144  # 150 → last boundary strictly before the end
    assert {f.outcome for f in again.forms} == {Outcome.HIT}


def test_window_evicted_between_requests_falls_back() -> None:
    """Pool pressure evicts A's window pages (full KV stays): A's follow-up must not resume on
    a broken window; the window form says ``swa_evicted`` and the output equals cold."""
    sink = ListSink()
    cache = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64, swa_blocks=16)
    llm = LLM(cache=cache, check_invariants=True, telemetry=sink)
    a = tokens(160, 7)
    assert_warm_equals_cold(llm, a)
    for seed in (8, 108, 208):  # unrelated traffic cycles the small window pool (each request's
        assert_warm_equals_cold(llm, tokens(400, seed))  # own window tail is evicted last, so several)
    out = assert_warm_equals_cold(llm, a + tokens(20, 9))
    swa = out.cache.form(Form.SWA_WINDOW)
    full = out.cache.form(Form.FULL_KV)
    assert (swa.outcome, swa.reason) == (Outcome.INVALIDATED, Reason.SWA_EVICTED)
    assert full.outcome == Outcome.HIT and full.usable_tokens == 160
    assert swa.usable_tokens < full.usable_tokens
    assert out.resume_tokens <= swa.usable_tokens
    assert out.cache.limiting_form == Form.SWA_WINDOW
    assert out.cache.limiting_reason == Reason.SWA_EVICTED
    last = [e for e in sink.events if isinstance(e, CacheLookup)][-len(llm.cache.forms) :]
    assert {(e.form, e.outcome, e.reason) for e in last} >= {(Form.SWA_WINDOW, Outcome.INVALIDATED, Reason.SWA_EVICTED)}


def test_generate_warm_equals_generate_cold() -> None:
    prompt = tokens(170, 12)
    warm = LLM(cache=SMALL, check_invariants=True)
    warm.generate([prompt[:120] + tokens(40, 13)], SamplingParams(max_tokens=5))  # shares 112 tokens
    out_warm = warm.generate([prompt], SamplingParams(max_tokens=12))[0]
    out_cold = LLM(cache=SMALL).generate([prompt], SamplingParams(max_tokens=12))[0]
    assert out_warm.cache.resume_tokens > 0 and out_cold.cache.resume_tokens == 0
    assert out_warm.output_token_ids == out_cold.output_token_ids
    # decoding published the generated tokens' pages: a follow-up on prompt + output hits them
    follow = warm.score(prompt + out_warm.output_token_ids + tokens(5, 14))
    assert follow.cache.hash_hit_tokens == ((170 + 12) // U) * U


def test_events_one_lookup_per_form_and_one_request() -> None:
    sink = ListSink()
    llm = LLM(cache=SMALL, telemetry=sink, engine_id="e-test")
    ids = tokens(90, 15)
    llm.generate([ids], SamplingParams(max_tokens=3), request_ids=["r1"])
    llm.generate([ids + tokens(20, 16)], SamplingParams(max_tokens=3), request_ids=["r2"])
    lookups = [e for e in sink.events if isinstance(e, CacheLookup)]
    requests = [e for e in sink.events if isinstance(e, RequestEvent)]
    assert [(e.request_id, e.form) for e in lookups] == [
        (r, f) for r in ("r1", "r2") for f in Form  # the hybrid keeps all six forms
    ]
    assert [r.request_id for r in requests] == ["r1", "r2"]
    r2 = requests[1]
    assert r2.prompt_tokens == 110 and r2.output_tokens == 3
    assert r2.resume_tokens == r2.recoverable_tokens == 80  # checkpoint at 80 (last boundary < 90)
    assert r2.recomputed_tokens == 30 and r2.hash_hit_tokens == 80
    assert r2.admission == "exact" and requests[0].admission == "cold"
    assert all(e.engine_id == "e-test" and e.model == "kvscope_hybrid-tiny" for e in lookups + requests)


def test_bad_prompts_are_rejected_clearly() -> None:
    llm = LLM(cache=SMALL)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.score([])
    with pytest.raises(ValueError, match="token id 300 at position 1"):
        llm.score([1, 300, 2])
    small = LLM(cache=CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64, full_kv_blocks=5))
    with pytest.raises(ValueError, match="needs 7 full_kv pages; the pool has 4"):
        small.score(tokens(100, 17))
    with pytest.raises(ValueError, match="swa_blocks"):
        LLM(cache=CacheConfig(swa_blocks=4))


def test_a_squeezed_window_pool_falls_back_then_refills() -> None:
    """``limit_cached(SWA_WINDOW, 0)`` (the ``up --squeeze-window-pool`` drill) evicts every
    cached window page at once and keeps none after each request: a follow-up cannot resume on
    its window (``swa_evicted``) and equals cold; lifting the cap lets the cache refill."""
    llm = LLM(cache=SMALL, check_invariants=True, telemetry=ListSink())
    a = tokens(160, 21)
    assert_warm_equals_cold(llm, a)
    assert llm.cache.limit_cached(Form.SWA_WINDOW, 0) > 0
    pool = next(f.pool for f in llm.cache.kv_forms if f.form is Form.SWA_WINDOW)
    assert pool.num_cached == 0
    out = assert_warm_equals_cold(llm, a + tokens(20, 22))
    assert (out.cache.form(Form.SWA_WINDOW).reason, out.cache.limiting_form) == (Reason.SWA_EVICTED, Form.SWA_WINDOW)
    assert pool.num_cached == 0  # released pages were evicted at once
    assert llm.cache.limit_cached(Form.SWA_WINDOW, None) == 0
    b = tokens(160, 23)
    assert_warm_equals_cold(llm, b)
    again = assert_warm_equals_cold(llm, b + tokens(20, 24))
    assert again.cache.form(Form.SWA_WINDOW).outcome == Outcome.HIT and again.resume_tokens > 0
    with pytest.raises(ValueError, match="max_cached must be >= 0"):
        llm.cache.limit_cached(Form.SWA_WINDOW, -1)
    with pytest.raises(ValueError, match="no paged linear_state pool"):
        llm.cache.limit_cached(Form.LINEAR_STATE, 0)


def test_occupancy_never_mixes_pools() -> None:
    """A form with several pools (indexer keys and pending rows, compressor geometries) reports
    the counts of its fullest pool: used never exceeds total, and free + used stays within it."""
    # few pending-row slots, many indexer key pages: mixing the pools would report 18 of 3 used
    llm = LLM(cache=CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64, tail_slots=4))
    llm.score(tokens(300, 31))
    occupancy = llm.cache.occupancy()
    assert {o.form for o in occupancy} == set(Form)
    for o in occupancy:
        assert 0 <= o.used_blocks <= o.total_blocks and o.free_blocks <= o.total_blocks, o
        assert o.cached_blocks <= o.used_blocks, o
    assert any(o.used_blocks > 0 for o in occupancy)
