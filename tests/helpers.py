"""Helpers shared by the test suites: the tolerance table, token streams, warm-equals-cold."""

from __future__ import annotations

import socket

import torch

from engine import LLM
from engine.config import HybridConfig
from engine.events import EngineStats, Form, Tier
from engine.outputs import ScoreOutput

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2}
"""Max abs difference allowed between a cached path and its reference, per dtype."""
BACKEND_PARITY = 1e-5
"""Max abs fp32 logit difference between the engine on its torch and on its Triton backend (the
same math summed in another order; measured about 4e-7 under the interpreter). Tighter than
``TOLERANCE`` so that a 0.05 % error in one kernel fails."""


def tokens(n: int, seed: int, vocab_size: int = 256) -> list[int]:
    """``n`` reproducible random token ids."""
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_warm_equals_cold(llm: LLM, ids: list[int]) -> ScoreOutput:
    """Score ``ids`` through the cache and check the logits against a full recompute."""
    out = llm.score(ids)
    cold = llm.prefill_logits(ids)
    unit = llm.cache_config.unit_tokens
    assert out.resume_tokens % unit == 0 and out.resume_tokens < len(ids)
    assert out.logits.shape == (len(ids) - out.resume_tokens, llm.layout.vocab_size)
    diff = (out.logits - cold[out.resume_tokens :]).abs().max().item()
    assert diff <= TOLERANCE[torch.float32], f"warm != cold by {diff:.3g} (L* = {out.resume_tokens}, T = {len(ids)})"
    return out


def assert_no_leases(llm: LLM) -> None:
    """Between requests: the pools are consistent and nothing is leased."""
    llm.cache.check_invariants()
    for f in llm.cache.forms:
        for pool in f.pools:
            assert pool.num_leased == 0, f"{pool.name}: {pool.num_leased} blocks still leased"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def qwen3_next_dense() -> object:
    """``qwen3_next-tiny`` with a dense MLP in every layer (``num_experts = 0``): Qwen3-Next's
    attention and Gated DeltaNet layers without the sparse MoE, whose dispatch a CUDA graph
    cannot capture."""
    from engine.model.qwen3_next_config import config_from_dict
    from engine.presets import PRESETS

    return config_from_dict({"model_type": "qwen3_next", **PRESETS["qwen3_next-tiny"].fields, "num_experts": 0})


NO_COMPRESSED = HybridConfig(layer_types=("linear_attention", "sliding_attention", "full_attention", "linear_attention"), sliding_window=24)
"""A kvscope_hybrid with every kind the runner batches: linear, sliding and full layers."""


def numbered_stats(engine_id: str, i: int, *, ts_step: float = 1.0) -> EngineStats:
    """An ``engine_stats`` event whose ``used_bytes`` is its id ``i`` (to check a stream arrived
    whole and once), at ``1.7e9 + i * ts_step`` unix seconds."""
    return EngineStats(
        ts=1_700_000_000.0 + i * ts_step,
        engine_id=engine_id,
        model="m",
        form=Form.FULL_KV,
        tier=Tier.DEVICE,
        used_bytes=i,
        used_blocks=0,
        cached_blocks=0,
        free_blocks=0,
        total_blocks=1,
    )
