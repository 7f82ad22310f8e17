"""The memory estimate logged before a model is loaded: it equals what the weights and the
cache's pools then take, and a model that cannot fit is refused before anything is allocated,
naming the settings to change (issue 21, item 5)."""

from __future__ import annotations

import logging

import pytest
import torch

import engine.memory_estimate as memory_estimate
from engine import LLM, CacheConfig
from engine.memory_estimate import estimate


@pytest.mark.parametrize("model", ["kvscope_hybrid-tiny", "qwen3_next-tiny", "deepseek_v4-tiny", "deepseek_v4_moe-tiny", "qwen3_5_moe-tiny"])
@pytest.mark.parametrize("cache", [CacheConfig(), CacheConfig(memory_bytes=3 << 20)], ids=["block-counts", "memory-plan"])
def test_the_estimate_is_what_the_weights_and_pools_then_take(model: str, cache: CacheConfig) -> None:
    llm = LLM(model, device="cpu", cache=cache, dtype="bfloat16")
    weights = sum(t.numel() * t.element_size() for t in (*llm.model.parameters(), *llm.model.buffers()))
    est = estimate(llm.layout, weights, llm.cache_config, llm.dtype, torch.device("cpu"))
    pools: dict[str, int] = {}
    for form in llm.cache.forms:
        pools[form.form] = pools.get(form.form, 0) + sum(t.tensor.nbytes for t in form.stored_tensors())
    assert est.cache_bytes == pools
    assert est.weights_bytes == weights and est.fits


def test_it_is_logged_before_loading(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.memory_estimate"):
        LLM("qwen3_next-tiny", device="cpu")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory estimate on cpu: weights")]
    assert len(lines) == 1 and "full_kv" in lines[0] and "linear_state" in lines[0] and "free:" in lines[0]


def test_a_model_that_cannot_fit_is_refused_before_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.model import qwen3_next

    monkeypatch.setattr(memory_estimate, "available_bytes", lambda device: 1 << 20)
    built: list[object] = []
    monkeypatch.setattr(qwen3_next.Qwen3NextForCausalLM, "init_random", lambda self, seed: built.append(self))
    with pytest.raises(ValueError, match=r"does not fit\. Lower the prefix cache .*--cache-memory-mib.*--dtype bfloat16"):
        LLM("qwen3_next-tiny", device="cpu")
    assert not built


def test_tail_replay_only_counts_the_two_linear_slots_it_allocates() -> None:
    llm = LLM("qwen3_next-tiny", device="cpu", cache=CacheConfig(tail_replay="only"))
    weights = sum(t.numel() * t.element_size() for t in llm.model.parameters())
    est = estimate(llm.layout, weights, llm.cache_config, llm.dtype, torch.device("cpu"))
    assert llm.cache.linear is not None
    assert est.cache_bytes["linear_state"] == sum(t.tensor.nbytes for t in llm.cache.linear.stored_tensors()) > 0
