"""The serving runtime: concurrent requests through continuous batching give what one request at
a time gives (tokens, and logits equal to cold recomputes), with the cache's invariants clean
after every step; token budget, decode-first, chunk ends at checkpoints and fair admission in the
scheduler; preemption by recompute when pools run out; aborts free everything."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from engine.cache import CacheConfig
from engine.cache.admission import CostModel
from engine.events import Admission, RequestEvent, Tier
from engine.llm import LLM
from engine.runtime import FinishReason, Runtime, RuntimeRequest, Scheduler, SchedulerConfig
from engine.sampling import SamplingParams
from engine.telemetry import ListSink
from tests.helpers import TOLERANCE, assert_no_leases, tokens

FAMILIES = ["kvscope_hybrid-tiny", "qwen3_next-tiny", "deepseek_v4-tiny"]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0)


def shared_prefix_prompts(n: int) -> list[list[int]]:
    """Prompts of 50–110 tokens sharing prefixes of 40 + 8 i tokens (so the cache has hits to
    give and requests in flight together miss what the others are computing)."""
    base = tokens(120, 1)
    return [base[: 40 + 8 * i] + tokens(10 + 3 * i, 100 + i) for i in range(n)]


@pytest.mark.parametrize("model", FAMILIES)
def test_concurrent_requests_match_one_at_a_time(model: str) -> None:
    prompts = shared_prefix_prompts(6)
    want = [o.output_token_ids for o in LLM(model, device="cpu").generate(prompts, GREEDY)]
    llm = LLM(model, device="cpu", check_invariants=True)
    runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4))
    requests = [runtime.add_request(p, GREEDY, keep_logits=True) for p in prompts]
    max_batch = 0
    while runtime.has_unfinished():
        runtime.step()
        assert runtime.last_step_tokens <= 64
        max_batch = max(max_batch, len(runtime.running))
    assert max_batch == 4  # really concurrent
    assert [r.output_token_ids for r in requests] == want
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)
    assert_no_leases(llm)
    # every sampled row equals the cold full recompute of the tokens before it
    for r in requests[::2]:
        for i, row in enumerate(r.sampled_logits):
            cold = llm.prefill_logits(r.prompt_token_ids + r.output_token_ids[:i])[-1]
            assert (row - cold).abs().max().item() <= TOLERANCE[torch.float32]


def test_a_later_request_reuses_what_an_earlier_one_published() -> None:
    llm = LLM("kvscope_hybrid-tiny", device="cpu", check_invariants=True)
    runtime = Runtime(llm)
    prompt = tokens(100, 3)
    first = runtime.generate([prompt], GREEDY)[0]
    second = runtime.generate([prompt + tokens(20, 4)], GREEDY)[0]
    assert first.cache.resume_tokens == 0 and second.cache.resume_tokens > 64


def test_pools_running_out_preempt_by_recompute_and_outputs_stay_right() -> None:
    prompts = [tokens(120, 10 + i) for i in range(6)]
    params = SamplingParams(max_tokens=64, temperature=0.0)  # admitted on their prompts, they outgrow the pool decoding
    small = CacheConfig(full_kv_blocks=24, swa_blocks=64)
    want = [o.output_token_ids for o in LLM("qwen3_next-tiny", device="cpu", cache=small).generate(prompts, params)]
    llm = LLM("qwen3_next-tiny", device="cpu", cache=small, check_invariants=True)
    runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=6))
    got = [o.output_token_ids for o in runtime.generate(prompts, params)]
    assert runtime.num_preemptions > 0
    assert got == want
    assert_no_leases(llm)


def test_an_abort_frees_the_request_and_the_others_go_on() -> None:
    sink = ListSink()
    llm = LLM("kvscope_hybrid-tiny", device="cpu", telemetry=sink, check_invariants=True)
    runtime = Runtime(llm)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    keep = runtime.add_request(tokens(60, 20), params, request_id="keep")
    gone = runtime.add_request(tokens(60, 21), params, request_id="gone")
    while len(gone.output_token_ids) < 3:
        runtime.step()
    assert runtime.abort("gone") and not runtime.abort("gone")
    assert gone.finish_reason is FinishReason.ABORT and gone.seq is None and gone not in runtime.running
    runtime.run()
    assert keep.output_token_ids == LLM("kvscope_hybrid-tiny", device="cpu").generate([tokens(60, 20)], params)[0].output_token_ids
    assert_no_leases(llm)
    ended = {e.request_id: e.output_tokens for e in sink.events if isinstance(e, RequestEvent)}
    assert ended == {"keep": 8, "gone": 3}
    # a request still waiting is aborted before it holds anything
    waiting = runtime.add_request(tokens(30, 22), params)
    assert runtime.abort(waiting.request_id) and not runtime.has_unfinished()


def test_stop_tokens_zero_max_tokens_and_bad_requests() -> None:
    llm = LLM("kvscope_hybrid-tiny", device="cpu")
    runtime = Runtime(llm)
    prompt = tokens(40, 30)
    first = runtime.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0].output_token_ids
    stopped = runtime.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(first[2],)))
    prefill_only = runtime.add_request(prompt, SamplingParams(max_tokens=0))
    runtime.run()
    assert stopped.output_token_ids == first[: first.index(first[2]) + 1]
    assert stopped.finish_reason is FinishReason.STOP
    assert prefill_only.output_token_ids == [] and prefill_only.finish_reason is FinishReason.LENGTH
    runtime.add_request(prompt, request_id="same")
    with pytest.raises(ValueError, match="already in use"):
        runtime.add_request(prompt, request_id="same")
    with pytest.raises(ValueError, match="empty prompt"):
        runtime.add_request([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runtime.add_request([1, 10_000])
    with pytest.raises(ValueError, match="full_kv"):
        runtime.add_request(tokens(40, 1), SamplingParams(max_tokens=10_000_000))
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


# -- the scheduler alone, on stand-in requests ------------------------------------------------------
@dataclass(eq=False)
class Fake:
    serial: int
    session: str
    num_computed_tokens: int
    num_tokens: int
    checkpoints: tuple[int, ...] = ()
    max_chunk: int = 512
    seen_budgets: list[int] = field(default_factory=list)

    def next_chunk_end(self, budget: int) -> int:
        self.seen_budgets.append(budget)
        start = self.num_computed_tokens
        ends = [self.num_tokens, start + budget, start + self.max_chunk]
        return min(ends + [p for p in self.checkpoints if start < p < min(ends)])


def test_decodes_go_first_then_prefill_chunks_within_the_budget() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=8))
    prefill = Fake(serial=0, session="a", num_computed_tokens=0, num_tokens=100)
    decodes = [Fake(serial=i, session="b", num_computed_tokens=50, num_tokens=51) for i in range(1, 5)]
    plan = scheduler.schedule([prefill, *decodes])
    assert plan.decodes == decodes  # every decode first, although the prefill arrived earlier
    assert plan.prefills == [(prefill, 6)] and plan.budget_left == 0
    # a budget smaller than the decodes: the oldest decode first, no prefill
    tight = Scheduler(SchedulerConfig(max_num_batched_tokens=3, max_num_seqs=8)).schedule([prefill, *decodes])
    assert tight.decodes == decodes[:3] and tight.prefills == []


def test_prefill_chunks_end_at_checkpoint_positions() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=300, max_num_seqs=8))
    r = Fake(serial=0, session="a", num_computed_tokens=16, num_tokens=400, checkpoints=(128, 256, 384))
    assert scheduler.schedule([r]).prefills == [(r, 128)]
    r.num_computed_tokens = 128
    assert scheduler.schedule([r]).prefills == [(r, 256)]
    r.num_computed_tokens, r.max_chunk = 256, 64
    assert scheduler.schedule([r]).prefills == [(r, 320)]  # the chunk limit before the checkpoint


def test_admission_is_fair_across_sessions() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=3))
    running = [Fake(serial=0, session="chatty", num_computed_tokens=5, num_tokens=6)]
    waiting = [Fake(serial=i, session="chatty", num_computed_tokens=0, num_tokens=20) for i in range(1, 6)]
    quiet = Fake(serial=9, session="quiet", num_computed_tokens=0, num_tokens=20)
    assert scheduler.next_admission(running, [*waiting, quiet]) is quiet  # arrived last, admitted first
    assert scheduler.next_admission([*running, quiet], waiting) is waiting[0]
    assert scheduler.next_admission([*running, quiet, waiting[0]], waiting[1:]) is None  # max_num_seqs


def test_a_runtime_over_the_whole_trace_of_sessions_keeps_its_budget() -> None:
    """Twelve requests from four sessions with a budget of 40 tokens: no step computes more,
    and every request finishes with its own tokens."""
    llm = LLM("qwen3_next-tiny", device="cpu", cache=dataclasses.replace(CacheConfig(), checkpoint_interval_tokens=32))
    runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=5))
    prompts = [tokens(30 + 7 * i, 40 + i) for i in range(12)]
    added = [runtime.add_request(p, GREEDY, session=f"s{i % 4}") for i, p in enumerate(prompts)]
    while runtime.has_unfinished():
        runtime.step()
        assert 0 < runtime.last_step_tokens <= 40
    want = LLM("qwen3_next-tiny", device="cpu", cache=dataclasses.replace(CacheConfig(), checkpoint_interval_tokens=32)).generate(prompts, GREEDY)
    assert [r.output_token_ids for r in added] == [o.output_token_ids for o in want]
    assert_no_leases(llm)


@pytest.mark.parametrize(("tier_bandwidth", "expected"), [(1e12, Admission.SWAP_IN), (1.0, None)])
def test_a_preempted_request_comes_back_by_the_admission_s_cheaper_recovery(tier_bandwidth: float, expected: Admission | None) -> None:
    """With a host tier, the pages a preempted request published are copied down as they are
    evicted; when it is admitted again, the admission prices swapping them in against
    recomputing: with a fast tier it swaps in, with a 1 B/s one it never does. Its tokens are
    the same either way."""
    prompts = [tokens(100, 10 + i) for i in range(6)]
    params = SamplingParams(max_tokens=80, temperature=0.0)  # admitted on their prompts, they outgrow the pool decoding
    pools = CacheConfig(full_kv_blocks=30, swa_blocks=96)
    want = [o.output_token_ids for o in LLM("qwen3_next-tiny", device="cpu", cache=pools).generate(prompts, params)]
    costs = CostModel(seconds_per_token=1e-3, tier_bytes_per_second={Tier.HOST: tier_bandwidth})
    llm = LLM("qwen3_next-tiny", device="cpu", cache=dataclasses.replace(pools, host_tier_bytes=64 << 20), cost_model=costs, check_invariants=True)
    runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=6))
    readmitted: list[Admission] = []
    start = runtime._start

    def recording(r: RuntimeRequest) -> None:
        start(r)
        if r.num_preemptions:
            assert r.admitted is not None
            readmitted.append(r.admitted.admission)

    runtime._start = recording  # type: ignore[method-assign]
    added = [runtime.add_request(p, params) for p in prompts]
    runtime.run()
    assert runtime.num_preemptions > 0 and readmitted
    assert (expected in readmitted) if expected is not None else Admission.SWAP_IN not in readmitted
    assert [r.output_token_ids for r in added] == want
    assert_no_leases(llm)


def test_admission_waits_for_memory_instead_of_thrashing() -> None:
    """Six 200-token requests into a pool that holds about three: the runtime admits what fits
    and lets the rest wait, instead of admitting all and preempting over and over."""
    prompts = [tokens(200, 30 + i) for i in range(6)]
    llm = LLM("qwen3_next-tiny", device="cpu", cache=CacheConfig(full_kv_blocks=40, swa_blocks=96), check_invariants=True)
    runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=6))
    most = 0
    for p in prompts:
        runtime.add_request(p, SamplingParams(max_tokens=12, temperature=0.0))
    while runtime.has_unfinished():
        runtime.step()
        most = max(most, len(runtime.running))
    assert 1 < most < 6
    assert runtime.num_preemptions <= 2
    assert_no_leases(llm)
