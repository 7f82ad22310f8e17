"""deterministic reproductions of prefix-cache findings, and regression tests of the
hybrid-cache failure cases (``shared/cases/hybrid_prefix_cache_cases.md``) that held up.

A test that fails today marks a real defect; the docstring names the case and the expected
behaviour.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, CacheConfig, SamplingParams
from engine.config import HybridConfig
from engine.events import Form, Outcome, Reason
from engine.telemetry import ListSink

U = 16
TOL = 1e-4


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def warm_equals_cold(llm: LLM, ids: list[int]):
    out = llm.score(ids)
    cold = llm.prefill_logits(ids)[out.resume_tokens :]
    assert out.logits.shape == cold.shape
    assert (out.logits - cold).abs().max().item() <= TOL
    return out


def no_leases(llm: LLM) -> None:
    llm.cache.check_invariants()
    for f in llm.cache.forms:
        assert f.pool.num_leased == 0, f"{f.form}: {f.pool.num_leased} blocks leaked"


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- findings (fail today) ---------------------------------------------------------------------------
def test_prefix_caching_disabled_still_trims_windows() -> None:
    """With ``enable_prefix_caching=False`` no checkpoint is taken, so ``last_checkpoint`` stays
    at 0 and the window watermark ``min(end, last_checkpoint) − W`` never moves: every sliding
    page of the prompt stays leased and a prompt that passed ``_check_fits`` exhausts the
    ``swa_window`` pool (``PoolExhausted``, not even ``RequestTooLarge``)."""
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
    interval is 128). R2 = S + U2 correctly reports ``linear_checkpoint_missing`` with full KV
    usable at 64 — but while prefilling R2 the engine must take a checkpoint at the junction
    (64, the aligned end of the shared part), so that R3 = S + U3 resumes there. Today R2 stores
    checkpoints only at interval multiples and at its own last boundary, so reuse stays 0
    forever for this sharing pattern."""
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
    """Cases C5/C7 and docs/cache-forms.md ("window pages head first, so each boundary's window
    tail is evicted last"). R1 = 160 prompt tokens + 40 decoded: its last checkpoint is at 144,
    whose window is pages 5..8. ``finish`` releases the sliding pages head first, so pages 9..11
    (tokens 144..191, past the last checkpoint: no resume point can ever use them in a model with
    linear layers) land at the most-recently-used end and outlive the window the follow-up needs.
    An unrelated 208-token request needs 13 pages; 15 evictable pages are useless to R1 (7 never
    written, pages 0..4, pages 9..11), yet it evicts page 5 and R1's follow-up drops from
    L* = 144 to L* = 0 (the per-form view still says ``swa_window: hit``)."""
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


def test_limiting_form_is_not_reported_as_a_hit() -> None:
    """A window is not downward closed: ``swa_window`` can resume at the hash hit (192) but not at
    the linear checkpoint (144) nor any lower one, so it drives L* to 0 and is the request's
    ``limiting_form`` with ``swa_evicted`` — yet its own ``cache_lookup`` says ``hit``/``none``
    (usable 192), because the verdict compares usable with the hash hit only. The dashboard's
    per-form reasons, ``form_outcomes`` and ``kvscope_invalidations_total{reason="swa_evicted"}``
    then never show the form that cost the whole prefix. The form that vetoed L* must carry the
    request's limiting reason."""
    cfg = CacheConfig(
        unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64, swa_blocks=20
    )
    llm = LLM(cache=cfg, check_invariants=True)
    a = tokens(160, 7)
    out = llm.generate([a], SamplingParams(max_tokens=40))[0]
    llm.score(tokens(208, 9))
    r = warm_equals_cold(llm, a + out.output_token_ids + tokens(5, 8))
    report = r.cache
    assert report.limiting_form == Form.SWA_WINDOW and report.limiting_reason == Reason.SWA_EVICTED
    swa = report.form(Form.SWA_WINDOW)
    assert (swa.outcome, swa.reason) == (Outcome.INVALIDATED, Reason.SWA_EVICTED), swa


# -- regressions that hold today ---------------------------------------------------------------------
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
