"""Reason defects the reason oracle (tests/engine/reason_oracle.py) found in the engine: one
small deterministic test each, asserting the TRUE reason (each failed before its fix: 6bb8d7c,
ccd0f32, and the last two before the commit that added them)."""

from __future__ import annotations

from pathlib import Path

from engine import LLM, CacheConfig, SamplingParams
from engine.cache.admission import CostModel
from engine.events import Admission, CacheLookup, Form, Reason, RequestEvent, Tier
from engine.faults import Faults
from engine.telemetry import ListSink
from tests.helpers import assert_no_leases, tokens

U = 16
FAST = CostModel(seconds_per_token=1e-3, tier_bytes_per_second={Tier.HOST: 1e12, Tier.DISK: 1e12})


def test_a_compressed_point_one_group_never_stored_is_below_granularity_whatever_the_others() -> None:
    """deepseek_v4-tiny, fault ``groups_disagree``: the r16 group never stores its last entry
    page (ending at 96), so ``compressed_kv`` resumes at 80 (``group_disagree`` while r4 holds
    its page at 96). Evicting r4's page at 96 leaves no group able to serve 96, but the point was
    never servable (r16's page there was never stored): ``below_granularity``, as for an indexer
    point whose rows were never stored — not ``compressed_evicted``, which more memory would not
    fix (fixed in 6bb8d7c: the engine named the first group's reason)."""
    cfg = CacheConfig(
        checkpoint_interval_tokens=64, max_prefill_chunk_tokens=64, compressed_blocks=64
    )
    llm = LLM(
        "deepseek_v4-tiny",
        device="cpu",
        cache=cfg,
        check_invariants=True,
        faults=Faults(groups_disagree=True),
    )
    prompt = tokens(100, 7)
    llm.score(prompt)
    follow_up = [*prompt, *tokens(9, 8)]
    hashes = llm.cache.block_hashes(follow_up)
    compressed = llm.cache.compressed
    assert compressed is not None and len(compressed.groups) == 2
    first, last = compressed.groups
    assert last.pool.lookup(hashes[96 // U - 1]) is None  # never stored (the fault)
    before = llm.cache.lookup(hashes, len(follow_up)).form(Form.COMPRESSED_KV)
    assert (before.usable_tokens, before.reason) == (80, Reason.GROUP_DISAGREE)
    block = first.pool.lookup(hashes[96 // U - 1])
    assert block is not None
    first.pool.evict(block)
    after = llm.cache.lookup(hashes, len(follow_up)).form(Form.COMPRESSED_KV)
    assert after.usable_tokens == 80
    assert after.reason is Reason.BELOW_GRANULARITY
    assert_no_leases(llm)


def test_an_in_flight_key_page_where_rows_were_never_stored_is_below_granularity() -> None:
    """deepseek_v4-tiny stores indexer pending rows only at checkpoint positions (here 32, the
    last boundary before the end of a 33-token prompt), never at 16. Its key page at 16 is
    offloaded and a prefetch holds its copy in flight (fault ``read_during_swap_in``, no
    waiting). A prompt sharing only the first 16 tokens cannot resume the indexer at 16 however
    long it waits: the rows there were never stored, ``below_granularity`` (as for an evicted
    key page there) — not ``in_flight_swap``."""
    cfg = CacheConfig(
        checkpoint_interval_tokens=64,
        max_prefill_chunk_tokens=64,
        host_tier_bytes=4 << 20,
        swap_in_wait=False,
    )
    llm = LLM("deepseek_v4-tiny", device="cpu", cache=cfg, check_invariants=True, cost_model=FAST,
              faults=Faults(read_during_swap_in=True))  # fmt: skip
    prompt = tokens(33, 1)
    llm.score(prompt)
    llm.offload(Tier.HOST)
    assert llm.prefetch([*prompt, *tokens(5, 2)]) > 0
    other = [*prompt[:16], *tokens(17, 3)]
    hashes = llm.cache.block_hashes(other)
    tiers = llm.cache.tiers
    assert tiers is not None
    indexer = llm.cache.indexer
    assert indexer is not None
    assert any(tiers.in_flight(k.pool.name, hashes[0]) for k in indexer.keys)
    plan = llm.cache.lookup(hashes, len(other))
    llm.cache.settle(wait=True)
    form = plan.form(Form.INDEXER_STATE)
    assert plan.hash_hit_tokens == 16 and form.usable_tokens == 0
    assert form.reason is Reason.BELOW_GRANULARITY
    assert_no_leases(llm)


def test_a_compressed_page_the_tier_holds_is_not_a_version_mismatch() -> None:
    """deepseek_v4-tiny, host tier: a 120-token prompt is offloaded (every device copy evicted)
    and the tier loses the r16 group's entry page at 112. The swap-in restores the window, tail
    and indexer to 112 but compressed_kv only to 96: the tiers kept the other forms' objects of
    that prefix, not its own — ``tier_incomplete``. The engine says
    ``compressed_version_mismatch``: in the tier view it asks about the first page missing on
    the device (page 0, which the tier holds with the right boundary stamp)."""
    sink = ListSink()
    cfg = CacheConfig(
        checkpoint_interval_tokens=64, max_prefill_chunk_tokens=64, host_tier_bytes=64 << 20
    )
    llm = LLM("deepseek_v4-tiny", device="cpu", cache=cfg, telemetry=sink, check_invariants=True,
              cost_model=FAST)  # fmt: skip
    prompt = tokens(120, 11)
    llm.score(prompt)
    llm.offload(Tier.HOST)
    hashes = llm.cache.block_hashes(prompt)
    compressed, tiers = llm.cache.compressed, llm.cache.tiers
    assert compressed is not None and tiers is not None
    tiers.drop(compressed.groups[-1].pool.name, hashes[112 // U - 1])
    out = llm.score([*prompt, *tokens(20, 12)])
    req = next(e for e in sink.events if isinstance(e, RequestEvent) and e.request_id == out.request_id)
    forms = {e.form: e for e in sink.events if isinstance(e, CacheLookup) and e.request_id == out.request_id}
    assert req.admission is Admission.SWAP_IN
    assert forms[Form.SWA_WINDOW].usable_tokens == 112
    assert forms[Form.COMPRESSED_KV].usable_tokens == 96
    assert forms[Form.COMPRESSED_KV].reason is Reason.TIER_INCOMPLETE
    assert_no_leases(llm)


def test_an_indexer_point_with_a_key_page_never_stored_is_below_granularity(tmp_path: Path) -> None:
    """deepseek_v4-tiny with room for 3 indexer key pages: of the 6 a 100-token prompt fills
    (16 tokens each), pages 4-6 are not stored. After an offload to disk and a restart (which
    forgets what the pools could not store), the indexer at 96 lacks page 1 (on disk) and pages
    4-6 (never stored, as far as any pool knows): the point was never servable,
    ``below_granularity`` — not ``indexer_stale`` (the engine asked only about the first
    missing page)."""
    cfg = CacheConfig(checkpoint_interval_tokens=64, max_prefill_chunk_tokens=64, compressed_blocks=4,
                      host_tier_bytes=4 << 20, disk_tier_bytes=16 << 20, disk_tier_dir=str(tmp_path))  # fmt: skip
    llm = LLM("deepseek_v4-tiny", device="cpu", cache=cfg, check_invariants=True)
    prompt = tokens(100, 7)
    llm.score(prompt)
    indexer = llm.cache.indexer
    assert indexer is not None
    stored = [p for p in range(6) if indexer.keys[0].block_of(llm.cache.block_hashes(prompt), p) is not None]
    assert stored == [0, 1, 2]
    llm.offload(Tier.DISK)
    llm.close()
    llm = LLM("deepseek_v4-tiny", device="cpu", cache=cfg, check_invariants=True)
    follow_up = [*prompt, *tokens(9, 8)]
    plan = llm.cache.lookup(llm.cache.block_hashes(follow_up), len(follow_up))
    form = plan.form(Form.INDEXER_STATE)
    assert (plan.hash_hit_tokens, form.usable_tokens) == (96, 0)
    assert form.reason is Reason.BELOW_GRANULARITY
    assert plan.form(Form.COMPRESSED_KV).reason is Reason.COMPRESSED_EVICTED  # its point 48 was stored
    llm.close()


def test_a_swap_in_form_whose_pages_are_in_flight_is_in_flight_swap_not_tier_incomplete() -> None:
    """qwen3_next-tiny, small host tier, fault ``read_during_swap_in`` without waiting: a
    prefetch holds the full-KV pages 48-80 of an offloaded conversation in flight, and its
    linear checkpoint at 80 is dropped while copied. The next turn swaps in the checkpoint at 64
    and resumes at 32 (what the device holds of full_kv): full_kv lost 48-80 because those pages
    are still on their way up — ``in_flight_swap`` — not ``tier_incomplete`` (the tier does hold
    them; its tier-view verdict never asked about the copies in flight)."""
    sink = ListSink()
    cfg = CacheConfig(checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64, full_kv_blocks=40,
                      linear_checkpoints=6, host_tier_bytes=96 << 10, swap_in_wait=False)  # fmt: skip
    llm = LLM("qwen3_next-tiny", device="cpu", cache=cfg, telemetry=sink, check_invariants=True,
              cost_model=FAST, faults=Faults(read_during_swap_in=True))  # fmt: skip
    prompt = tokens(80, 1)
    out = llm.generate([prompt], SamplingParams(max_tokens=4))[0]
    turn = [*prompt, *list(out.output_token_ids)[:-1], *tokens(18, 2)]
    llm.offload(Tier.HOST)
    assert llm.prefetch(turn) > 0
    hashes = llm.cache.block_hashes(turn)
    tiers, linear = llm.cache.tiers, llm.cache.linear
    full_kv = next(f for f in llm.cache.kv_forms if f.form is Form.FULL_KV)
    assert tiers is not None and linear is not None
    assert all(tiers.in_flight(full_kv.pool.name, hashes[p // U - 1]) for p in (48, 64, 80))
    tiers.drop(linear.pool.name, hashes[80 // U - 1])
    score = llm.score(turn)
    llm.cache.settle(wait=True)
    req = next(e for e in sink.events if isinstance(e, RequestEvent) and e.request_id == score.request_id)
    forms = {e.form: e for e in sink.events if isinstance(e, CacheLookup) and e.request_id == score.request_id}
    assert (req.admission, req.resume_tokens) == (Admission.SWAP_IN, 32)
    assert (forms[Form.FULL_KV].usable_tokens, forms[Form.FULL_KV].reason) == (32, Reason.IN_FLIGHT_SWAP)
    assert (req.limiting_form, req.limiting_reason) == (Form.FULL_KV, Reason.IN_FLIGHT_SWAP)
    llm.close()
