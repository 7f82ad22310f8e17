"""Issue 26, item 0: recurrent checkpoints taken inside a prefill chunk. A model whose only
checkpointed state is recurrent (Qwen3-Next, Qwen3.5) prefills in chunks of
``max_prefill_chunk_tokens`` whatever the checkpoint interval; the linear layers hand over their
state at each checkpoint position inside the chunk; a later request resumes there exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.cache.config import CacheConfig
from engine.llm import LLM
from engine.model.gated_deltanet import GatedDeltaNetBase
from engine.sampling import SamplingParams
from kernels.gated_delta_rule_torch import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_states,
    l2norm,
)


def cache(interval: int) -> CacheConfig:
    return CacheConfig(
        unit_tokens=16, full_kv_blocks=160, swa_blocks=160, linear_checkpoints=32,
        checkpoint_interval_tokens=interval, max_prefill_chunk_tokens=256,
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


@pytest.mark.parametrize(("model", "interval"), [("qwen3_next-tiny", 64), ("qwen3_5-tiny", 64), ("qwen3_next-tiny", 16)])
def test_a_prefill_is_not_cut_at_checkpoints_and_resumes_exactly_at_one_inside_a_chunk(model: str, interval: int) -> None:
    """Interval 64: the checkpoints are chunk ends of the chunked delta rule (one pass); 16: the
    recurrence stops at each of them (spans)."""
    llm = LLM(model, device="cpu", cache=cache(interval))
    try:
        prompt = [(5 * i) % 251 + 1 for i in range(400)]
        lengths = forwards(llm)
        llm.generate(prompt, SamplingParams(max_tokens=0))
        assert lengths == [256, 144]  # not [64, 64, ...]: the checkpoints up to 384 taken inside
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


def test_the_states_on_the_way_are_those_of_stopping_there() -> None:
    torch.manual_seed(0)
    t, h, d = 200, 2, 8
    q, k = l2norm(torch.randn(t, h, d)), l2norm(torch.randn(t, h, d))
    v, g, beta, s0 = torch.randn(t, h, d), -torch.rand(t, h), torch.rand(t, h), torch.randn(h, d, d)
    o, final, states = chunk_gated_delta_rule_states(q, k, v, g, beta, s0, (64, 128))
    state, pieces = s0, []
    for lo, hi in ((0, 64), (64, 128), (128, t)):
        piece, state = chunk_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
        pieces.append((piece, state))
    torch.testing.assert_close(o, torch.cat([p for p, _ in pieces]), atol=1e-5, rtol=1e-5)
    for got, (_, want) in zip([*states, final], pieces, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiples of 64"):
        chunk_gated_delta_rule_states(q, k, v, g, beta, s0, (100,))


def test_a_pass_that_ends_at_a_checkpoint_off_the_64_grid_resumes_there_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 424-token prompt: its second chunk [256, 424) holds checkpoints at 320 and 384 (one pass,
    from its chunk ends) and at 416, the last unit boundary before the end, 160 past the pass's
    start: the recurrence stops there. A follow-up resumes at 416 and equals a cold prefill."""
    passes: list[tuple[int, tuple[int, ...]]] = []
    real = GatedDeltaNetBase._one_pass

    def counted(self: GatedDeltaNetBase, qkv: torch.Tensor, *args: Any) -> torch.Tensor:
        passes.append((int(qkv.shape[0]), tuple(args[-1])))
        return real(self, qkv, *args)

    monkeypatch.setattr(GatedDeltaNetBase, "_one_pass", counted)
    llm = LLM("qwen3_next-tiny", device="cpu", cache=cache(64))
    try:
        prompt = [(7 * i) % 251 + 1 for i in range(424)]
        llm.generate(prompt, SamplingParams(max_tokens=0))
        assert set(passes) == {(256, (64, 128, 192)), (160, (64, 128))}  # offsets in the chunk: chunk 1, then chunk 2 up to 416
        follow = prompt[:420] + [4, 5, 6] * 8
        warm = llm.score(follow)
        assert warm.resume_tokens == 416
        torch.testing.assert_close(warm.logits, llm.prefill_logits(follow)[416:], atol=2e-5, rtol=1e-4)
    finally:
        llm.close()
