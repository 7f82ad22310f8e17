"""The hybrid prefix-cache failure cases (``shared/cases/hybrid_prefix_cache_cases.md``) and the
defects a review found, as deterministic tests: each docstring names the case and the behaviour
it holds the engine to."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, CacheConfig, SamplingParams
from engine.config import HybridConfig
from engine.events import Form, Outcome, Reason
from engine.telemetry import ListSink
from tests.helpers import assert_no_leases, assert_warm_equals_cold, tokens

U = 16
warm_equals_cold = assert_warm_equals_cold
no_leases = assert_no_leases


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- window retention, checkpoints and verdicts -------------------------------------------------------
def test_prefix_caching_disabled_still_trims_windows() -> None:
    """With ``enable_prefix_caching=False`` nothing is kept for later, so the window watermark
    follows the current position: a prompt far longer than the window pool runs (it once kept
    every page leased and exhausted the pool)."""
    cfg = CacheConfig(
        unit_tokens=U,
        checkpoint_interval_tokens=32,
        max_prefill_chunk_tokens=64,
        swa_blocks=16,
        enable_prefix_caching=False,
    )
    llm = LLM(cache=cfg, check_invariants=True)
    ids = tokens(400, 1)  # 25 pages; the window needs ~10 at a time; the pool has 15
    out = warm_equals_cold(llm, ids)
    assert out.resume_tokens == 0
    no_leases(llm)
    out = llm.generate([tokens(300, 2)], SamplingParams(max_tokens=20))[0]
    assert len(out.output_token_ids) == 20


def test_c1_junction_checkpoint_lets_the_third_request_hit() -> None:
    """Case C1: R1 = S + U1 with |S| = 70 leaves its only recurrent checkpoint inside U1 (the
    interval is 128). R2 = S + U2 reports ``linear_checkpoint_missing`` with full KV usable at
    64, and while prefilling R2 the engine takes a checkpoint at the junction (64, the aligned
    end of the shared part), so R3 = S + U3 resumes there."""
    cfg = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=128, max_prefill_chunk_tokens=64)
    llm = LLM(cache=cfg, check_invariants=True)
    shared = tokens(70, 3)
    warm_equals_cold(llm, shared + tokens(40, 4))
    r2 = warm_equals_cold(llm, shared + tokens(40, 5))
    lin = r2.cache.form(Form.LINEAR_STATE)
    full = r2.cache.form(Form.FULL_KV)
    assert (lin.outcome, lin.reason) == (Outcome.INVALIDATED, Reason.LINEAR_CHECKPOINT_MISSING)
    assert full.usable_tokens == 64 and r2.resume_tokens == 0
    r3 = warm_equals_cold(llm, shared + tokens(40, 6))
    assert r3.resume_tokens == 64, "no junction checkpoint was taken while prefilling R2"


def test_window_pages_past_the_last_checkpoint_are_evicted_before_its_window() -> None:
    """Cases C5/C7: R1 = 160 prompt tokens + 40 decoded; its last checkpoint is at 144, whose
    window is pages 5..8. Pages past the last checkpoint can never back a resume (in a model with
    linear layers), so they are released first and evicted before that window: an unrelated
    13-page request leaves R1's follow-up resuming at 144."""
    cfg = CacheConfig(
        unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64, swa_blocks=20
    )
    llm = LLM(cache=cfg, check_invariants=True)
    a = tokens(160, 7)
    out = llm.generate([a], SamplingParams(max_tokens=40))[0]
    follow_up = a + out.output_token_ids + tokens(5, 8)
    llm.score(tokens(192, 9))  # 12 pages: harmless
    assert llm.score(follow_up).resume_tokens == 144
    llm2 = LLM(cache=cfg, check_invariants=True)
    llm2.generate([a], SamplingParams(max_tokens=40))
    llm2.score(tokens(208, 9))  # 13 pages: must still not touch the window at 144
    r = warm_equals_cold(llm2, follow_up)
    assert r.resume_tokens == 144, (
        f"L* fell to {r.resume_tokens}: the window behind the last checkpoint was evicted while pages "
        "past it stayed cached"
    )


def test_limiting_form_is_never_reported_as_a_hit() -> None:
    """The form that set L* carries the request's limiting reason in its own lookup: here the
    follow-up's hash hit reaches into R1's decoded tokens (192) but its last checkpoint is at
    144, so ``linear_state`` limits and says so. The window behind 144 survived the unrelated
    request; the window form's own loss past 144 is ``below_granularity`` (decoded tokens have no
    checkpoint, so their window pages are never stored), and it does not mask the real cause."""
    cfg = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64, swa_blocks=20)
    llm = LLM(cache=cfg, check_invariants=True)
    a = tokens(160, 7)
    out = llm.generate([a], SamplingParams(max_tokens=40))[0]
    llm.score(tokens(208, 9))
    report = warm_equals_cold(llm, a + out.output_token_ids + tokens(5, 8)).cache
    assert (report.hash_hit_tokens, report.resume_tokens) == (192, 144)
    assert (report.limiting_form, report.limiting_reason) == (Form.LINEAR_STATE, Reason.LINEAR_CHECKPOINT_MISSING)
    lin, swa = report.form(Form.LINEAR_STATE), report.form(Form.SWA_WINDOW)
    assert (lin.outcome, lin.reason, lin.usable_tokens) == (Outcome.INVALIDATED, Reason.LINEAR_CHECKPOINT_MISSING, 144)
    assert (swa.outcome, swa.reason, swa.usable_tokens) == (Outcome.INVALIDATED, Reason.BELOW_GRANULARITY, 144)


def test_window_never_stored_is_below_granularity_not_evicted() -> None:
    """With linear layers the window form stores pages only behind checkpoints. R2 shares 64
    tokens with R1, whose only checkpoint is at 96: the window at 64 was never stored (nothing
    was evicted), so the window form says ``below_granularity`` and the request names the
    missing checkpoint as the cause — raising the window's memory would not help."""
    cfg = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=128, max_prefill_chunk_tokens=64)
    llm = LLM(cache=cfg, check_invariants=True)
    shared = tokens(70, 33)
    warm_equals_cold(llm, shared + tokens(40, 34))
    r2 = warm_equals_cold(llm, shared + tokens(40, 35)).cache
    assert all(f.pool.evictions == 0 for f in llm.cache.forms)
    assert (r2.hash_hit_tokens, r2.resume_tokens) == (64, 0)
    swa = r2.form(Form.SWA_WINDOW)
    assert (swa.outcome, swa.reason) == (Outcome.INVALIDATED, Reason.BELOW_GRANULARITY)
    assert (r2.limiting_form, r2.limiting_reason) == (Form.LINEAR_STATE, Reason.LINEAR_CHECKPOINT_MISSING)


# -- exactness under faults, decode and reuse ---------------------------------------------------------
def test_c11_checkpoint_keyed_by_exactly_its_prefix() -> None:
    """Case C11: R1 = P + hidden reasoning + answer (decoded); R2 = P + U must not resume from a
    state that includes R1's decoded tokens."""
    llm = LLM(
        cache=CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64)
    )
    p = tokens(100, 10)
    llm.generate([p], SamplingParams(max_tokens=60))
    r2 = warm_equals_cold(llm, p + tokens(30, 11))
    assert r2.resume_tokens == 96  # the checkpoint at P's last boundary, not anything later
    r3 = warm_equals_cold(llm, p[:64] + tokens(30, 12))
    assert r3.resume_tokens == 64


def test_model_fault_mid_chunk_releases_everything_and_publishes_nothing_partial() -> None:
    """A kernel failure inside the last layer of the second chunk: every lease is released,
    only the first chunk's committed pages are published, and the next request is exact."""
    cfg = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64)
    llm = LLM(cache=cfg, check_invariants=True, telemetry=ListSink())
    ids = tokens(200, 13)
    layer = llm.model.layers[-1]
    original = layer.forward
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected kernel failure")
        return original(*args, **kwargs)

    layer.forward = failing
    try:
        with pytest.raises(RuntimeError, match="injected"):
            llm.score(ids)
    finally:
        del layer.forward
    no_leases(llm)
    full = llm.cache.forms[0]
    assert full.pool.num_cached == 2  # chunk [0, 32) committed (checkpoint at 32); nothing after
    out = warm_equals_cold(llm, ids)
    assert out.resume_tokens == 32
    no_leases(llm)


def test_request_too_large_changes_nothing() -> None:
    cfg = CacheConfig(
        unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64, full_kv_blocks=12
    )
    llm = LLM(cache=cfg, check_invariants=True)
    a = tokens(100, 14)
    warm_equals_cold(llm, a)
    before = llm.cache.index.snapshot()
    with pytest.raises(ValueError, match="full_kv"):
        llm.generate([a + tokens(80, 15)], SamplingParams(max_tokens=20))
    assert llm.cache.index.snapshot() == before
    no_leases(llm)
    assert warm_equals_cold(llm, a + tokens(10, 16)).resume_tokens == 96


ALL_SWA = HybridConfig(layer_types=("sliding_attention", "sliding_attention"), sliding_window=40, revision="all-swa")


def test_c6_window_slots_freed_during_decode_are_not_reused_as_cached() -> None:
    """Case C6 on an all-SWA model: R1 decodes far past W (pages leave the window and return to
    the pool); R2 reuses freed slots; R3 matches R1's prefix and decoded tokens — exact."""
    cfg = CacheConfig(
        unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=32, swa_blocks=16
    )
    llm = LLM(ALL_SWA, cache=cfg, check_invariants=True)
    r1 = tokens(90, 17)
    out = llm.generate([r1], SamplingParams(max_tokens=60))[0]
    warm_equals_cold(llm, tokens(120, 18))  # R2 overwrites recycled slots
    r3 = warm_equals_cold(llm, r1 + out.output_token_ids + tokens(9, 19))
    assert r3.cache.hash_hit_tokens >= 144
    no_leases(llm)


def test_sentinel_slots_stay_zero() -> None:
    """Case C10 precondition: no request ever writes block 0 of any pool."""
    cfg = CacheConfig(
        unit_tokens=U,
        checkpoint_interval_tokens=32,
        max_prefill_chunk_tokens=64,
        swa_blocks=16,
        full_kv_blocks=20,
        linear_checkpoints=3,
    )
    llm = LLM(cache=cfg, check_invariants=True)
    for seed in range(6):
        llm.generate([tokens(40 + 37 * seed, 20 + seed)], SamplingParams(max_tokens=17))
    for form in llm.cache.kv_forms:
        assert form.kv[0].abs().max().item() == 0.0
    assert llm.cache.linear is not None
    assert llm.cache.linear.conv[0].abs().max().item() == 0.0
    assert llm.cache.linear.recurrent[0].abs().max().item() == 0.0


def test_window_pages_are_published_only_where_a_resume_point_needs_them() -> None:
    """Case C12: one predicate decides what the window form stores and what its lookup accepts.
    With linear layers a resume point needs a checkpoint, so only the pages in the window before
    a checkpoint are published: for T = 200, interval 128 and W = 64 the checkpoints are at 128
    and 192 (the last boundary before the end), whose windows cover pages 4..7 and 8..11."""
    cfg = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=128, max_prefill_chunk_tokens=64)
    llm = LLM(cache=cfg, check_invariants=True)
    ids = tokens(200, 30)
    warm_equals_cold(llm, ids)
    full, swa = llm.cache.kv_forms
    assert full.pool.num_cached == 12
    hashes = llm.cache.block_hashes(ids)
    assert [swa.pool.lookup(h) is not None for h in hashes] == [False] * 4 + [True] * 8
    for follow_up, resume in ((ids + tokens(7, 31), 192), (ids[:150] + tokens(20, 32), 128)):
        assert warm_equals_cold(llm, follow_up).resume_tokens == resume
    no_leases(llm)
