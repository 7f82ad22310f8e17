"""The host and disk tiers per tensor-parallel rank: each rank offloads and swaps in its own
shards (its disk tier in its own ``rank<r>`` directory), a copy that fails on one rank lowers
every rank's resume point, and after a restart an object is restorable only if every rank's
shard of it is intact (otherwise skipped and counted)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from engine import LLM, CacheConfig
from engine.events import Admission, Outcome, Reason, Tier
from engine.faults import Faults
from tests.helpers import TOLERANCE, tokens
from tests.parallel import tp_helpers

MODEL = "kvscope_hybrid-tiny"


def tiered(directory: Path) -> CacheConfig:
    return CacheConfig(
        unit_tokens=16, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=48,
        host_tier_bytes=1 << 24, disk_tier_bytes=1 << 26, disk_tier_dir=str(directory),
    )  # fmt: skip


def skipped(llm: LLM) -> dict[str, int]:
    assert llm.cache.tiers is not None
    return dict(llm.cache.tiers.skipped)


def disk_files(llm: LLM) -> int:
    assert llm.cache.tiers is not None
    return sum(1 for e in llm.cache.tiers.entries.values() if e.tier is Tier.DISK)


def verdicts(llm: LLM, ids: list[int]) -> tuple[int, torch.Tensor, dict[str, tuple[Reason, int]]]:
    """``score`` on this rank: L*, the logits and every form's (reason, tp_rank)."""
    out = llm.score(ids)
    return out.resume_tokens, out.logits, {f.form.value: (f.reason, f.tp_rank) for f in out.cache.forms}


def assert_cold(warm_logits: torch.Tensor, resume: int, ids: list[int], ref: LLM) -> None:
    diff = (warm_logits - ref.prefill_logits(ids)[resume:]).abs().max().item()
    assert diff <= TOLERANCE[torch.float32], f"warm != cold by {diff:.3g} (L* = {resume})"


def test_each_rank_swaps_in_its_own_shards(tmp_path: Path) -> None:
    ref = LLM(MODEL, device="cpu")
    tp = LLM(MODEL, device="cpu", cache=tiered(tmp_path), tensor_parallel_size=2, check_invariants=True)
    try:
        base = tokens(100, 1)
        tp.score(base)
        assert tp.offload(Tier.HOST) > 0
        ids = base + tokens(20, 2)
        out = tp.score(ids)
        assert (out.resume_tokens, out.cache.admission) == (96, Admission.SWAP_IN)
        assert all(f.outcome is Outcome.RECOVERED and f.tier is Tier.HOST for f in out.cache.forms)
        assert_cold(out.logits, out.resume_tokens, ids, ref)
        assert all(tp.on_every_rank(tp_helpers.check_invariants))
    finally:
        tp.close()
        ref.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_a_copy_corrupt_on_rank_1_lowers_every_rank(tmp_path: Path) -> None:
    ref = LLM(MODEL, device="cpu")
    faults = Faults(corrupt_offloaded_file=True, on_rank=1)
    tp = LLM(MODEL, device="cpu", cache=tiered(tmp_path), tensor_parallel_size=2, check_invariants=True, faults=faults)
    try:
        base = tokens(100, 3)
        tp.score(base)
        assert tp.offload(Tier.DISK) > 0
        ids = base + tokens(20, 4)
        outs = tp.on_every_rank(verdicts, ids)  # the same request on every rank, in lockstep
        out = outs[0]
        assert isinstance(out, tuple)
        resume, logits, mine = out
        assert resume == 0  # rank 1's shards never arrived intact: nothing to resume on
        assert_cold(logits, resume, ids, ref)
        # rank 0's copies arrived: it names rank 1; rank 1 reports its own corrupt files
        assert {(r, rank) for r, rank in mine.values()} == {(Reason.TP_DISAGREE, 1)}
        theirs = outs[1][2]  # type: ignore[index]
        assert Reason.OFFLOAD_CORRUPT in {r for r, _ in theirs.values()}
        assert all(tp.on_every_rank(tp_helpers.check_invariants))
    finally:
        tp.close()
        ref.close()


def test_after_a_restart_only_objects_intact_on_every_rank_are_restored(tmp_path: Path) -> None:
    ref = LLM(MODEL, device="cpu")
    base = tokens(100, 5)
    first = LLM(MODEL, device="cpu", cache=tiered(tmp_path), tensor_parallel_size=2)
    try:
        first.score(base)
        assert first.offload(Tier.DISK) > 0
    finally:
        first.close()
    rank1 = sorted((tmp_path / "rank1").rglob("*.safetensors"))
    assert rank1 and len(rank1) == len(sorted((tmp_path / "rank0").rglob("*.safetensors")))
    prefix = hashlib.sha1(b"full_kv").hexdigest()[:10]  # tier_files.file_path: the pool's name hashed
    lost = [p for p in rank1 if p.name.startswith(prefix)]  # rank 1 lost its full_kv shards
    assert lost
    for path in lost:
        path.unlink()
    again = LLM(MODEL, device="cpu", cache=tiered(tmp_path), tensor_parallel_size=2, check_invariants=True)
    try:
        counts = again.on_every_rank(skipped)
        assert counts[0].get("tp_incomplete") == len(lost) and "tp_incomplete" not in counts[1]
        assert again.on_every_rank(disk_files) == [len(rank1) - len(lost)] * 2  # the same objects on both
        ids = base + tokens(20, 6)
        out = again.score(ids)
        assert out.resume_tokens == 0  # no full_kv anywhere: nothing exact to resume on
        assert_cold(out.logits, out.resume_tokens, ids, ref)
        assert all(again.on_every_rank(tp_helpers.check_invariants))
    finally:
        again.close()
        ref.close()
