"""The batched runtime at TP=2: every rank steps in lockstep on its mirror of rank 0's runtime
(static decode slots per rank where the family has them), and the outputs and sampled logits
equal the TP=1 runtime's; a second wave resumes from the prefix cache on both ranks.

The reference is the TP=1 runtime on the same requests, not a cold prefill: with
``deepseek_v4_moe-tiny``'s 4 index heads, the CSA indexer of layer 1 scores the 4th and 5th
entries for position 61 of these prompts at 0.0 and −2.6e-5 (ReLU zeros tie), so a decode step
and a prefill of that position may pick different entries. The logits then differ by up to 7e-3,
at TP=1 as at TP=2 (measured)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, CacheConfig, SamplingParams
from engine.runtime import Runtime, SchedulerConfig
from engine.runtime.runtime_ranks import agree_on_schedule
from tests.helpers import TOLERANCE, tokens
from tests.parallel import tp_helpers

CACHE = CacheConfig(unit_tokens=16, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=48)
SCHEDULER = SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=4)


@pytest.mark.parametrize(("model", "static"), [("kvscope_hybrid-tiny", True), ("deepseek_v4_moe-tiny", False)])
def test_runtime_at_tp2_equals_tp1(model: str, static: bool) -> None:
    ref = LLM(model, device="cpu", cache=CACHE)
    tp = LLM(model, device="cpu", cache=CACHE, tensor_parallel_size=2, check_invariants=True)
    try:
        shared = tokens(50, 1)
        waves = [[shared + tokens(5 + i, 10 + i) for i in range(3)], [shared + tokens(9 + i, 20 + i) for i in range(3)]]
        params = SamplingParams(max_tokens=5)
        want_rt, got_rt = Runtime(ref, SCHEDULER), Runtime(tp, SCHEDULER)
        assert (got_rt.decode_runner is not None) == static
        for wave in waves:
            want = [want_rt.add_request(p, params, keep_logits=True) for p in wave]
            added = [got_rt.add_request(p, params, keep_logits=True) for p in wave]
            want_rt.run()
            got_rt.run()
            assert [r.output_token_ids for r in added] == [w.output_token_ids for w in want]
            for r, w in zip(added, want, strict=True):
                got_rt.pop_finished(r.request_id)
                want_rt.pop_finished(w.request_id)
                assert len(r.sampled_logits) == len(w.sampled_logits) == 5
                for row, ref_row in zip(r.sampled_logits, w.sampled_logits, strict=True):
                    assert (row - ref_row).abs().max().item() <= TOLERANCE[torch.float32]
        assert all(r.report is not None and r.report.resume_tokens >= 48 for r in added)  # the second wave resumed
        assert got_rt.num_steps > 1 and all(tp.on_every_rank(tp_helpers.check_invariants))
    finally:
        tp.close()
        ref.close()


def test_ranks_that_schedule_differently_raise() -> None:
    class Ranks:
        rank, size = 0, 2

        def all_gather_ints(self, values: list[int]) -> list[list[int]]:
            return [list(values), [values[0] ^ 1]]

    agree_on_schedule(type("Same", (), {"rank": 0, "all_gather_ints": lambda self, v: [list(v), list(v)]})(), [(0, 0, 16)], 0)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="tensor-parallel ranks scheduled different steps"):
        agree_on_schedule(Ranks(), [(0, 0, 16)], 0)  # type: ignore[arg-type]
