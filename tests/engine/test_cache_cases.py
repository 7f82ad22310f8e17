"""The hybrid prefix-cache failure cases (``shared/cases/hybrid_prefix_cache_cases.md``) and the
defects a review found, as deterministic tests: each docstring names the case and the behaviour
it holds the engine to.

The case tests are named after their case (``test_c1_…`` … ``test_c12_…``). Each checks the right
behaviour — warm equals cold within ``tests.helpers.TOLERANCE`` (float32) — *and* the reason the
engine gives, in the report and in the ``cache_lookup`` / ``request`` events. Where a case applies
to several forms it is run on each: the compressed forms (``compressed_kv``,
``uncompressed_tail``, ``indexer_state``) on geometries built with :class:`HybridConfig`, next to
the full-attention, window and recurrent forms.
"""

from __future__ import annotations

import itertools
import logging
import random
import re
from collections import defaultdict
from collections.abc import Sequence

import pytest
import torch

from engine import LLM, CacheConfig, SamplingParams
from engine.cache.block_pool import BlockPool
from engine.cache.coordinator import resume_limit
from engine.cache.hashing import BlockHash
from engine.cache.lifecycle import IllegalTransition
from engine.cache.prefix_cache import PrefixCache
from engine.config import HybridConfig
from engine.events import CacheLookup, Form, Outcome, Reason, RequestEvent
from engine.outputs import CacheReport, ScoreOutput
from engine.telemetry import ListSink
from tests.helpers import assert_no_leases, assert_warm_equals_cold, tokens

U = 16
warm_equals_cold = assert_warm_equals_cold
no_leases = assert_no_leases

HYBRID = "kvscope_hybrid-tiny"
"""Every layer kind: linear, sliding, CSA (ratio 4, indexer), full, HCA (ratio 16); W = 64."""
FA_REC = HybridConfig(layer_types=("linear_attention", "full_attention"), revision="cases-fa-rec")
FA_SWA = HybridConfig(layer_types=("full_attention", "sliding_attention"), sliding_window=32, revision="cases-fa-swa")
FA_HCA16 = HybridConfig(
    layer_types=("full_attention", "heavily_compressed_attention"), sliding_window=32, revision="cases-fa-hca16"
)
"""HCA with r = U: no pending rows at any U boundary, so no form needs checkpoints."""
FA_HCA32 = HybridConfig(
    layer_types=("full_attention", "heavily_compressed_attention"),
    compress_ratio_hca=32,
    sliding_window=32,
    revision="cases-fa-hca32",
)
"""HCA with r = 2U: its tail is empty at multiples of 32 and holds 16 rows in between."""
FA_CSA = HybridConfig(
    layer_types=("full_attention", "compressed_sparse_attention"), sliding_window=32, revision="cases-fa-csa"
)
V4_MIX = HybridConfig(
    layer_types=("compressed_sparse_attention", "full_attention", "heavily_compressed_attention"),
    revision="cases-v4-mix",
)
"""CSA (ratio 4) + HCA (ratio 16) + full attention, no recurrent layer; W = 64."""
V4_WINDOWS = HybridConfig(
    layer_types=("compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention"),
    sliding_window=40,
    revision="cases-v4-windows",
)
"""No full attention: every attention layer keeps only a window (plus compressed state)."""
SWA_LIN = HybridConfig(
    layer_types=("sliding_attention", "linear_attention", "sliding_attention"), sliding_window=24, revision="cases-swa-lin"
)
ALL_SWA = HybridConfig(layer_types=("sliding_attention", "sliding_attention"), sliding_window=40, revision="all-swa")


def hca_geometry(ratio: int) -> HybridConfig:
    """Case C4's geometry: CSA ratio 4, HCA ratio ``ratio`` (> U), a 24-token window, full KV."""
    return HybridConfig(
        layer_types=(
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "sliding_attention",
            "full_attention",
        ),
        compress_ratio_csa=4,
        compress_ratio_hca=ratio,
        sliding_window=24,
        revision=f"cases-hca{ratio}",
    )


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cache_config(**overrides: int) -> CacheConfig:
    fields = {"unit_tokens": U, "checkpoint_interval_tokens": 32, "max_prefill_chunk_tokens": 64} | overrides
    return CacheConfig(**fields)


# -- what the events say ---------------------------------------------------------------------------------
def last_request(sink: ListSink) -> tuple[RequestEvent, dict[Form, CacheLookup]]:
    """The ``request`` event of the last request and its ``cache_lookup`` events by form."""
    request = next(e for e in reversed(sink.events) if isinstance(e, RequestEvent))
    lookups = {e.form: e for e in sink.events if isinstance(e, CacheLookup) and e.request_id == request.request_id}
    return request, lookups


def assert_verdict(
    out: ScoreOutput, sink: ListSink, form: Form, outcome: Outcome, reason: Reason, usable: int | None = None
) -> None:
    """``form``'s verdict for the last request, in the report and in its ``cache_lookup`` event."""
    f = out.cache.form(form)
    assert (f.outcome, f.reason) == (outcome, reason), f
    if usable is not None:
        assert f.usable_tokens == usable, f
    _, lookups = last_request(sink)
    event = lookups[form]
    assert (event.outcome, event.reason, event.usable_tokens, event.recoverable_tokens) == (
        f.outcome,
        f.reason,
        f.usable_tokens,
        f.recoverable_tokens,
    ), event


def assert_limit(out: ScoreOutput, sink: ListSink, form: Form | None, reason: Reason) -> None:
    """The last request's limiting form and reason, in the report and in its ``request`` event."""
    report = out.cache
    assert (report.limiting_form, report.limiting_reason) == (form, reason), report
    request, _ = last_request(sink)
    assert (request.limiting_form, request.limiting_reason, request.resume_tokens) == (
        form,
        reason,
        report.resume_tokens,
    ), request
    assert request.recomputed_tokens == report.prompt_tokens - report.resume_tokens >= 1


def assert_all_hit(out: ScoreOutput, sink: ListSink) -> None:
    for f in out.forms:
        assert_verdict(out, sink, f.form, Outcome.HIT, Reason.NONE, usable=out.resume_tokens)


# -- C1: a recurrent checkpoint lands in unique tokens ------------------------------------------------------
def test_c1_junction_checkpoint_lets_the_third_request_hit() -> None:
    """Case C1: R1 = S + U1 with |S| = 70 leaves its only recurrent checkpoint inside U1 (the
    interval is 128). R2 = S + U2 reports ``linear_checkpoint_missing`` with full KV usable at
    64, and while prefilling R2 the engine takes a checkpoint at the junction (64, the aligned
    end of the shared part), so R3 = S + U3 resumes there."""
    cfg = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=128, max_prefill_chunk_tokens=64)
    sink = ListSink()
    llm = LLM(cache=cfg, check_invariants=True, telemetry=sink)
    shared = tokens(70, 3)
    warm_equals_cold(llm, shared + tokens(40, 4))
    r2 = warm_equals_cold(llm, shared + tokens(40, 5))
    lin = r2.cache.form(Form.LINEAR_STATE)
    full = r2.cache.form(Form.FULL_KV)
    assert (lin.outcome, lin.reason) == (Outcome.INVALIDATED, Reason.LINEAR_CHECKPOINT_MISSING)
    assert full.usable_tokens == 64 and r2.resume_tokens == 0
    assert_verdict(r2, sink, Form.LINEAR_STATE, Outcome.INVALIDATED, Reason.LINEAR_CHECKPOINT_MISSING, usable=0)
    assert_limit(r2, sink, Form.LINEAR_STATE, Reason.LINEAR_CHECKPOINT_MISSING)
    r3 = warm_equals_cold(llm, shared + tokens(40, 6))
    assert r3.resume_tokens == 64, "no junction checkpoint was taken while prefilling R2"
    assert_all_hit(r3, sink)


def test_c1_junction_checkpoint_covers_the_compressed_tail() -> None:
    """Case C1 for the compressed forms (CSA + HCA + full attention, no recurrent layer): the
    tail and indexer rows are stored per boundary like a recurrent checkpoint. R1's only
    boundary with rows is 96, inside U1; R2 = S + U2 matches 64 tokens of full KV and compressed
    entries but no rows there, so ``uncompressed_tail`` and ``indexer_state`` are invalidated
    (``below_granularity``: never stored between checkpoints, nothing was evicted) and R2 is not
    reported as a hit. R2 stores the rows at the junction (64), so R3 = S + U3 resumes there."""
    sink = ListSink()
    llm = LLM(V4_MIX, cache=cache_config(checkpoint_interval_tokens=128), check_invariants=True, telemetry=sink)
    shared = tokens(70, 3)
    warm_equals_cold(llm, shared + tokens(40, 4))
    r2 = warm_equals_cold(llm, shared + tokens(40, 5))
    assert (r2.cache.hash_hit_tokens, r2.resume_tokens) == (64, 0)
    assert_verdict(r2, sink, Form.FULL_KV, Outcome.HIT, Reason.NONE, usable=64)
    assert_verdict(r2, sink, Form.COMPRESSED_KV, Outcome.HIT, Reason.NONE, usable=64)
    for form in (Form.UNCOMPRESSED_TAIL, Form.INDEXER_STATE):
        assert_verdict(r2, sink, form, Outcome.INVALIDATED, Reason.BELOW_GRANULARITY, usable=0)
    assert r2.cache.limiting_reason == Reason.BELOW_GRANULARITY
    assert all(p.evictions == 0 for f in llm.cache.forms for p in f.pools)
    r3 = warm_equals_cold(llm, shared + tokens(40, 6))
    assert r3.resume_tokens == 64, "no tail / indexer rows were stored at the junction while prefilling R2"
    assert_all_hit(r3, sink)
    assert_limit(r3, sink, None, Reason.NONE)


# -- C2: one form hit, another missed ------------------------------------------------------------------------
C2_CASES = {
    # name: (model, cache overrides, |A|, unrelated requests run after A, tokens R2 shares with A,
    #        the forms that miss with their reasons, L*)
    "linear_state": (FA_REC, {}, 100, (), 56, {Form.LINEAR_STATE: Reason.LINEAR_CHECKPOINT_MISSING}, 32),
    "swa_window": (
        FA_SWA,
        {"max_prefill_chunk_tokens": 32, "swa_blocks": 9},
        100,
        (100, 100, 100, 100),
        100,
        {Form.SWA_WINDOW: Reason.SWA_EVICTED},
        0,
    ),
    "compressed_kv-hca": (  # A's last pages find no room: its first 3 pages stay usable
        FA_HCA16,
        {"compressed_blocks": 4},
        100,
        (),
        100,
        {Form.COMPRESSED_KV: Reason.COMPRESSED_EVICTED},
        48,
    ),
    "compressed_kv-csa": (
        FA_CSA,
        {"compressed_blocks": 4},
        60,
        (60,),
        60,
        {Form.COMPRESSED_KV: Reason.COMPRESSED_EVICTED, Form.INDEXER_STATE: Reason.INDEXER_STALE},
        0,
    ),
    "uncompressed_tail": (FA_HCA32, {"tail_slots": 2}, 60, (60,), 60, {Form.UNCOMPRESSED_TAIL: Reason.TAIL_MISSING}, 32),
    "indexer_state": (
        FA_CSA,
        {"tail_slots": 2},
        60,
        (60,),
        60,
        {Form.UNCOMPRESSED_TAIL: Reason.TAIL_MISSING, Form.INDEXER_STATE: Reason.INDEXER_STALE},
        0,
    ),
}


@pytest.mark.parametrize("case", list(C2_CASES))
def test_c2_one_form_missed_limits_the_resume_point(case: str) -> None:
    """Case C2, for each form that can miss while full KV hits: recurrent checkpoints (none at
    the hit), window pages, compressed entries (HCA and CSA with its indexer keys) and tail /
    indexer rows (evicted by pool pressure). L* is the minimum over the forms — never the full-KV
    hit for every layer — the missing form is ``invalidated`` with its reason and names the
    limit, full KV stays a hit, and the logits equal a cold run."""
    model, overrides, a_len, unrelated, shared, missing, resume = C2_CASES[case]
    sink = ListSink()
    llm = LLM(model, cache=cache_config(**overrides), check_invariants=True, telemetry=sink)
    a = tokens(a_len, 21)
    warm_equals_cold(llm, a)
    for i, n in enumerate(unrelated):
        warm_equals_cold(llm, tokens(n, 22 + i))
    out = warm_equals_cold(llm, a[:shared] + tokens(20, 29))
    report = out.cache
    hit = report.hash_hit_tokens
    assert hit == shared // U * U
    assert_verdict(out, sink, Form.FULL_KV, Outcome.HIT, Reason.NONE, usable=hit)
    for form, reason in missing.items():
        assert_verdict(out, sink, form, Outcome.INVALIDATED, reason)
        assert report.form(form).usable_tokens < hit
    for f in report.forms:
        if f.form not in missing:
            assert_verdict(out, sink, f.form, Outcome.HIT, Reason.NONE, usable=hit)
    assert report.resume_tokens == min(f.usable_tokens for f in report.forms) == resume
    assert report.limiting_form in missing
    assert_limit(out, sink, report.limiting_form, missing[report.limiting_form])
    no_leases(llm)


# -- C3: the prompt is an exact multiple of the unit --------------------------------------------------------------
@pytest.mark.parametrize("model", [HYBRID, FA_REC, hca_geometry(64)], ids=["hybrid", "fa-rec", "hca64"])
@pytest.mark.parametrize("length", [6 * U, 6 * U - 1, 6 * U + 1, 5 * U], ids=["kU", "kU-1", "kU+1", "kU-U"])
def test_c3_identical_prompt_resumes_strictly_before_its_end(model: str | HybridConfig, length: int) -> None:
    """Case C3: a prompt of k·U tokens (and k·U ± 1, k·U − U) identical to a cached one resumes
    at the last U boundary strictly before its end — at least one token is computed, so no state
    that already includes the last token is applied again — with every form (recurrent, window,
    compressed entries, tail and indexer rows) a hit there. The request says ``prompt_end``
    exactly when the prompt end, not a form, capped L* below the hash hit."""
    sink = ListSink()
    llm = LLM(model, cache=cache_config(), check_invariants=True, telemetry=sink)
    ids = tokens(length, 40 + length)
    assert warm_equals_cold(llm, ids).resume_tokens == 0
    again = warm_equals_cold(llm, ids)
    last_boundary = (length - 1) // U * U
    assert again.cache.hash_hit_tokens == length // U * U
    assert again.resume_tokens == last_boundary
    assert again.logits.shape[0] == length - last_boundary >= 1
    assert_all_hit(again, sink)
    capped = length % U == 0
    assert_limit(again, sink, None, Reason.PROMPT_END if capped else Reason.NONE)
    no_leases(llm)


# -- C4: granularity blow-up ---------------------------------------------------------------------------------------
SPACING_LINE = re.compile(r"\bform (\w+)\b[^\n]*?resumes (?:only )?every (\d+) tokens")


def logged_spacing(records: Sequence[logging.LogRecord]) -> dict[str, int]:
    """Per form, the resume spacing the log lines of ``records`` state."""
    return {
        form: int(tokens_apart)
        for record in records
        for form, tokens_apart in SPACING_LINE.findall(record.getMessage())
    }


@pytest.mark.parametrize("hca_ratio", [64, 256])
def test_c4_compressed_ratios_do_not_force_a_common_multiple(
    hca_ratio: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Case C4: forms with granularities 16 (U, window and full-KV pages), 4 (CSA ratio) and an
    HCA ratio of 64 or 256 — a compressed page far larger than U. The engine logs each form's
    effective resume spacing at start: U for full KV and compressed entries (entries of whole
    groups never change), the checkpoint interval for the window (kept behind checkpoints) and
    the tail and indexer rows; nothing is rounded to a least common multiple, and a spacing
    above 8·U is warned about. Two prompts sharing 200 tokens hit at 192 and a
    follow-up at 224 (neither a multiple of 256; 224 not one of 64); a prompt sharing 120 tokens
    misses the rows between checkpoints and says ``below_granularity`` (nothing was evicted)."""
    caplog.set_level(logging.INFO, logger="engine.cache.prefix_cache")
    model = hca_geometry(hca_ratio)
    sink = ListSink()
    llm = LLM(model, cache=cache_config(checkpoint_interval_tokens=64), check_invariants=True, telemetry=sink)
    spacing = {
        Form.FULL_KV: U,
        Form.COMPRESSED_KV: U,  # entries of whole groups never change: any U boundary
        Form.SWA_WINDOW: 64,  # window pages are kept behind checkpoints
        Form.UNCOMPRESSED_TAIL: 64,
        Form.INDEXER_STATE: 64,
    }
    logged = [r for r in caplog.records if r.name == "engine.cache.prefix_cache"]
    assert logged_spacing(logged) == spacing, [r.getMessage() for r in logged]
    assert not [r for r in logged if r.levelno >= logging.WARNING]

    shared = tokens(200, 50)
    r1 = shared + tokens(30, 51)
    warm_equals_cold(llm, r1)
    r2 = warm_equals_cold(llm, shared + tokens(30, 52))
    assert (r2.cache.hash_hit_tokens, r2.resume_tokens) == (192, 192)
    assert_all_hit(r2, sink)
    r3 = warm_equals_cold(llm, r1 + tokens(5, 53))
    assert (r3.cache.hash_hit_tokens, r3.resume_tokens) == (224, 224)
    assert_all_hit(r3, sink)

    r4 = warm_equals_cold(llm, shared[:120] + tokens(30, 54))
    assert (r4.cache.hash_hit_tokens, r4.resume_tokens) == (112, 64)  # 64: the checkpoint below 112
    for form in (Form.SWA_WINDOW, Form.UNCOMPRESSED_TAIL, Form.INDEXER_STATE):
        assert_verdict(r4, sink, form, Outcome.INVALIDATED, Reason.BELOW_GRANULARITY, usable=64)
    for form in (Form.FULL_KV, Form.COMPRESSED_KV):
        assert_verdict(r4, sink, form, Outcome.HIT, Reason.NONE, usable=112)
    assert r4.cache.limiting_reason == Reason.BELOW_GRANULARITY
    assert all(p.evictions == 0 for f in llm.cache.forms for p in f.pools)
    no_leases(llm)

    # a spacing above 8·U is warned about at start
    caplog.clear()
    LLM(model, cache=cache_config(checkpoint_interval_tokens=256))
    warned = logged_spacing([r for r in caplog.records if r.levelno == logging.WARNING])
    assert {Form.UNCOMPRESSED_TAIL: 256, Form.INDEXER_STATE: 256}.items() <= warned.items(), warned
    assert Form.COMPRESSED_KV not in warned


# -- C5: window tails recycled in round-robin sessions --------------------------------------------------------------
def _round_robin(swa_blocks: int, sessions: int, turns: int) -> list[list[CacheReport]]:
    """``sessions`` sessions on FA + SWA(32) take ``turns`` turns in round robin, each turn the
    session's history plus 21 new tokens; returns the reports by round (warm equals cold for
    every request; the events agree with the reports)."""
    sink = ListSink()
    cfg = cache_config(max_prefill_chunk_tokens=32, swa_blocks=swa_blocks)
    llm = LLM(FA_SWA, cache=cfg, check_invariants=True, telemetry=sink)
    histories = [tokens(40, 500 + s) for s in range(sessions)]
    rounds = []
    for turn in range(turns):
        row = []
        for s in range(sessions):
            if turn:
                histories[s] = histories[s] + tokens(21, 600 + 10 * turn + s)
            out = warm_equals_cold(llm, histories[s])
            for f in out.forms:
                assert_verdict(out, sink, f.form, f.outcome, f.reason)
            row.append(out.cache)
        rounds.append(row)
    no_leases(llm)
    return rounds


def test_c5_round_robin_sessions_lose_window_reuse_gradually() -> None:
    """Case C5: six sessions on FA + SWA(32) send turns (history + a short suffix) in round
    robin while the window pool shrinks. With room for every session's current window plus one
    request's working set (14 blocks and up), every follow-up turn resumes at its whole hash hit:
    pages that left a request's window are evicted before any session's window tail. Below that,
    reuse must degrade gradually — never increasing as the pool shrinks, and in every round some
    session still resumes — instead of collapsing to zero for every session at once; full KV
    stays resident (a hit) and every window miss says ``swa_evicted``."""
    sessions, turns = 6, 4
    sizes = (40, 18, 14, 13, 11, 9)
    reuse: dict[int, int] = {}
    resumes: dict[int, list[list[int]]] = {}
    possible = sessions * (32 + 48 + 80)  # the follow-ups' hash hits
    for swa_blocks in sizes:
        rounds = _round_robin(swa_blocks, sessions, turns)
        follow_ups = [r for row in rounds[1:] for r in row]
        assert sum(r.hash_hit_tokens for r in follow_ups) == possible
        for r in follow_ups:
            full = r.form(Form.FULL_KV)
            assert (full.outcome, full.usable_tokens) == (Outcome.HIT, r.hash_hit_tokens), r
            swa = r.form(Form.SWA_WINDOW)
            if swa.outcome != Outcome.HIT:
                assert (swa.outcome, swa.reason) == (Outcome.INVALIDATED, Reason.SWA_EVICTED), r
                assert (r.limiting_form, r.limiting_reason) == (Form.SWA_WINDOW, Reason.SWA_EVICTED), r
        reuse[swa_blocks] = sum(r.resume_tokens for r in follow_ups)
        resumes[swa_blocks] = [[r.resume_tokens for r in row] for row in rounds[1:]]
    assert reuse[40] == reuse[18] == reuse[14] == possible, reuse
    assert all(reuse[a] >= reuse[b] for a, b in itertools.pairwise(sizes)), reuse
    assert reuse[9] < possible, "the smallest pool evicted no window tail: the test has no pressure"
    collapsed = {
        blocks: [i for i, row in enumerate(rows, start=2) if not any(row)] for blocks, rows in resumes.items()
    }
    assert not any(collapsed.values()), (
        f"window reuse collapsed to zero for every session at once (pool size: rounds) {collapsed}; "
        f"reused tokens by pool size {reuse} of {possible}; resume points {resumes}"
    )


# -- C6: window-evicted slots re-inserted as cached -----------------------------------------------------------------
C6_MODELS = {
    # name: (model, R3's L*, R3's verdicts {form: (outcome, reason, usable tokens)})
    "all-swa": (ALL_SWA, 144, {Form.SWA_WINDOW: (Outcome.HIT, Reason.NONE, 144)}),
    "csa-hca-swa": (
        V4_WINDOWS,
        80,
        {
            Form.SWA_WINDOW: (Outcome.INVALIDATED, Reason.BELOW_GRANULARITY, 80),
            Form.COMPRESSED_KV: (Outcome.HIT, Reason.NONE, 144),
            Form.UNCOMPRESSED_TAIL: (Outcome.INVALIDATED, Reason.BELOW_GRANULARITY, 80),
            Form.INDEXER_STATE: (Outcome.INVALIDATED, Reason.BELOW_GRANULARITY, 80),
        },
    ),
}


@pytest.mark.parametrize("name", list(C6_MODELS))
def test_c6_window_slots_freed_during_decode_are_not_reused_as_cached(name: str) -> None:
    """Case C6 on models whose attention keeps only windows (all-SWA; and CSA + HCA + SWA, whose
    compressed layers' local windows are ``swa_window`` pages too): R1 decodes far past W (pages
    leave the window and return to the pool); R2 reuses freed slots; R3 matches R1's prefix and
    decoded tokens — exact. All-SWA resumes at 144, past R1's prompt. With compressed layers a
    resume point needs stored rows, so R3 resumes at R1's last checkpoint (80): decoded tokens
    store no window or rows (``below_granularity``, not an eviction), only compressed entries
    (a hit at 144). A freed block released again is refused loudly (no double free)."""
    model, resume, verdicts = C6_MODELS[name]
    cfg = CacheConfig(
        unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=32, swa_blocks=16
    )
    sink = ListSink()
    llm = LLM(model, cache=cfg, check_invariants=True, telemetry=sink)
    r1 = tokens(90, 17)
    out = llm.generate([r1], SamplingParams(max_tokens=60))[0]
    warm_equals_cold(llm, tokens(120, 18))  # R2 overwrites recycled slots
    r3 = warm_equals_cold(llm, r1 + out.output_token_ids + tokens(9, 19))
    assert r3.cache.hash_hit_tokens >= 144
    assert r3.resume_tokens == resume
    for form, (outcome, reason, usable) in verdicts.items():
        assert_verdict(r3, sink, form, outcome, reason, usable=usable)
    no_leases(llm)
    pool = llm.cache.kv_forms[0].pool
    free = next(b for b in range(1, pool.num_blocks) if pool.ref_count[b] == 0)
    with pytest.raises(IllegalTransition):
        pool.release(free)
    no_leases(llm)


# -- C7: the window watermark follows the last usable checkpoint ----------------------------------------------------
@pytest.mark.parametrize("model", [HYBRID, V4_MIX], ids=["hybrid", "csa-hca-full"])
def test_c7_window_pages_past_the_last_checkpoint_are_evicted_before_its_window(model: str | HybridConfig) -> None:
    """Cases C5/C7: R1 = 160 prompt tokens + 40 decoded; its last checkpoint is at 160 (the
    prompt end, a U boundary), whose window is pages 6..9, while its live tail moves on to 200.
    Pages past the last checkpoint can never back a resume (in a model with recurrent layers, or
    compressed layers that keep rows per boundary), so the watermark stays at the checkpoint, not
    the live tail: those pages are released first and evicted before that window. An unrelated
    15-page request is harmless either way; a 16-page one would reach the window had decode
    released it behind the live tail — it must leave R1's follow-up resuming at 160, where the
    window form is usable; past 160 it says ``below_granularity`` (decoded tokens have no
    checkpoint), never ``swa_evicted``."""
    cfg = CacheConfig(
        unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64, swa_blocks=20
    )
    llm = LLM(model, cache=cfg, check_invariants=True)
    a = tokens(160, 7)
    out = llm.generate([a], SamplingParams(max_tokens=40))[0]
    follow_up = a + out.output_token_ids + tokens(5, 8)
    llm.score(tokens(240, 9))  # 15 pages: harmless
    assert llm.score(follow_up).resume_tokens == 160
    sink = ListSink()
    llm2 = LLM(model, cache=cfg, check_invariants=True, telemetry=sink)
    llm2.generate([a], SamplingParams(max_tokens=40))
    llm2.score(tokens(256, 9))  # 16 pages: must still not touch the window at 160
    r = warm_equals_cold(llm2, follow_up)
    assert r.resume_tokens == 160, (
        f"L* fell to {r.resume_tokens}: the window behind the last checkpoint was evicted while pages "
        "past it stayed cached"
    )
    assert r.cache.hash_hit_tokens == 192
    assert_verdict(r, sink, Form.SWA_WINDOW, Outcome.INVALIDATED, Reason.BELOW_GRANULARITY, usable=160)
    no_leases(llm2)


# -- C8: a request's own allocation evicts what its lookup matched --------------------------------------------------
def test_c8_matched_pages_are_leased_before_allocation() -> None:
    """The request's own allocations cannot evict the pages its lookup matched (case C8): the
    full-KV pool has exactly room for the matched prefix plus the new pages."""
    cache = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64, full_kv_blocks=15)
    llm = LLM(cache=cache, check_invariants=True, telemetry=ListSink())
    a = tokens(170, 10)  # 10 full pages + a partial one; checkpoint at 160
    assert_warm_equals_cold(llm, a)
    out = assert_warm_equals_cold(llm, a + tokens(50, 11))  # 10 leased + 4 new = 14 = the pool
    assert out.resume_tokens == 160
    assert llm.cache.forms[0].pool.evictions == 0


C8_PRESSURE = {
    # the pools made tight: (cache overrides, unrelated requests run between A and its follow-up)
    "full_kv": ({"full_kv_blocks": 16}, (72,)),
    "swa_window": ({"swa_blocks": 13}, (72, 56)),
    "compressed_kv+indexer_keys": ({"compressed_blocks": 15}, (72,)),
    "uncompressed_tail+indexer_rows": ({"checkpoint_interval_tokens": 256, "tail_slots": 3}, (72,)),
    "linear_state": ({"checkpoint_interval_tokens": 256, "linear_checkpoints": 3}, (72,)),
}


def _tight_pools(cache: PrefixCache, case: str) -> list[BlockPool]:
    assert cache.tail is not None and cache.indexer is not None and cache.linear is not None
    kv = {f.form: f.pool for f in cache.kv_forms}
    return {
        "full_kv": [kv[Form.FULL_KV]],
        "swa_window": [kv[Form.SWA_WINDOW]],
        "compressed_kv+indexer_keys": [g.pool for g in cache.entry_groups()],
        "uncompressed_tail+indexer_rows": [cache.tail.slots.pool, cache.indexer.slots.pool],
        "linear_state": [cache.linear.pool],
    }[case]


def _matched_objects(cache: PrefixCache, hashes: Sequence[BlockHash], resume: int) -> dict[BlockPool, dict[int, BlockHash]]:
    """Every object a resume at ``resume`` reads, per pool: block id → the hash it is cached under."""
    assert cache.tail is not None and cache.indexer is not None and cache.linear is not None
    out: dict[BlockPool, dict[int, BlockHash]] = defaultdict(dict)
    for kv in cache.kv_forms:
        for page in kv.needed_pages(resume):
            block = kv.pool.lookup(hashes[page])
            assert block is not None
            out[kv.pool][block] = hashes[page]
    for pages in cache.entry_groups():
        for page in range(pages.pages_needed(resume)):
            block = pages.block_of(hashes, page)
            assert block is not None
            out[pages.pool][block] = pages.page_hash(hashes, page)
    at = hashes[resume // U - 1]
    for pool, slot in (
        (cache.tail.slots.pool, cache.tail.slots.slot_at(hashes, resume)),
        (cache.indexer.slots.pool, cache.indexer.slots.slot_at(hashes, resume)),
        (cache.linear.pool, cache.linear.checkpoint_at(hashes, resume)),
    ):
        assert slot is not None
        out[pool][slot] = at
    return out


@pytest.mark.parametrize("case", list(C8_PRESSURE))
def test_c8_own_allocations_never_evict_the_matched_prefix(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Case C8 under memory pressure in every pooled form: full-KV pages, window pages,
    compressed entry pages (main and indexer keys), tail and indexer row slots, recurrent
    checkpoints. A's objects sit evictable — the least recently used — in a pool that unrelated
    requests have filled, and A's follow-up must evict to allocate. Every object its lookup
    matched is leased (pages, for as long as the request reads them) or copied (entries, rows,
    checkpoints) before the request allocates anything in any pool; no allocation hands out a
    leased block; the follow-up's own allocations evict none of the matched objects (pages of
    the window once the request has moved past them excepted: it released them itself); it
    resumes at 160 with every form a hit (no ``epoch_changed``) and its logits equal a cold
    run."""
    overrides, unrelated = C8_PRESSURE[case]
    sink = ListSink()
    llm = LLM(cache=cache_config(**overrides), check_invariants=True, telemetry=sink)
    cache = llm.cache
    a = tokens(170, 10)  # 10 full pages + a partial one; its last checkpoint is at 160
    warm_equals_cold(llm, a)
    for i, n in enumerate(unrelated):
        warm_equals_cold(llm, tokens(n, 60 + i))
    follow_up = a + tokens(50, 11)
    hashes = cache.block_hashes(follow_up)
    plan = cache.lookup(hashes, len(follow_up))
    assert plan.resume_tokens == 160
    matched = _matched_objects(cache, hashes, plan.resume_tokens)
    tight = _tight_pools(cache, case)
    for pool in tight:
        assert pool.num_free == pool.num_blocks - 1, f"{pool.name}: something is leased between requests"
    evictions = {pool: pool.evictions for pool in tight}

    started: list[bool] = []
    pinned: dict[BlockPool, set[int]] = {}  # matched blocks leased when start() returned
    allocations: list[tuple[BlockPool, int, bool, bool]] = []  # pool, block, after start, was leased

    def recording_start(*args, _start=cache.start, **kwargs):
        seq = _start(*args, **kwargs)
        started.append(True)
        pinned.update({pool: {b for b in objects if pool.ref_count[b]} for pool, objects in matched.items()})
        return seq

    monkeypatch.setattr(cache, "start", recording_start)
    for form in cache.forms:
        for pool in form.pools:

            def allocate(_pool: BlockPool = pool, _allocate=pool.allocate) -> int:
                leased = {b for b in range(1, _pool.num_blocks) if _pool.ref_count[b]}
                block = _allocate()
                allocations.append((_pool, block, bool(started), block in leased))
                return block

            monkeypatch.setattr(pool, "allocate", allocate)

    out = warm_equals_cold(llm, follow_up)
    assert out.resume_tokens == 160
    assert_all_hit(out, sink)
    assert_limit(out, sink, None, Reason.NONE)
    for pool in tight:
        assert pool.evictions > evictions[pool], f"{pool.name}: the follow-up evicted nothing (no pressure)"
    assert allocations and all(after for _, _, after, _ in allocations), "allocated before every hit was leased"
    assert not [(p.name, b) for p, b, _, leased in allocations if leased], "a leased block was handed out again"
    kv_pools = {kv.pool for kv in cache.kv_forms}
    for pool, objects in matched.items():
        if pool in kv_pools:  # pages are read while the request runs: leased from the start
            assert pinned[pool] == set(objects), f"{pool.name}: matched pages not leased before allocation"
        if pool.name == Form.SWA_WINDOW:
            continue  # pages that leave the request's own window are released by it and may be reused
        taken = {b for p, b, _, _ in allocations if p is pool} & set(objects)
        assert not taken, f"{pool.name}: the follow-up's own allocations took matched blocks {sorted(taken)}"
        for block, h in objects.items():
            assert pool.block_hash[block] == h, f"{pool.name}: matched block {block} no longer caches its prefix"
    no_leases(llm)


# -- C11: cache key shortened, recurrent state not -------------------------------------------------------------------
@pytest.mark.parametrize("model", [HYBRID, V4_MIX], ids=["hybrid", "csa-hca-full"])
def test_c11_checkpoint_keyed_by_exactly_its_prefix(model: str | HybridConfig) -> None:
    """Case C11: R1 = P + hidden reasoning + answer (decoded); R2 = P + U must not resume from a
    state that includes R1's decoded tokens — neither recurrent state nor a compressor's tail and
    indexer rows: the checkpoint at P's last boundary is keyed by exactly that prefix, and every
    form is a hit there."""
    sink = ListSink()
    llm = LLM(
        model,
        cache=CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64),
        telemetry=sink,
    )
    p = tokens(100, 10)
    llm.generate([p], SamplingParams(max_tokens=60))
    r2 = warm_equals_cold(llm, p + tokens(30, 11))
    assert r2.resume_tokens == 96  # the checkpoint at P's last boundary, not anything later
    assert_all_hit(r2, sink)
    assert_limit(r2, sink, None, Reason.NONE)
    r3 = warm_equals_cold(llm, p[:64] + tokens(30, 12))
    assert r3.resume_tokens == 64
    assert_all_hit(r3, sink)


# -- C12: store rule and lookup rule disagree ------------------------------------------------------------------------
def test_c12_window_pages_are_published_only_where_a_resume_point_needs_them() -> None:
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


C12_GEOMETRIES: dict[str, str | HybridConfig] = {
    "hybrid": HYBRID,
    "fa-swa": FA_SWA,
    "all-swa": ALL_SWA,
    "swa-lin": SWA_LIN,
    "fa-hca16": FA_HCA16,
    "fa-hca32": FA_HCA32,
    "csa-hca-full": V4_MIX,
    "csa-hca-swa": V4_WINDOWS,
    "hca64": hca_geometry(64),
}


@pytest.mark.parametrize("geometry", list(C12_GEOMETRIES))
def test_c12_every_retained_boundary_is_a_hit(geometry: str) -> None:
    """Case C12 for every form, under several geometries, intervals and chunk sizes: a random
    sequence is stored once; then a prompt sharing exactly its first c tokens must resume at c
    with every form a hit, for every boundary c the store side retains — every U boundary when
    no form needs per-boundary state, else every checkpoint position (the interval's multiples
    and the last boundary before the end). A follow-up at one of them equals a cold run."""
    rng = random.Random(geometry)
    model = C12_GEOMETRIES[geometry]
    for trial in range(2):
        interval = rng.choice([32, 48, 64])
        cfg = cache_config(checkpoint_interval_tokens=interval, max_prefill_chunk_tokens=rng.choice([32, 64]))
        sink = ListSink()
        llm = LLM(model, cache=cfg, check_invariants=True, telemetry=sink)
        length = rng.randrange(40, 220)
        ids = tokens(length, 3000 + 10 * trial + len(geometry))
        warm_equals_cold(llm, ids)
        layout = llm.layout
        per_boundary_state = "linear_attention" in layout.layer_types or any(
            spec.compressor.overlapping or spec.compressor.ratio > U for spec in layout.compressed_state_specs.values()
        )
        limit = resume_limit(length, U)
        if per_boundary_state:
            retained = sorted({*range(interval, limit + 1, interval), limit} - {0})
        else:
            retained = list(range(U, length // U * U + 1, U))
        assert retained
        for c in retained:
            follow_up = ids[:c] + tokens(U + 3, 4000 + c)
            plan = llm.cache.lookup(llm.cache.block_hashes(follow_up), len(follow_up))
            lost = {f.form: (f.usable_tokens, f.reason) for f in plan.forms if f.outcome != Outcome.HIT}
            assert (plan.hash_hit_tokens, plan.resume_tokens, lost) == (c, c, {}), (
                f"{geometry} (interval {interval}, T = {length}): stored boundary {c} is not a hit"
            )
        c = rng.choice(retained)
        out = warm_equals_cold(llm, ids[:c] + tokens(U + 3, 4000 + c))
        assert out.resume_tokens == c
        assert_all_hit(out, sink)
        assert_limit(out, sink, None, Reason.NONE)
        no_leases(llm)


# -- other defects a review found -------------------------------------------------------------------------------------
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


def test_limiting_form_is_never_reported_as_a_hit() -> None:
    """The form that set L* carries the request's limiting reason in its own lookup: here the
    follow-up's hash hit reaches into R1's decoded tokens (192) but its last checkpoint is at
    160 (the prompt end), so ``linear_state`` limits and says so. The window behind 160 survived
    the unrelated request; the window form's own loss past 160 is ``below_granularity`` (decoded tokens have no
    checkpoint, so their window pages are never stored), and it does not mask the real cause."""
    cfg = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64, swa_blocks=20)
    llm = LLM(cache=cfg, check_invariants=True)
    a = tokens(160, 7)
    out = llm.generate([a], SamplingParams(max_tokens=40))[0]
    llm.score(tokens(208, 9))
    report = warm_equals_cold(llm, a + out.output_token_ids + tokens(5, 8)).cache
    assert (report.hash_hit_tokens, report.resume_tokens) == (192, 160)
    assert (report.limiting_form, report.limiting_reason) == (Form.LINEAR_STATE, Reason.LINEAR_CHECKPOINT_MISSING)
    lin, swa = report.form(Form.LINEAR_STATE), report.form(Form.SWA_WINDOW)
    assert (lin.outcome, lin.reason, lin.usable_tokens) == (Outcome.INVALIDATED, Reason.LINEAR_CHECKPOINT_MISSING, 160)
    assert (swa.outcome, swa.reason, swa.usable_tokens) == (Outcome.INVALIDATED, Reason.BELOW_GRANULARITY, 160)


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
    assert all(p.evictions == 0 for f in llm.cache.forms for p in f.pools)
    assert (r2.hash_hit_tokens, r2.resume_tokens) == (64, 0)
    swa = r2.form(Form.SWA_WINDOW)
    assert (swa.outcome, swa.reason) == (Outcome.INVALIDATED, Reason.BELOW_GRANULARITY)
    assert (r2.limiting_form, r2.limiting_reason) == (Form.LINEAR_STATE, Reason.LINEAR_CHECKPOINT_MISSING)


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
        for kv in form.kv_groups.values():
            assert kv[0].abs().max().item() == 0.0
    for pages in llm.cache.entry_groups():
        assert pages.entries[0].abs().max().item() == 0.0
    for slots in (llm.cache.tail, llm.cache.indexer):
        assert slots is not None
        assert all(t[0].abs().max().item() == 0.0 for ts in slots.slots.tensors for t in ts.values() if t[0].numel())
    assert llm.cache.linear is not None
    assert llm.cache.linear.conv[0].abs().max().item() == 0.0
    assert llm.cache.linear.recurrent[0].abs().max().item() == 0.0
