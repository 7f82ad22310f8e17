"""The six-form cache on every model family: warm equals cold around every granularity and on
real multi-turn traces; validation of stored objects inside the cache; block events; the memory
plan."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from engine import LLM, CacheConfig, SamplingParams
from engine.cache.compressed import page_tokens
from engine.events import BlockAction, BlockEvent, CacheLookup, Form, Outcome, Reason
from engine.telemetry import ListSink
from engine.trace.formats import load_trace, read_mooncake
from engine.trace.prompts import PromptBuilder
from tests.helpers import assert_no_leases, assert_warm_equals_cold, tokens

U = 16
CFG = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64)
FORMS_OF = {
    "kvscope_hybrid-tiny": set(Form),
    "qwen3_next-tiny": {Form.FULL_KV, Form.LINEAR_STATE},
    "deepseek_v4-tiny": {Form.SWA_WINDOW, Form.COMPRESSED_KV, Form.UNCOMPRESSED_TAIL, Form.INDEXER_STATE},
}


def granularities(llm: LLM) -> set[int]:
    """Every spacing some form of this model cares about: U, the checkpoint interval, the
    window, each compression ratio and entry page."""
    out = {U, CFG.checkpoint_interval_tokens}
    if llm.layout.sliding_window is not None:
        out.add(llm.layout.sliding_window)
    for spec in llm.layout.compressed_state_specs.values():
        out |= {spec.compressor.ratio, page_tokens(U, spec.compressor.ratio)}
    return out


def cut_points(llm: LLM, limit: int) -> list[int]:
    """Prefix lengths below, at and one past every multiple (1×, 2×) of every granularity."""
    points = {k * g + d for g in granularities(llm) for k in (1, 2) for d in (-1, 0, 1)}
    return sorted(p for p in points if 0 < p <= limit)


@pytest.mark.parametrize("model", sorted(FORMS_OF))
def test_warm_equals_cold_around_every_granularity(model: str) -> None:
    sink = ListSink()
    llm = LLM(model, cache=CFG, check_invariants=True, telemetry=sink)
    assert {f.form for f in llm.cache.forms} == FORMS_OF[model]
    base = tokens(150, 40)
    assert_warm_equals_cold(llm, base)
    resumed = 0
    for n in cut_points(llm, 150):
        out = assert_warm_equals_cold(llm, base[:n] + tokens(9, n))
        assert out.resume_tokens <= out.cache.hash_hit_tokens
        resumed += out.resume_tokens > 0
        assert_no_leases(llm)
    assert resumed > 0, "no prompt sharing a prefix resumed"
    for e in sink.events:
        if isinstance(e, CacheLookup):
            assert e.recoverable_tokens <= e.usable_tokens <= e.hash_hit_tokens


def test_every_form_hits_on_an_identical_follow_up() -> None:
    llm = LLM(cache=CFG, check_invariants=True)
    base = tokens(130, 41)
    assert_warm_equals_cold(llm, base)
    out = assert_warm_equals_cold(llm, base + tokens(5, 42))
    assert out.resume_tokens == 128
    assert {(f.form, f.outcome, f.usable_tokens) for f in out.forms} == {(form, Outcome.HIT, 128) for form in Form}


def session_prompts(requests, builder: PromptBuilder, max_tokens: int, sessions: int) -> list[list[list[int]]]:
    """The prompts of the first ``sessions`` multi-turn sessions whose prompts stay short."""
    by_session: dict[str, list] = {}
    for r in requests:
        by_session.setdefault(r.session_id, []).append(r)
    out = []
    for turns in by_session.values():
        prompts = [builder.prompt(r) for r in turns]
        if len(prompts) >= 3 and max(len(p) for p in prompts) <= max_tokens:
            out.append(prompts[:6])
        if len(out) == sessions:
            break
    return out


@pytest.mark.parametrize("model", ["kvscope_hybrid-tiny", "deepseek_v4-tiny"])
def test_real_multi_turn_sessions_warm_equal_cold(model: str, shared_data: Path) -> None:
    """Sessions of the real weka agentic trace and Mooncake conversations, turn after turn through
    one engine: every turn's logits equal a full recompute, and follow-up turns reuse."""
    weka = load_trace(shared_data / "weka_cc_traces" / "traces")
    moon = read_mooncake(shared_data / "mooncake" / "conversation_trace.jsonl")
    llm = LLM(model, cache=CFG, check_invariants=True)
    reused = 0
    # weka: agentic sessions (one token per 64-token trace block keeps prompts short on CPU)
    sessions = session_prompts(weka, PromptBuilder(block_tokens=1, vocab_size=256), max_tokens=320, sessions=2)
    assert len(sessions) == 2, "no short multi-turn weka session found"
    # Mooncake: one stream of conversation turns sharing blocks (two tokens per 512-token block)
    builder = PromptBuilder(block_tokens=2, vocab_size=256)
    sessions.append([p for p in (builder.prompt(r) for r in moon[:60]) if len(p) <= 320][:12])
    for prompts in sessions:
        for ids in prompts:
            out = assert_warm_equals_cold(llm, ids)
            reused += out.resume_tokens
    assert_no_leases(llm)
    assert reused > 0


def test_stored_object_breaking_the_kernel_contract_is_not_reused() -> None:
    """Layer 2 inside the cache: the window pool's stored pages are replaced by a half-precision
    copy (a real stored object whose dtype the attention reader does not take): the window form
    reports ``layout_mismatch`` and resumes nowhere, so L* = 0 and the output still equals cold."""
    llm = LLM(cache=CFG, check_invariants=True)
    base = tokens(100, 43)
    assert_warm_equals_cold(llm, base)
    swa = next(f for f in llm.cache.kv_forms if f.form == Form.SWA_WINDOW)
    shape = next(iter(swa.kv_groups))
    swa.kv_groups[shape] = swa.kv_groups[shape].half()
    report = llm.cache.lookup(llm.cache.block_hashes([*base, 1]), len(base) + 1)
    window = report.form(Form.SWA_WINDOW)
    assert (window.outcome, window.reason, window.usable_tokens) == (Outcome.INVALIDATED, Reason.LAYOUT_MISMATCH, 0)
    assert report.resume_tokens == 0 and report.limiting_form == Form.SWA_WINDOW


def test_misaligned_and_revision_changed_objects_are_not_reused() -> None:
    llm = LLM(cache=CFG, check_invariants=True)
    base = tokens(100, 44)
    assert_warm_equals_cold(llm, base)
    hashes = llm.cache.block_hashes([*base, 1])
    pages = llm.cache.compressed.groups[0]  # type: ignore[union-attr]
    arena = torch.zeros(pages.entries.numel() + 1, dtype=pages.entries.dtype)
    shifted = arena[1:].view_as(pages.entries)  # the same pages, one element off alignment
    shifted.copy_(pages.entries)
    original = pages.entries
    pages.entries = shifted
    report = llm.cache.lookup(hashes, len(base) + 1)
    assert report.form(Form.COMPRESSED_KV).reason == Reason.MISALIGNED and report.resume_tokens == 0
    pages.entries = original
    llm.cache.stored_revision = "other-weights"
    report = llm.cache.lookup(hashes, len(base) + 1)
    assert {f.reason for f in report.forms} == {Reason.MODEL_REVISION_CHANGED}
    llm.cache.stored_revision = llm.layout.revision
    assert llm.cache.lookup(hashes, len(base) + 1).resume_tokens == 96


def test_block_events_behind_a_flag() -> None:
    quiet, loud = ListSink(), ListSink()
    ids = tokens(70, 45)
    LLM(cache=CFG, telemetry=quiet).generate([ids], SamplingParams(max_tokens=2))
    assert not [e for e in quiet.events if isinstance(e, BlockEvent)]
    small = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64, full_kv_blocks=8)
    llm = LLM(cache=small, telemetry=loud, block_events=True)
    llm.generate([ids], SamplingParams(max_tokens=2))
    llm.generate([tokens(70, 46)], SamplingParams(max_tokens=2))  # evicts full-KV pages
    blocks = [e for e in loud.events if isinstance(e, BlockEvent)]
    stored = {(e.form, e.block_hash) for e in blocks if e.action == BlockAction.STORED}
    assert {e.form for e in blocks if e.action == BlockAction.STORED} == set(Form)
    removed = [e for e in blocks if e.action == BlockAction.REMOVED]
    assert removed and all((e.form, e.block_hash) in stored for e in removed)
    assert all(e.num_tokens == U for e in blocks if e.form == Form.FULL_KV)


def test_memory_plan_sizes_every_pool_from_one_budget(caplog: pytest.LogCaptureFixture) -> None:
    budget = 8 * 2**20
    with caplog.at_level(logging.INFO, logger="engine.cache.prefix_cache"):
        llm = LLM(cache=CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, memory_bytes=budget), check_invariants=True)
    plan = llm.cache.memory_plan()
    assert plan.budget_bytes == budget and plan.total_bytes <= budget
    assert plan.total_bytes > budget * 0.8  # the budget is used, not left idle
    assert {p.form for p in plan.pools} == set(Form)
    for p in plan.pools:  # every form holds the same prefix length beyond its headroom
        assert (p.blocks - p.headroom_blocks) * p.tokens_per_block >= plan.capacity_tokens
    text = caplog.text
    assert "cache memory plan" in text and all(f"form {form}" in text for form in Form)
    assert "resumes every 32 tokens" in text and "resumes every 16 tokens" in text
    assert_warm_equals_cold(llm, tokens(90, 47))
    with pytest.raises(ValueError, match="cannot hold the headroom"):
        LLM(cache=CacheConfig(memory_bytes=4096))


def test_one_frozen_spec_per_form() -> None:
    llm = LLM(cache=CFG)
    specs = llm.cache.form_specs()
    assert set(specs) == set(Form)
    assert {f: s.granularity_tokens for f, s in specs.items()} == {
        Form.FULL_KV: U,
        Form.SWA_WINDOW: 32,
        Form.COMPRESSED_KV: U,
        Form.UNCOMPRESSED_TAIL: 32,
        Form.INDEXER_STATE: 32,
        Form.LINEAR_STATE: 32,
    }
    full = specs[Form.FULL_KV]
    (name, fp), = full.fingerprints
    assert fp.dtype == torch.float32 and fp.axis_order == ("layer", "kv", "token", "head", "dim")
    assert fp.block_shape[2] == U and fp.model_revision == llm.layout.revision
    assert name.startswith("full_kv") and full.bytes_per_block == math.prod(fp.block_shape) * 4
    assert all(s.bytes_per_block > 0 and s.fingerprints for s in specs.values())
    with pytest.raises(AttributeError):
        full.granularity_tokens = 1  # type: ignore[misc]


def test_object_changed_between_lookup_and_lease_degrades_to_recompute() -> None:
    """Red line 3 (TOCTOU): a page the lookup matched is invalidated before the request leases
    it (as another thread could); the request does not read it, recomputes, and full_kv says
    ``epoch_changed``. A change elsewhere in a pool that leaves the plan valid changes nothing."""
    sink = ListSink()
    llm = LLM(cache=CFG, check_invariants=True, telemetry=sink)
    base = tokens(100, 48)
    assert_warm_equals_cold(llm, base)
    full = next(f for f in llm.cache.kv_forms if f.form == Form.FULL_KV)
    lookup = llm.cache.planner.lookup  # what admission plans with
    victims: list[int] = []

    def lookup_then_invalidate(hashes, prompt_tokens, vetoes=None, **kwargs):  # type: ignore[no-untyped-def]
        plan = lookup(hashes, prompt_tokens, vetoes, **kwargs)
        if victims:
            full.pool.invalidate(victims.pop())
        return plan

    llm.cache.planner.lookup = lookup_then_invalidate  # type: ignore[method-assign]
    follow_up = [*base, *tokens(10, 49)]
    hashes = llm.cache.block_hashes(follow_up)
    victims.append(full.pool.lookup(hashes[2]))  # a page inside the matched prefix
    out = assert_warm_equals_cold(llm, follow_up)
    verdict = out.cache.form(Form.FULL_KV)
    assert (verdict.outcome, verdict.reason) == (Outcome.INVALIDATED, Reason.EPOCH_CHANGED)
    assert out.resume_tokens == 0 and out.cache.limiting_reason == Reason.EPOCH_CHANGED
    assert_no_leases(llm)
    # an unrelated page invalidated in between: the plan still holds, the request resumes
    other = tokens(70, 50)
    assert_warm_equals_cold(llm, other)
    victims.append(full.pool.lookup(llm.cache.block_hashes(other)[0]))
    again = assert_warm_equals_cold(llm, [*follow_up, *tokens(5, 51)])
    assert again.resume_tokens > 0 and again.cache.form(Form.FULL_KV).outcome == Outcome.HIT


def test_compressed_pages_keep_the_start_of_a_prefix() -> None:
    """Entry pages are usable only from page 0 up to the first gap, so under pressure a prefix
    must lose its last pages first (as full-KV pages do): a repeated prompt longer than the pool
    still resumes on the pages that remain."""
    llm = LLM("deepseek_v4-tiny", cache=CacheConfig(unit_tokens=U, compressed_blocks=5, checkpoint_interval_tokens=32), check_invariants=True)
    ids = tokens(100, 52)  # 6 pages of r4 entries, 3 of r16: more than 4 usable blocks
    assert_warm_equals_cold(llm, ids)
    out = assert_warm_equals_cold(llm, [*ids, *tokens(20, 53)])
    assert out.cache.form(Form.COMPRESSED_KV).usable_tokens >= 64
    assert out.resume_tokens >= 64
    assert_no_leases(llm)


@pytest.mark.parametrize("model", ["kvscope_hybrid-tiny", "deepseek_v4-tiny"])
def test_memory_plan_never_exceeds_its_budget(model: str) -> None:
    smallest = None
    for mib in (0.5, 0.75, 1.0, 1.1, 1.25, 1.5, 2, 3, 5, 8):
        budget = int(mib * 2**20)
        try:
            llm = LLM(model, cache=CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, memory_bytes=budget))
        except ValueError as exc:
            assert "raise the budget" in str(exc)
            continue
        smallest = smallest or mib
        real = sum(t.tensor.numel() * t.tensor.element_size() for f in llm.cache.forms for t in f.stored_tensors())
        plan = llm.cache.memory_plan()
        assert plan.total_bytes <= budget and real <= budget, (mib, plan.total_bytes, real)
    assert smallest is not None and smallest < 8
