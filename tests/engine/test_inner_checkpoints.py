"""Issue 26, item 0: recurrent checkpoints taken inside a prefill chunk. A model whose only
checkpointed state is recurrent (Qwen3-Next, Qwen3.5) prefills in chunks of
``max_prefill_chunk_tokens`` whatever the checkpoint interval; the linear layers hand over their
state at each checkpoint position inside the chunk; a later request resumes there exactly."""

from __future__ import annotations

import pytest
import torch

from engine.cache.config import CacheConfig
from engine.llm import LLM
from engine.sampling import SamplingParams

CACHE = CacheConfig(
    unit_tokens=16, full_kv_blocks=160, swa_blocks=160, linear_checkpoints=24,
    checkpoint_interval_tokens=64, max_prefill_chunk_tokens=256,
)  # fmt: skip


def forwards(llm: LLM) -> list[int]:
    """Chunk lengths of every forward the model runs from now on."""
    lengths: list[int] = []
    real = llm.model.forward

    def counting(input_ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        lengths.append(int(input_ids.shape[0]))
        return real(input_ids, *args, **kwargs)

    llm.model.forward = counting  # type: ignore[method-assign]
    return lengths


@pytest.mark.parametrize("model", ["qwen3_next-tiny", "qwen3_5-tiny"])
def test_a_prefill_is_not_cut_at_checkpoints_and_resumes_exactly_at_one_inside_a_chunk(model: str) -> None:
    llm = LLM(model, device="cpu", cache=CACHE)
    try:
        prompt = [(5 * i) % 251 + 1 for i in range(400)]
        lengths = forwards(llm)
        llm.generate(prompt, SamplingParams(max_tokens=0))
        assert lengths == [256, 144]  # not [64, 64, ...]: checkpoints 64 … 384 taken inside
        follow = prompt[:200] + [9, 8, 7, 6] * 10  # shares 200 tokens: the last checkpoint at or below is 192
        lengths.clear()
        warm = llm.score(follow)
        assert warm.resume_tokens == 192
        assert lengths == [len(follow) - 192]
        cold = llm.prefill_logits(follow)[192:]
        torch.testing.assert_close(warm.logits, cold, atol=2e-5, rtol=1e-4)
    finally:
        llm.close()


@pytest.mark.parametrize("model", ["deepseek_v4-tiny", "kvscope_hybrid-tiny"])
def test_with_compressed_forms_a_prefill_still_ends_chunks_at_checkpoints(model: str) -> None:
    cache = CacheConfig(
        unit_tokens=16, full_kv_blocks=64, swa_blocks=64, compressed_blocks=64, tail_slots=24, linear_checkpoints=24,
        checkpoint_interval_tokens=64, max_prefill_chunk_tokens=256,
    )  # fmt: skip
    llm = LLM(model, device="cpu", cache=cache)
    try:
        assert not llm.cache.form_set.checkpoints_inside_chunks  # compressor rows exist only at a chunk's end
        lengths = forwards(llm)
        llm.generate([(3 * i) % 251 + 1 for i in range(200)], SamplingParams(max_tokens=0))
        assert lengths == [64, 64, 64, 8]
    finally:
        llm.close()
