"""The decode model runner: decode batches padded to fixed sizes over buffers whose addresses
never change, recurrent state in decode slots, padding rows on every form's sentinel (case C10),
and the same tokens and logits as the per-sequence path."""

from __future__ import annotations

import pytest
import torch

from engine.config import HybridConfig
from engine.llm import LLM
from engine.runtime import Runtime, SchedulerConfig
from engine.runtime.model_runner import DecodeRunner, supports_static_decode
from engine.sampling import SamplingParams
from tests.helpers import TOLERANCE, assert_no_leases, tokens

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)
NO_COMPRESSED = HybridConfig(layer_types=("linear_attention", "sliding_attention", "full_attention", "linear_attention"), sliding_window=24)
"""A kvscope_hybrid with every kind the runner batches: linear, sliding and full layers."""


def models() -> list[object]:
    return ["qwen3_next-tiny", NO_COMPRESSED]


@pytest.mark.parametrize("model", models(), ids=["qwen3_next-tiny", "hybrid-linear-sliding-full"])
def test_static_decode_matches_the_per_sequence_path(model: object) -> None:
    prompts = [tokens(40 + 9 * i, 60 + i) for i in range(5)]
    want = [o.output_token_ids for o in LLM(model, device="cpu").generate(prompts, PARAMS)]
    llm = LLM(model, device="cpu", check_invariants=True)
    runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8))
    assert runtime.decode_runner is not None
    added = [runtime.add_request(p, PARAMS, keep_logits=True) for p in prompts]
    runner = runtime.decode_runner
    addresses = [t.data_ptr() for t in runner.buffers()]
    sizes = set()
    while runtime.has_unfinished():
        runtime.step()
        sizes.add(sum(1 for r in runtime.running if r.decode_slot is not None))
        assert [t.data_ptr() for t in runner.buffers()] == addresses  # never reallocated
    assert len(sizes) > 2  # batches of several sizes went through the same buffers
    assert [r.output_token_ids for r in added] == want
    for r in added[::2]:
        for i, row in enumerate(r.sampled_logits):
            cold = llm.prefill_logits(r.prompt_token_ids + r.output_token_ids[:i])[-1]
            assert (row - cold).abs().max().item() <= TOLERANCE[torch.float32]
    assert runner.free_slots == 8  # every slot back
    assert_no_leases(llm)


def test_padding_rows_never_touch_a_live_request_c10() -> None:
    """Case C10: one live request decodes in the first allocatable slot (1) inside a batch padded
    to 4; the three padding rows use the sentinel slot 0 and each form's sentinel page, so the
    live request's state and window are untouched: its tokens and logits equal an unpadded run."""
    prompt = tokens(70, 5)
    want = LLM("qwen3_next-tiny", device="cpu").generate([prompt], PARAMS)[0].output_token_ids
    llm = LLM("qwen3_next-tiny", device="cpu", check_invariants=True)
    runtime = Runtime(llm, SchedulerConfig(max_num_seqs=4), decode_batch_sizes=(4,))
    runner = runtime.decode_runner
    assert runner is not None and runner.sizes == (4,)
    live = runtime.add_request(prompt, PARAMS, keep_logits=True)
    padded_steps = 0
    while runtime.has_unfinished():
        runtime.step()
        if live.decode_slot is not None:
            assert live.decode_slot == 1  # the first slot a request can own
            assert runner.slot_ids[:4].tolist() == [1, 0, 0, 0]
            for i in range(len(runner.forms)):
                assert runner.write_pages[i][1:4].tolist() == [0, 0, 0] and runner.seq_lens[i][1:4].tolist() == [0, 0, 0]
                assert not runner.block_tables[i][1:4].any()
            padded_steps += 1
    assert padded_steps >= 6
    assert live.output_token_ids == want
    for i, row in enumerate(live.sampled_logits):
        cold = llm.prefill_logits(prompt + live.output_token_ids[:i])[-1]
        assert (row - cold).abs().max().item() <= TOLERANCE[torch.float32]


def test_the_sentinel_slot_is_never_handed_out_and_slots_are_checked() -> None:
    llm = LLM("qwen3_next-tiny", device="cpu")
    runner = DecodeRunner(llm, max_num_seqs=3, max_model_len=256)
    seqs = [llm.cache.start(llm.cache.admit(llm.cache.block_hashes(tokens(20, i)), 20, None).plan, tokens(20, i), llm.cache.block_hashes(tokens(20, i))) for i in range(3)]
    slots = [runner.acquire(s) for s in seqs]
    assert sorted(slots) == [1, 2, 3] and runner.free_slots == 0
    with pytest.raises(RuntimeError, match="no free decode slot"):
        runner.acquire(seqs[0])
    with pytest.raises(RuntimeError, match="not a releasable slot"):
        runner.release(0)
    runner.release(slots[0])
    with pytest.raises(RuntimeError, match="released twice"):
        runner.release(slots[0])
    for s in seqs:
        s.finish()


def test_models_without_the_batched_path_fall_back() -> None:
    for model in ("kvscope_hybrid-tiny", "deepseek_v4-tiny"):  # DeepSeek-V4 attention layers
        llm = LLM(model, device="cpu")
        assert not supports_static_decode(llm.model) and Runtime(llm).decode_runner is None
        with pytest.raises(ValueError, match="no batched decode path"):
            DecodeRunner(llm, 4, 256)
    with pytest.raises(ValueError, match="max_model_len"):
        Runtime(LLM("qwen3_next-tiny", device="cpu"), SchedulerConfig(max_model_len=64)).add_request(tokens(60, 1), SamplingParams(max_tokens=10))
