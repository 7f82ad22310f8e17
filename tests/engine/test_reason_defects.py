"""One small deterministic test per reason defect the oracle (tests/engine/reason_oracle.py)
names: each asserts the TRUE reason, the one an operator should act on (each failed before its
fix)."""

from __future__ import annotations

from engine import LLM, CacheConfig, SamplingParams
from engine.cache.admission import CostModel
from engine.events import Admission, CacheLookup, Form, Outcome, Reason, RequestEvent, Tier
from engine.faults import Faults
from engine.telemetry import ListSink
from tests.helpers import assert_no_leases, tokens

U = 16
FAST = CostModel(seconds_per_token=1e-3, tier_bytes_per_second={Tier.HOST: 1e12, Tier.DISK: 1e12})
"""Swap-ins far cheaper than recompute: admission always swaps in."""


def _events(sink: ListSink, request_id: str) -> tuple[RequestEvent, dict[Form, CacheLookup]]:
    req = next(e for e in sink.events if isinstance(e, RequestEvent) and e.request_id == request_id)
    return req, {
        e.form: e for e in sink.events if isinstance(e, CacheLookup) and e.request_id == request_id
    }


def test_swap_in_limited_by_the_form_the_tier_lacks_names_it_tier_incomplete() -> None:
    """Defect 1. The host tier holds every full_kv page of a 144-token prefix but the recurrent
    checkpoint at 144 is gone from every tier (only the one at 128 is left): the swap-in resumes
    at 128. full_kv was restorable to 144, so linear_state is the limit, ``tier_incomplete``."""
    sink = ListSink()
    cfg = CacheConfig(
        checkpoint_interval_tokens=64, max_prefill_chunk_tokens=64, host_tier_bytes=64 << 20
    )
    llm = LLM(
        "qwen3_next-tiny",
        device="cpu",
        cache=cfg,
        telemetry=sink,
        check_invariants=True,
        cost_model=FAST,
    )
    prompt = tokens(148, 1)  # checkpoints at 64, 128 and 144 (the last boundary before the end)
    llm.score(prompt)
    llm.offload(Tier.HOST)
    hashes = llm.cache.block_hashes(prompt)
    assert llm.cache.tiers is not None
    llm.cache.tiers.drop(
        "linear_state", hashes[144 // U - 1]
    )  # the tier loses the deepest checkpoint
    out = llm.score([*prompt, *tokens(20, 2)])
    req, forms = _events(sink, out.request_id)
    assert req.admission is Admission.SWAP_IN and req.resume_tokens == 128
    assert forms[Form.LINEAR_STATE].reason is Reason.TIER_INCOMPLETE
    assert (req.limiting_form, req.limiting_reason) == (Form.LINEAR_STATE, Reason.TIER_INCOMPLETE)
    assert (
        forms[Form.FULL_KV].outcome is Outcome.RECOVERED
        and forms[Form.FULL_KV].usable_tokens == 144
    )
    assert_no_leases(llm)


def test_window_evicted_behind_the_only_stored_boundary_is_swa_evicted() -> None:
    """Defect 2. A 100-token prompt stores its window behind the checkpoints at 64 and 96; its 61
    decoded tokens (the last one never computed) publish full pages up to 160, never a window
    page (no checkpoint there), so the window of the target 160 was never stored. With every
    window page evicted, the point 96 — the highest stored boundary past the window's usable 0 —
    is lost to an eviction: ``swa_evicted``, not ``below_granularity`` (the reason of 160, never
    a stored boundary)."""
    cfg = CacheConfig(checkpoint_interval_tokens=64, max_prefill_chunk_tokens=64, swa_blocks=64)
    llm = LLM("kvscope_hybrid-tiny", device="cpu", cache=cfg, check_invariants=True)
    prompt = tokens(100, 3)
    out = llm.generate([prompt], SamplingParams(max_tokens=61, temperature=0.0))[0]
    follow_up = [*prompt, *out.output_token_ids, *tokens(9, 4)]
    window = next(f for f in llm.cache.kv_forms if f.form is Form.SWA_WINDOW).window
    assert window is not None and 160 - window + 1 > 96  # the target's window lies past every stored page
    llm.cache.limit_cached(Form.SWA_WINDOW, 0)  # every cached window page evicted
    plan = llm.cache.lookup(llm.cache.block_hashes(follow_up), len(follow_up))
    assert plan.hash_hit_tokens == 160
    swa = plan.form(Form.SWA_WINDOW)
    assert swa.usable_tokens == 0
    assert swa.reason is Reason.SWA_EVICTED
    assert_no_leases(llm)


def test_tier_read_refused_for_a_changed_epoch_is_epoch_changed() -> None:
    """Defect 3. A prefetch's swap-in of a full_kv page is held in flight; meanwhile the tier
    drops that entry (its device copy declared wrong), so the read is refused when it lands
    (epoch changed). The request that waited for it must say ``epoch_changed``, not that the
    page was evicted."""
    sink = ListSink()
    cfg = CacheConfig(
        checkpoint_interval_tokens=64, max_prefill_chunk_tokens=64, host_tier_bytes=64 << 20
    )
    llm = LLM("qwen3_next-tiny", device="cpu", cache=cfg, telemetry=sink, check_invariants=True, cost_model=FAST,
              faults=Faults(read_during_swap_in=True))  # fmt: skip
    prompt = tokens(128, 5)
    llm.score(prompt)
    llm.offload(Tier.HOST)
    follow_up = [*prompt, *tokens(20, 6)]
    assert llm.prefetch(follow_up) > 0
    hashes = llm.cache.block_hashes(follow_up)
    assert llm.cache.tiers is not None
    llm.cache.tiers.drop("full_kv", hashes[3])  # in flight: doomed, refused when the copy ends
    out = llm.score(follow_up)
    req, forms = _events(sink, out.request_id)
    assert forms[Form.FULL_KV].usable_tokens == 48
    assert forms[Form.FULL_KV].reason is Reason.EPOCH_CHANGED
    assert (req.limiting_form, req.limiting_reason) == (Form.FULL_KV, Reason.EPOCH_CHANGED)
    assert_no_leases(llm)


def test_indexer_keys_evicted_where_no_rows_were_ever_stored_is_below_granularity() -> None:
    """Found by the oracle. deepseek_v4-tiny stores indexer pending rows only at checkpoint
    positions; a target between them whose key page was evicted cannot be served whatever the
    pool size (its rows were never stored): ``below_granularity``. The engine names the evicted
    key page (``indexer_stale``) because it checks the key pages first."""
    cfg = CacheConfig(
        checkpoint_interval_tokens=64, max_prefill_chunk_tokens=64, compressed_blocks=64
    )
    llm = LLM("deepseek_v4-tiny", device="cpu", cache=cfg, check_invariants=True)
    prompt = tokens(100, 7)  # rows stored at 64 and 96
    out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0]
    follow_up = [*prompt, *out.output_token_ids, *tokens(9, 8)]
    hashes = llm.cache.block_hashes(follow_up)
    assert llm.cache.indexer is not None
    for keys in llm.cache.indexer.keys:  # evict the key page ending at 112 (nothing else)
        block = keys.pool.lookup(hashes[112 // U - 1])
        assert block is not None
        keys.pool.evict(block)
    plan = llm.cache.lookup(hashes, len(follow_up))
    indexer = plan.form(Form.INDEXER_STATE)
    assert plan.hash_hit_tokens >= 112 and indexer.usable_tokens == 96
    assert indexer.reason is Reason.BELOW_GRANULARITY
    assert_no_leases(llm)


def test_a_window_point_needing_a_never_stored_page_is_not_a_stored_point() -> None:
    """Found in review. Checkpoints at 128 and 256 store the window pages 4–7 and 12–15; a
    follow-up's hash hit is 208, where the window needs pages 9–12 — 9–11 never stored. Evicting
    page 12 (which only the point 256 reads) must not turn the window's loss past 128 into
    ``swa_evicted`` nor make it the named limit: no point in (128, 208] was ever stored."""
    cfg = CacheConfig(checkpoint_interval_tokens=128, max_prefill_chunk_tokens=128)
    llm = LLM("kvscope_hybrid-tiny", device="cpu", cache=cfg, check_invariants=True)
    prompt = tokens(260, 3)
    llm.score(prompt)
    swa = next(f for f in llm.cache.kv_forms if f.form is Form.SWA_WINDOW)
    block = swa.pool.lookup(llm.cache.block_hashes(prompt)[12])
    assert block is not None
    swa.pool.evict(block)
    follow_up = [*prompt[:215], *tokens(20, 4)]
    plan = llm.cache.lookup(llm.cache.block_hashes(follow_up), len(follow_up))
    assert (plan.hash_hit_tokens, plan.resume_tokens) == (208, 128)
    window = plan.form(Form.SWA_WINDOW)
    assert (window.usable_tokens, window.reason) == (128, Reason.BELOW_GRANULARITY)
    assert (plan.limiting_form, plan.limiting_reason) == (Form.LINEAR_STATE, Reason.LINEAR_CHECKPOINT_MISSING)


def test_a_refused_prefetch_past_the_first_gap_does_not_relabel_an_eviction() -> None:
    """Found in review. A prefetch's copy of full_kv page 3 is refused (its entry dropped while in
    flight), then page 1 is evicted from the device and from every tier: full_kv lacks page 1
    first — a plain eviction, ``kv_evicted``, not the refusal's ``epoch_changed``."""
    sink = ListSink()
    cfg = CacheConfig(checkpoint_interval_tokens=64, max_prefill_chunk_tokens=64, host_tier_bytes=64 << 20)
    llm = LLM("qwen3_next-tiny", device="cpu", cache=cfg, telemetry=sink, check_invariants=True, cost_model=FAST,
              faults=Faults(read_during_swap_in=True))  # fmt: skip
    prompt = tokens(128, 5)
    llm.score(prompt)
    llm.offload(Tier.HOST)
    follow_up = [*prompt, *tokens(20, 6)]
    hashes = llm.cache.block_hashes(follow_up)
    assert llm.prefetch(follow_up) > 0
    tiers = llm.cache.tiers
    assert tiers is not None
    tiers.drop("full_kv", hashes[3])  # in flight: refused when it lands
    llm.cache.settle(wait=True)  # the refusal is remembered for the next lookup
    full = next(f for f in llm.cache.kv_forms if f.form is Form.FULL_KV)
    block = full.pool.lookup(hashes[1])
    assert block is not None
    full.pool.evict(block)
    tiers.drop("full_kv", hashes[1])
    out = llm.score(follow_up)
    _, forms = _events(sink, out.request_id)
    assert (forms[Form.FULL_KV].usable_tokens, forms[Form.FULL_KV].reason) == (16, Reason.KV_EVICTED)
    assert_no_leases(llm)
