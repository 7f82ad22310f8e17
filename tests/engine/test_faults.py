"""Fault injection (engine/faults.py): under every fault the output equals a cold run and the
events carry the reason."""

from __future__ import annotations

import pytest

from engine import LLM, CacheConfig
from engine.config import HybridConfig
from engine.events import CacheLookup, Form, Outcome, Reason, RequestEvent
from engine.faults import Faults
from engine.telemetry import ListSink
from tests.helpers import assert_no_leases, assert_warm_equals_cold, tokens

U = 16
CFG = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64)
# CSA (ratio 4) next to HCA (ratio 32): two compressor groups with pages of 16 and 32 tokens
TWO_GROUPS = HybridConfig(
    layer_types=("compressed_sparse_attention", "full_attention", "heavily_compressed_attention"),
    compress_ratio_hca=32,
    sliding_window=24,
    revision="faults-two-groups",
)

FAULTS = {
    # fault: (model, faults, form that must miss, its reason)
    "drop_tail": ("kvscope_hybrid-tiny", Faults(drop_tail=True), Form.UNCOMPRESSED_TAIL, Reason.TAIL_MISSING),
    "lag_index": ("kvscope_hybrid-tiny", Faults(lag_index=True), Form.INDEXER_STATE, Reason.INDEXER_STALE),
    "evict_between_check_and_use": (
        "kvscope_hybrid-tiny",
        Faults(evict_between_check_and_use=True),
        Form.FULL_KV,
        Reason.EPOCH_CHANGED,
    ),
    "groups_disagree": (TWO_GROUPS, Faults(groups_disagree=True), Form.COMPRESSED_KV, Reason.GROUP_DISAGREE),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_gives_cold_output_and_its_reason(name: str) -> None:
    model, faults, form, reason = FAULTS[name]
    sink = ListSink()
    llm = LLM(model, cache=CFG, check_invariants=True, telemetry=sink, faults=faults)
    clean = LLM(model, cache=CFG)
    prefix = tokens(128, 70)
    follow_up = [*prefix, *tokens(20, 71)]
    for engine in (llm, clean):
        assert_warm_equals_cold(engine, prefix)
    out = assert_warm_equals_cold(llm, follow_up)  # the fault never changes the output
    healthy = clean.score(follow_up)
    verdict = out.cache.form(form)
    assert (verdict.outcome, verdict.reason) == (Outcome.INVALIDATED, reason), out.cache
    assert out.resume_tokens < healthy.resume_tokens  # without the fault the prefix resumes further
    assert healthy.cache.form(form).outcome == Outcome.HIT
    lookup = [e for e in sink.events if isinstance(e, CacheLookup) and e.form == form][-1]
    assert (lookup.outcome, lookup.reason) == (Outcome.INVALIDATED, reason)
    request = [e for e in sink.events if isinstance(e, RequestEvent)][-1]
    assert not request.approximate
    assert_no_leases(llm)


def test_no_fault_by_default() -> None:
    llm = LLM(cache=CFG)
    assert not llm.cache.faults.any


def test_a_stale_index_slot_is_replaced_once_the_fault_stops() -> None:
    llm = LLM(cache=CFG, check_invariants=True, faults=Faults(lag_index=True))
    prefix = tokens(128, 72)
    assert_warm_equals_cold(llm, prefix)
    assert assert_warm_equals_cold(llm, [*prefix, *tokens(20, 73)]).resume_tokens < 128
    llm.cache.faults = Faults()
    assert_warm_equals_cold(llm, prefix)  # stores the right rows over the stale ones
    healed = assert_warm_equals_cold(llm, [*prefix, *tokens(20, 74)])
    assert healed.resume_tokens == 128 and healed.cache.form(Form.INDEXER_STATE).outcome == Outcome.HIT
    assert_no_leases(llm)
