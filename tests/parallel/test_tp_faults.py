"""Cross-rank agreement under faults: when rank 1 loses its shard of one form, every rank resumes
at the point rank 1 can serve, the output equals a cold run, rank 0's events say
``tp_disagree`` naming rank 1, and every rank's cache stays consistent. Also the start-up checks
(heads that do not divide, ranks whose pools differ) and a rank that dies."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from engine import LLM, CacheConfig
from engine.cache.rank_agreement import RankAgreement
from engine.config import HybridConfig
from engine.events import CacheLookup, Form, Outcome, Reason
from engine.faults import Faults
from engine.parallel import engine_ranks
from engine.parallel.group import RankFailed, TensorParallelGroup, free_port
from engine.parallel.sharding import Shard, keep_cols, keep_rows
from engine.telemetry import ListSink
from tests.helpers import TOLERANCE, tokens
from tests.parallel import tp_helpers

CACHE = CacheConfig(unit_tokens=16, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=48)


@pytest.mark.parametrize("form", list(Form))
def test_a_shard_lost_on_rank_1_makes_every_rank_fall_back(form: Form) -> None:
    sink = ListSink()
    faults = Faults(lose_shard=form, on_rank=1)
    tp = LLM("kvscope_hybrid-tiny", device="cpu", cache=CACHE, tensor_parallel_size=2, check_invariants=True, telemetry=sink, faults=faults)
    ref = LLM("kvscope_hybrid-tiny", device="cpu", cache=CACHE)
    try:
        base = tokens(100, 1)
        tp.score(base)
        ids = base + tokens(20, 2)
        warm = tp.score(ids)
        healthy = ref.score(base) and ref.score(ids)
        cold = ref.prefill_logits(ids)
        assert healthy.resume_tokens == 96 and warm.resume_tokens < healthy.resume_tokens
        diff = (warm.logits - cold[warm.resume_tokens :]).abs().max().item()
        assert diff <= TOLERANCE[torch.float32], f"{form}: warm != cold by {diff:.3g}"
        verdict = warm.cache.form(form)
        assert (verdict.outcome, verdict.reason, verdict.tp_rank) == (Outcome.INVALIDATED, Reason.TP_DISAGREE, 1)
        events = [e for e in sink.events if isinstance(e, CacheLookup) and e.form == form]
        assert (events[-1].reason, events[-1].tp_rank) == (Reason.TP_DISAGREE, 1)
        assert all(tp.on_every_rank(tp_helpers.check_invariants))
        assert tp.cache.agreement is not None and tp.cache.agreement.disagreements[(form, 1)] == 1
    finally:
        tp.close()
        ref.close()


def test_a_lease_gone_stale_on_rank_1_makes_every_rank_plan_again() -> None:
    """Rank 1 loses a page between the agreed lookup and its lease (TOCTOU): the ranks exchange
    it, every rank releases and plans again with the form vetoed (``epoch_changed``)."""
    faults = Faults(evict_between_check_and_use=True, on_rank=1)
    tp = LLM("kvscope_hybrid-tiny", device="cpu", cache=CACHE, tensor_parallel_size=2, check_invariants=True, faults=faults)
    ref = LLM("kvscope_hybrid-tiny", device="cpu", cache=CACHE)
    try:
        base = tokens(100, 7)
        tp.score(base)
        ids = base + tokens(20, 8)
        warm = tp.score(ids)
        assert warm.resume_tokens == 0 and warm.cache.form(Form.FULL_KV).reason == Reason.EPOCH_CHANGED
        assert (warm.logits - ref.prefill_logits(ids)).abs().max().item() <= TOLERANCE[torch.float32]
        assert all(tp.on_every_rank(tp_helpers.check_invariants))
    finally:
        tp.close()
        ref.close()


def test_heads_that_do_not_divide_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="linear_num_key_heads = 2 does not divide by tensor_parallel_size = 3"):
        LLM(HybridConfig(), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_attention_heads = 4 does not divide by tensor_parallel_size = 8"):
        LLM("deepseek_v4-tiny", device="cpu", tensor_parallel_size=8)
    with pytest.raises(ValueError, match="num_key_value_heads = 2 and tensor_parallel_size = 3: one must divide the other"):
        LLM(HybridConfig(num_attention_heads=6, linear_num_key_heads=3, linear_num_value_heads=6, o_groups=3, intermediate_size=192), device="cpu", tensor_parallel_size=3)


class _Group:
    """Stands in for a group whose ranks report ``prints`` as their geometry fingerprints."""

    rank, size = 0, 3

    def __init__(self, prints: list[int]) -> None:
        self.prints = prints

    def startup_gather(self, values: list[int]) -> list[list[int]]:
        return [[p] for p in self.prints]


def test_ranks_with_another_cache_geometry_are_refused() -> None:
    llm = LLM("kvscope_hybrid-tiny", device="cpu", cache=CACHE)
    mine = engine_ranks.geometry_fingerprint(llm.cache)
    other = LLM("kvscope_hybrid-tiny", device="cpu", cache=CacheConfig(unit_tokens=16, full_kv_blocks=CACHE.full_kv_blocks + 1))
    assert engine_ranks.geometry_fingerprint(other.cache) != mine
    engine_ranks.check_geometry(_Group([mine, mine, mine]), llm.cache)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tensor-parallel ranks \[2\] hold another cache geometry than rank 0"):
        engine_ranks.check_geometry(_Group([mine, mine, mine ^ 1]), llm.cache)  # type: ignore[arg-type]


def test_a_dead_rank_fails_the_next_call_and_names_it() -> None:
    tp = LLM("kvscope_hybrid-tiny", device="cpu", cache=CACHE, tensor_parallel_size=2, tp_timeout_seconds=5.0)
    try:
        assert tp.ranks is not None and tp.ranks.workers is not None
        ((_, proc, _),) = tp.ranks.workers.processes
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        with pytest.raises(RankFailed) as failed:
            tp.score(tokens(40, 3))
        assert failed.value.rank == 1 and "tensor-parallel rank 1" in str(failed.value)
        with pytest.raises(RankFailed, match="lost a tensor-parallel rank earlier"):  # no half-broken engine serves on
            tp.score(tokens(40, 3))
    finally:
        tp.close()


def test_agreement_takes_the_minimum_and_names_the_lowest_rank() -> None:
    class Ranks:
        rank, size = 0, 3

        def all_gather_ints(self, values: list[int]) -> list[list[int]]:
            return [list(values), [v - 16 if v >= 32 else v for v in values], [max(v - 32, 0) for v in values]]

        def broadcast_ints(self, values: list[int], root: int = 0) -> list[int]:
            return list(values)

    class Own:
        form, downward_closed = Form.FULL_KV, True

        def resume_at_most(self, hashes: list[object], limit: int) -> int:
            return limit

        def loss_reason(self, hashes: list[object], point: int) -> Reason:
            return Reason.KV_EVICTED

    agreement = RankAgreement(Ranks())
    hashes: list[object] = []
    (agreed,) = agreement.forms([Own()], hashes)  # type: ignore[list-item]
    assert agreed.resume_at_most(hashes, 64) == 32  # rank 2 serves 32 of 64
    assert agreement.vetoers == {Form.FULL_KV: 2}
    assert agreed.loss_reason(hashes, 48) == Reason.TP_DISAGREE  # this rank's own state serves 48


def test_a_worker_that_dies_before_joining_fails_the_start_at_once() -> None:
    """Rank 0 waits for the workers to join while watching their processes: a dead one fails
    the start at once (here after three polls) instead of after the 600 s startup timeout."""
    polls = []

    def peers_alive() -> None:
        polls.append(1)
        if len(polls) == 3:
            raise RankFailed("tensor-parallel rank 1 exited before it joined the group", 1)

    with pytest.raises(RankFailed, match="rank 1 exited before it joined"):
        TensorParallelGroup(0, 2, free_port(), peers_alive=peers_alive)
    assert len(polls) == 3


def test_row_parallel_shards_sum_to_the_whole_layer_and_add_the_bias_once() -> None:
    """keep_rows / keep_cols on a layer with biases: the column-parallel halves are the rows of
    the output, the row-parallel partial outputs sum to the whole (the bias counted once)."""
    torch.manual_seed(0)
    up, down = torch.nn.Linear(8, 6), torch.nn.Linear(6, 4)
    x = torch.randn(3, 8)
    whole = down(up(x))
    partial = []
    for rank in range(2):
        u, d = torch.nn.Linear(8, 6), torch.nn.Linear(6, 4)
        u.load_state_dict(up.state_dict())
        d.load_state_dict(down.state_dict())
        part = torch.arange(rank * 3, rank * 3 + 3)
        keep_rows(u, part)
        keep_cols(d, part, Shard(rank, 2))
        assert u.weight.shape == (3, 8) and d.weight.shape == (4, 3)
        assert (u(x) - up(x)[:, part]).abs().max().item() < 1e-6
        partial.append(d(u(x)))
    assert (partial[0] + partial[1] - whole).abs().max().item() < 1e-6
    assert (partial[1] - (whole - partial[0])).abs().max().item() < 1e-6
