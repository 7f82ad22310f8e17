"""Tensor parallelism on CUDA (NCCL, rank r on GPU r): TP=2 logits equal TP=1 and warm equals
cold; the batched runtime with CUDA graphs captured on every rank gives TP=1's tokens. Needs two
CUDA GPUs; skips elsewhere, saying so."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, CacheConfig, SamplingParams
from engine.runtime import Runtime, SchedulerConfig
from tests.helpers import TOLERANCE, tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL tensor parallelism); the CPU (gloo) tests stand in"),
]

CACHE = CacheConfig(unit_tokens=16, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=48)


@pytest.mark.parametrize("model", ["kvscope_hybrid-tiny", "qwen3_next-tiny"])
def test_nccl_tp2_equals_tp1(model: str) -> None:
    ref = LLM(model, device="cuda", cache=CACHE, kernel_backend="torch")
    tp = LLM(model, device="cuda", cache=CACHE, kernel_backend="torch", tensor_parallel_size=2, check_invariants=True)
    try:
        ids = tokens(90, 1)
        assert (tp.prefill_logits(ids) - ref.prefill_logits(ids)).abs().max().item() <= TOLERANCE[torch.float32]
        tp.score(ids)
        follow = ids + tokens(11, 2)
        out = tp.score(follow)
        assert out.resume_tokens > 0
        assert (out.logits - ref.prefill_logits(follow)[out.resume_tokens :]).abs().max().item() <= TOLERANCE[torch.float32]
        prompts = [tokens(30 + 7 * i, 10 + i) for i in range(4)]
        params = SamplingParams(max_tokens=6)
        scheduler = SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=4)
        want = Runtime(ref, scheduler, cuda_graphs=False).generate(prompts, params)
        got = Runtime(tp, scheduler, cuda_graphs=True).generate(prompts, params)
        assert [g.output_token_ids for g in got] == [w.output_token_ids for w in want]
    finally:
        tp.close()
        ref.close()
