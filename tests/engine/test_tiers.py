"""Host and disk tiers (engine/cache/tiers.py), per-form recovery by swap-in, the admission
cost model and recovery cap, and the tier faults: every restore is exact or lowers L* with its
reason; output always equals a cold run."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

import engine.cache.tier_files as tier_files_module
from engine import LLM, CacheConfig
from engine.cache.admission import CostModel
from engine.events import (
    Admission,
    BlockAction,
    BlockEvent,
    CacheLookup,
    EngineStats,
    EventBatch,
    Form,
    Outcome,
    Reason,
    RequestEvent,
    Tier,
    check_batch,
)
from engine.faults import Faults
from engine.telemetry import ListSink
from tests.helpers import assert_no_leases, assert_warm_equals_cold, tokens

U = 16
FAST = CostModel(seconds_per_token=1e-3, tier_bytes_per_second={Tier.HOST: 1e12, Tier.DISK: 1e12})
"""Swap-ins far cheaper than recompute: admission always swaps in."""
MODELS = ("kvscope_hybrid-tiny", "qwen3_next-tiny", "deepseek_v4-tiny")


def cfg(tmp_path: Path | None = None, **overrides: object) -> CacheConfig:
    base: dict[str, object] = {
        "unit_tokens": U,
        "checkpoint_interval_tokens": 32,
        "max_prefill_chunk_tokens": 64,
        "host_tier_bytes": 64 << 20,
    }
    if tmp_path is not None:
        base |= {"disk_tier_bytes": 64 << 20, "disk_tier_dir": str(tmp_path / "tiers")}
    return CacheConfig(**(base | overrides))  # type: ignore[arg-type]


def prompts(seed: int = 1) -> tuple[list[int], list[int]]:
    prefix = tokens(128, seed)
    return prefix, [*prefix, *tokens(20, seed + 1)]


def lookups(sink: ListSink) -> dict[Form, CacheLookup]:
    """The last request's cache_lookup events by form."""
    last = [e for e in sink.events if isinstance(e, RequestEvent)][-1]
    return {e.form: e for e in sink.events if isinstance(e, CacheLookup) and e.request_id == last.request_id}


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.DISK])
@pytest.mark.parametrize("model", MODELS)
def test_every_form_swaps_in_from_the_tier_and_equals_cold(model: str, tier: Tier, tmp_path: Path) -> None:
    sink = ListSink()
    llm = LLM(model, cache=cfg(tmp_path), check_invariants=True, telemetry=sink, cost_model=FAST)
    prefix, follow_up = prompts()
    assert_warm_equals_cold(llm, prefix)
    resident = llm.cache.lookup(llm.cache.block_hashes(follow_up), len(follow_up)).resume_tokens
    assert resident == 128
    moved = llm.offload(tier)
    assert moved > 0 and all(p.num_cached == 0 for f in llm.cache.forms for p in f.pools)
    out = assert_warm_equals_cold(llm, follow_up)
    assert out.resume_tokens == resident and out.cache.admission == Admission.SWAP_IN
    events = lookups(sink)
    for f in out.forms:  # every form the model has came back from the tier, as one unit
        assert (f.outcome, f.tier) == (Outcome.RECOVERED, tier), f
        assert f.bytes_moved > 0 and f.reason != Reason.NONE
        assert (events[f.form].outcome, events[f.form].tier, events[f.form].bytes_moved) == (Outcome.RECOVERED, tier, f.bytes_moved)
    request = [e for e in sink.events if isinstance(e, RequestEvent)][-1]
    assert request.admission == Admission.SWAP_IN and request.predicted_seconds > 0 and request.actual_seconds > 0
    check_batch(EventBatch(schema_version=1, engine_id=llm.engine_id, seq=1, sent_at=1.0, events=sink.events))
    assert_no_leases(llm)
    llm.close()


def served_then_offloaded_to_disk(config: CacheConfig, prefix: list[int]) -> int:
    """Serve ``prefix`` on an engine, offload everything to its disk tier, close it; returns the
    objects the disk tier holds."""
    with LLM("kvscope_hybrid-tiny", cache=config, cost_model=FAST) as first:
        first.score(prefix)
        return first.offload(Tier.DISK)


def test_restart_finds_the_disk_tier_again(tmp_path: Path) -> None:
    config = cfg(tmp_path, host_tier_bytes=0)
    prefix, follow_up = prompts(3)
    moved = served_then_offloaded_to_disk(config, prefix)
    files = sorted((tmp_path / "tiers").glob("*.safetensors"))
    assert len(files) == moved > 0
    sink = ListSink()
    second = LLM("kvscope_hybrid-tiny", cache=config, check_invariants=True, telemetry=sink, cost_model=FAST)
    tiers = second.cache.tiers
    assert tiers is not None and len(tiers.entries) == moved and not tiers.skipped
    # the rebuilt index counts for the hash hit before anything is on the device
    plan = second.cache.lookup(second.cache.block_hashes(follow_up), len(follow_up))
    assert plan.hash_hit_tokens == 128 and plan.resume_tokens == 0
    out = assert_warm_equals_cold(second, follow_up)
    assert out.resume_tokens == 128 and {f.tier for f in out.forms} == {Tier.DISK}
    assert_no_leases(second)
    second.close()


def _rewrite_metadata(path: Path, **changes: str) -> None:
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    path.write_bytes(safetensors.torch.save(tensors, metadata=meta | changes))


def test_corrupt_truncated_and_foreign_files_are_skipped_with_a_counted_reason(tmp_path: Path) -> None:
    config = cfg(tmp_path, host_tier_bytes=0)
    prefix, follow_up = prompts(5)
    moved = served_then_offloaded_to_disk(config, prefix)
    files = sorted((tmp_path / "tiers").glob("*.safetensors"))
    headers = {path: safetensors.safe_open(str(path), framework="pt").metadata() for path in files}
    # the full-KV page every resume needs gets the bit flip
    first_page = LLM("kvscope_hybrid-tiny").cache.block_hashes(prefix)[0].hex()
    flipped = next(path for path, meta in headers.items() if (meta["pool"], meta["hash"]) == ("full_kv", first_page))
    truncated, foreign = [path for path in files if path != flipped][:2]
    data = bytearray(flipped.read_bytes())
    data[-3] ^= 0x5A  # a bit flip in the tensor bytes: the checksum catches it
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-40])
    fingerprints = json.loads(safetensors.safe_open(str(foreign), framework="pt").metadata()["fingerprints"])
    fingerprints = {name: fp.replace("float32", "float16") for name, fp in fingerprints.items()}
    _rewrite_metadata(foreign, fingerprints=json.dumps(fingerprints, sort_keys=True))
    (tmp_path / "tiers" / "garbage.safetensors").write_bytes(b"not a tier file")

    llm = LLM("kvscope_hybrid-tiny", cache=config, check_invariants=True, cost_model=FAST)
    tiers = llm.cache.tiers
    assert tiers is not None
    assert tiers.skipped == {"offload_corrupt": 3, "layout_mismatch": 1}
    assert len(tiers.entries) == moved - 3
    assert not flipped.exists() and not truncated.exists()  # unusable: deleted
    assert foreign.exists()  # another layout's file is left alone
    out = assert_warm_equals_cold(llm, follow_up)  # resumes only as far as intact objects allow
    assert out.resume_tokens == 0 and out.cache.form(Form.FULL_KV).outcome == Outcome.INVALIDATED
    assert_no_leases(llm)
    llm.close()


def test_fault_corrupt_offloaded_file_lowers_the_resume_with_offload_corrupt(tmp_path: Path) -> None:
    sink = ListSink()
    config = cfg(tmp_path, host_tier_bytes=0)
    llm = LLM("kvscope_hybrid-tiny", cache=config, check_invariants=True, telemetry=sink, cost_model=FAST, faults=Faults(corrupt_offloaded_file=True))
    prefix, follow_up = prompts(7)
    llm.score(prefix)
    llm.offload(Tier.DISK)
    out = assert_warm_equals_cold(llm, follow_up)  # never resumes from the corrupted bytes
    assert out.resume_tokens == 0 and out.cache.limiting_reason == Reason.OFFLOAD_CORRUPT
    corrupt = [f for f in out.forms if f.reason == Reason.OFFLOAD_CORRUPT]
    assert corrupt and all(f.outcome == Outcome.INVALIDATED for f in corrupt)
    assert {e.reason for e in lookups(sink).values()} >= {Reason.OFFLOAD_CORRUPT}
    assert llm.cache.tiers is not None and llm.cache.tiers.skipped["offload_corrupt"] > 0
    assert not out.approximate
    assert_no_leases(llm)
    llm.close()


def test_a_restore_with_the_wrong_layout_reports_layout_mismatch() -> None:
    llm = LLM("qwen3_next-tiny", cache=cfg(), check_invariants=True, cost_model=FAST)
    prefix, follow_up = prompts(9)
    llm.score(prefix)
    llm.offload(Tier.HOST)
    tiers = llm.cache.tiers
    assert tiers is not None
    for (pool, _), entry in tiers.entries.items():
        if pool == "linear_state":  # every checkpoint copy was written for another kernel
            assert entry.tensors is not None
            entry.tensors = {name: t.half() for name, t in entry.tensors.items()}
    out = assert_warm_equals_cold(llm, follow_up)
    linear = out.cache.form(Form.LINEAR_STATE)
    assert (linear.outcome, linear.reason) == (Outcome.INVALIDATED, Reason.LAYOUT_MISMATCH)
    assert out.resume_tokens < 128
    assert_no_leases(llm)


@pytest.mark.parametrize("wait", [False, True])
def test_fault_read_during_swap_in_waits_or_lowers_with_in_flight_swap(wait: bool) -> None:
    sink = ListSink()
    config = cfg(swap_in_wait=wait)
    llm = LLM("qwen3_next-tiny", cache=config, check_invariants=True, telemetry=sink, cost_model=FAST, faults=Faults(read_during_swap_in=True))
    prefix, follow_up = prompts(11)
    llm.score(prefix)
    llm.offload(Tier.HOST)
    assert llm.prefetch(follow_up) > 0  # the copies are held in flight by the fault
    tiers = llm.cache.tiers
    assert tiers is not None and any(tiers.in_flight(pool, h) for pool, h in tiers.entries)
    llm.cache.check_invariants()
    out = assert_warm_equals_cold(llm, follow_up)  # a read arrives while they are SWAPPING_IN
    if wait:
        assert out.resume_tokens == 128 and out.cache.admission == Admission.SWAP_IN
        assert {f.outcome for f in out.forms} == {Outcome.RECOVERED}
    else:
        assert out.resume_tokens == 0 and out.cache.limiting_reason == Reason.IN_FLIGHT_SWAP
        assert {e.reason for e in lookups(sink).values()} == {Reason.IN_FLIGHT_SWAP}
    llm.close()  # lets the held copies finish and commits them
    assert not any(tiers.in_flight(pool, h) for pool, h in tiers.entries)
    assert_no_leases(llm)


def test_c9_indexer_state_is_a_mandatory_part_of_the_offloaded_prefix() -> None:
    """Case C9 (CMP_4 + IDX): R1's prefix goes to host, its device copies are evicted, R2 = R1 +
    U restores it. The indexer's keys and pending rows travel with the compressed KV (same
    boundary stamp); a restore missing them yields indexer_stale and a lower resume point."""
    prefix = tokens(128, 13)
    r2 = [*prefix, *tokens(U, 14)]
    whole = LLM("deepseek_v4-tiny", cache=cfg(), check_invariants=True, cost_model=FAST)
    whole.score(prefix)
    whole.offload(Tier.HOST)
    tiers = whole.cache.tiers
    assert tiers is not None
    assert any(pool.startswith("indexer_state") for pool, _ in tiers.entries)  # offloaded with the KV
    out = assert_warm_equals_cold(whole, r2)
    assert out.resume_tokens == 128
    assert (out.cache.form(Form.INDEXER_STATE).outcome, out.cache.form(Form.INDEXER_STATE).tier) == (Outcome.RECOVERED, Tier.HOST)

    sink = ListSink()
    partial = LLM("deepseek_v4-tiny", cache=cfg(), check_invariants=True, cost_model=FAST, telemetry=sink)
    partial.score(prefix)
    partial.offload(Tier.HOST)
    tiers = partial.cache.tiers
    assert tiers is not None
    at_end = partial.cache.block_hashes(prefix)[-1]
    assert ("compressed_kv[r4]", at_end) in tiers.entries and ("indexer_state[pending]", at_end) in tiers.entries
    tiers.drop("indexer_state[pending]", at_end)  # the offload left the index's pending rows out
    out = assert_warm_equals_cold(partial, r2)
    indexer = out.cache.form(Form.INDEXER_STATE)
    assert (indexer.outcome, indexer.reason) == (Outcome.INVALIDATED, Reason.INDEXER_STALE)
    assert 0 < out.resume_tokens < 128  # the deepest boundary where every form could be restored
    compressed = out.cache.form(Form.COMPRESSED_KV)  # restorable to the whole prefix: not what limited L*
    assert (compressed.outcome, compressed.usable_tokens, compressed.tier) == (Outcome.RECOVERED, 128, Tier.HOST)
    assert (out.cache.limiting_form, out.cache.limiting_reason) == (Form.INDEXER_STATE, Reason.INDEXER_STALE)
    assert lookups(sink)[Form.INDEXER_STATE].reason == Reason.INDEXER_STALE
    assert_no_leases(partial)


def test_evictions_write_back_to_host_and_the_full_host_tier_moves_on_to_disk(tmp_path: Path) -> None:
    config = cfg(tmp_path, full_kv_blocks=24, swa_blocks=64, linear_checkpoints=6, compressed_blocks=32, tail_slots=6, host_tier_bytes=96 << 10)
    llm = LLM("kvscope_hybrid-tiny", cache=config, check_invariants=True, cost_model=FAST)
    first, follow_up = prompts(15)
    llm.score(first)
    for seed in range(4):  # unrelated prompts push the first one out of the device pools
        llm.score(tokens(128, 200 + seed))
    tiers = llm.cache.tiers
    assert tiers is not None
    tiers.flush()
    assert sum(tiers.offloaded.values()) > 0
    assert tiers.used[Tier.HOST] <= 96 << 10 and tiers.used[Tier.DISK] > 0  # demoted when the host filled
    out = assert_warm_equals_cold(llm, follow_up)
    assert out.resume_tokens > 0 and out.cache.admission == Admission.SWAP_IN
    assert_no_leases(llm)
    llm.close()


def test_admission_recomputes_when_the_swap_in_costs_more(tmp_path: Path) -> None:
    slow = CostModel(seconds_per_token=1e-6, tier_bytes_per_second={Tier.HOST: 1.0, Tier.DISK: 1.0})
    sink = ListSink()
    llm = LLM("qwen3_next-tiny", cache=cfg(), check_invariants=True, telemetry=sink, cost_model=slow)
    prefix, follow_up = prompts(17)
    llm.score(prefix)
    llm.offload(Tier.HOST)
    out = assert_warm_equals_cold(llm, follow_up)
    assert out.resume_tokens == 0 and out.cache.admission == Admission.COLD
    assert {f.reason for f in out.forms} == {Reason.ADMISSION_RECOMPUTE_CHEAPER}
    request = [e for e in sink.events if isinstance(e, RequestEvent)][-1]
    assert request.predicted_seconds == pytest.approx(slow.prefill_seconds(0, len(follow_up)))


def test_recovery_cap_degrades_a_swap_in_and_a_replay() -> None:
    llm = LLM("qwen3_next-tiny", cache=cfg(max_recovery_bytes=1024), check_invariants=True, cost_model=FAST)
    prefix, follow_up = prompts(19)
    llm.score(prefix)
    llm.offload(Tier.HOST)
    out = assert_warm_equals_cold(llm, follow_up)
    assert out.resume_tokens == 0 and {f.reason for f in out.forms} == {Reason.RECOVERY_CAP_REACHED}
    assert llm.cache.recovery.bytes_in_flight == 0

    replaying = LLM(
        "qwen3_next-tiny",
        cache=cfg(host_tier_bytes=0, tail_replay="only", max_replay_tokens=16, replay_min_tokens=32),
        check_invariants=True,
        cost_model=FAST,
    )
    replaying.score(prefix)
    out = assert_warm_equals_cold(replaying, follow_up)  # the exact plan: nothing replayed
    linear = out.cache.form(Form.LINEAR_STATE)
    assert (linear.outcome, linear.reason) == (Outcome.INVALIDATED, Reason.RECOVERY_CAP_REACHED)
    assert not out.approximate and replaying.cache.recovery.replay_tokens_in_flight == 0


def test_tail_replay_modes() -> None:
    """``fallback`` resumes at an exact checkpoint inside the replay budget; ``on`` replays
    anyway; ``only`` stores no recurrent checkpoint and reports the memory saved."""
    prefix = tokens(200, 21)
    follow_up = [*prefix, *tokens(30, 22)]
    outs = {}
    for mode in ("fallback", "on"):
        llm = LLM("qwen3_next-tiny", cache=cfg(host_tier_bytes=0, checkpoint_interval_tokens=64, linear_checkpoints=8, tail_replay=mode, replay_min_tokens=96), check_invariants=True)
        llm.score(prefix)
        linear = llm.cache.linear
        assert linear is not None
        hashes = llm.cache.block_hashes(follow_up)
        slot = linear.pool.lookup(hashes[192 // U - 1])
        assert slot is not None and linear.pool.lookup(hashes[128 // U - 1]) is not None
        linear.pool.invalidate(slot)  # the exact checkpoint at 192 is gone, the one at 128 is not
        outs[mode] = llm.score(follow_up)
    assert (outs["fallback"].resume_tokens, outs["fallback"].approximate) == (128, False)
    assert (outs["on"].resume_tokens, outs["on"].cache.replayed_tokens, outs["on"].approximate) == (192, 96, True)

    only = LLM("qwen3_next-tiny", cache=cfg(host_tier_bytes=0, tail_replay="only"), check_invariants=True)
    only.score(prefix)
    assert only.cache.linear is not None and only.cache.linear.pool.num_cached == 0
    assert only.cache.tail_replay_savings_bytes() == (CacheConfig().linear_checkpoints - 2) * only.cache.linear.bytes_per_block
    out = only.score(follow_up)
    assert out.approximate and out.cache.form(Form.LINEAR_STATE).outcome == Outcome.REPLAYED


def test_tier_config_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk_tier_dir"):
        LLM("qwen3_next-tiny", cache=CacheConfig(disk_tier_bytes=1 << 20))
    with pytest.raises(ValueError, match="tail_replay"):
        CacheConfig(tail_replay="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host_tier_bytes"):
        CacheConfig(host_tier_bytes=-1)
    llm = LLM("qwen3_next-tiny", cache=CacheConfig())
    with pytest.raises(ValueError, match="host tier is off"):
        llm.offload(Tier.HOST)


def test_block_events_and_engine_stats_cover_the_tiers() -> None:
    sink = ListSink()
    llm = LLM("qwen3_next-tiny", cache=cfg(), telemetry=sink, block_events=True, cost_model=FAST)
    prefix, follow_up = prompts(23)
    llm.score(prefix)
    moved = llm.offload(Tier.HOST)
    llm.emit_engine_stats()
    stats = {(e.form, e.tier): e for e in sink.events if isinstance(e, EngineStats) and e.tier != Tier.DEVICE}
    assert sum(e.used_blocks for e in stats.values()) == moved
    assert set(stats) == {(Form.FULL_KV, Tier.HOST), (Form.LINEAR_STATE, Tier.HOST)}
    assert all(e.used_bytes > 0 for e in stats.values())
    llm.score(follow_up)
    actions = Counter((e.action, e.tier) for e in sink.events if isinstance(e, BlockEvent))
    assert actions[(BlockAction.OFFLOADED, Tier.HOST)] == moved
    assert actions[(BlockAction.REMOVED, Tier.DEVICE)] >= moved  # the device copies went
    assert actions[(BlockAction.RESTORED, Tier.HOST)] > 0
    check_batch(EventBatch(schema_version=1, engine_id=llm.engine_id, seq=1, sent_at=1.0, events=sink.events))


def test_a_prefetch_under_tier_pressure_keeps_its_entries_and_counts_against_the_cap() -> None:
    """The prefetch's own allocations evict device blocks whose write-back makes room in a full
    host tier: the entries it is about to read are reserved first, so they are not the ones
    dropped. Its bytes are in flight (recovery cap) until committed."""
    def config(host: int) -> CacheConfig:
        return cfg(full_kv_blocks=10, linear_checkpoints=6, host_tier_bytes=host)

    first, second = tokens(128, 31), tokens(128, 32)
    follow_up = [*first, *tokens(5, 33)]
    probe = LLM("qwen3_next-tiny", cache=config(64 << 20), cost_model=FAST)
    probe.score(first)
    probe.offload(Tier.HOST)
    assert probe.cache.tiers is not None
    exactly = probe.cache.tiers.used[Tier.HOST]  # a host tier just big enough for the first prompt
    llm = LLM("qwen3_next-tiny", cache=config(exactly), check_invariants=True, cost_model=FAST)
    llm.score(first)
    llm.offload(Tier.HOST)
    llm.score(second)  # the device pools are full of the second prompt
    enqueued = llm.prefetch(follow_up)
    assert enqueued > 0 and llm.cache.recovery.bytes_in_flight == enqueued
    llm.cache.check_invariants()
    out = assert_warm_equals_cold(llm, follow_up)
    assert out.resume_tokens == 128 and llm.cache.recovery.bytes_in_flight == 0
    assert_no_leases(llm)


def test_a_swap_in_below_the_hash_hit_still_reports_its_bytes() -> None:
    llm = LLM("qwen3_next-tiny", cache=cfg(checkpoint_interval_tokens=64), check_invariants=True, cost_model=FAST)
    prefix = tokens(200, 35)
    llm.score(prefix)
    llm.offload(Tier.HOST)
    out = assert_warm_equals_cold(llm, [*prefix[:150], *tokens(20, 36)])  # hash hit 144, checkpoint at 128
    assert (out.resume_tokens, out.cache.hash_hit_tokens, out.cache.admission) == (128, 144, Admission.SWAP_IN)
    for f in out.forms:  # every form's swap-in shows, below L* too
        assert f.tier == Tier.HOST and f.bytes_moved > 0, f
    # the host tier held full_kv's pages to the hash hit: restorable, so not the limit; the
    # recurrent state has no checkpoint past 128 (it lost tokens past L* and stays invalidated)
    full, linear = out.cache.form(Form.FULL_KV), out.cache.form(Form.LINEAR_STATE)
    assert (full.outcome, full.reason, full.usable_tokens, full.recoverable_tokens) == (Outcome.RECOVERED, Reason.KV_EVICTED, 144, 128)
    assert (linear.outcome, linear.reason, linear.usable_tokens) == (Outcome.INVALIDATED, Reason.LINEAR_CHECKPOINT_MISSING, 128)
    assert (out.cache.limiting_form, out.cache.limiting_forms) == (Form.LINEAR_STATE, (Form.LINEAR_STATE,))


def test_one_engine_per_disk_tier_directory(tmp_path: Path) -> None:
    first = LLM("qwen3_next-tiny", cache=cfg(tmp_path))
    with pytest.raises(ValueError, match="in use by another engine"):
        LLM("qwen3_next-tiny", cache=cfg(tmp_path))
    first.close()
    LLM("qwen3_next-tiny", cache=cfg(tmp_path)).close()  # free again after close


def test_tier_misuse_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="no tier_bytes_per_second for the enabled host tier"):
        LLM("qwen3_next-tiny", cache=cfg(), cost_model=CostModel(seconds_per_token=1e-3))
    with pytest.raises(ValueError, match="not to the device"):
        LLM("qwen3_next-tiny", cache=cfg(), cost_model=FAST).offload(Tier.DEVICE)
    with pytest.raises(ValueError, match="seconds per object"):
        CostModel(seconds_per_token=1e-3, tier_seconds_per_object={Tier.DISK: -1.0})


def test_a_failed_engine_start_gives_the_disk_tier_directory_back(tmp_path: Path) -> None:
    host_only = CostModel(seconds_per_token=1e-3, tier_bytes_per_second={Tier.HOST: 1e12})
    with pytest.raises(ValueError, match="enabled disk tier"):
        LLM("qwen3_next-tiny", cache=cfg(tmp_path), cost_model=host_only)
    LLM("qwen3_next-tiny", cache=cfg(tmp_path), cost_model=FAST).close()  # not held by the failed one


def test_a_late_write_of_a_dropped_copy_keeps_the_newer_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy being moved to disk fails its swap-in (dropped meanwhile) while its file write is
    still running; the object is copied down again under the same file name. The first write's
    completion must not delete the second copy's file."""
    llm = LLM("qwen3_next-tiny", cache=cfg(tmp_path), cost_model=FAST)
    llm.score(tokens(128, 41))
    tiers = llm.cache.tiers
    assert tiers is not None
    pool = llm.cache.kv_forms[0].pool
    h, block = next(iter(pool.cached_blocks.items()))
    slow_once = threading.Event()
    write = tier_files_module.write_file

    def slow_first_write(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str], corrupt: bool) -> None:
        if not slow_once.is_set():
            slow_once.set()
            time.sleep(0.5)
        write(path, tensors, meta, corrupt)

    monkeypatch.setattr(tier_files_module, "write_file", slow_first_write)
    assert tiers.offload_now(pool, block, h, Tier.HOST) and tiers.offload_now(pool, block, h, Tier.DISK)
    entry = tiers.readable(pool.name, h)
    assert entry is not None and entry.fence is not None  # readable from memory while its file is written
    tiers.begin_swap_in(entry)
    target = pool.allocate()
    swap = tiers.copy_in(pool, entry, target)
    swap.future.result()
    tiers.drop(pool.name, h)  # declared wrong meanwhile
    assert tiers.finish_swap_in(swap) == Reason.EPOCH_CHANGED
    pool.release(target)
    assert tiers.offload_now(pool, block, h, Tier.DISK)  # the same object again, the same file name
    newer = tiers.entries[(pool.name, h)]
    assert newer is not entry and newer.path == entry.path
    tiers.flush()
    assert tiers.readable(pool.name, h) is newer and newer.path is not None and newer.path.exists()
    tiers.check_invariants()
    llm.close()
