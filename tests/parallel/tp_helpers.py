"""Functions the tensor-parallel tests run on every rank (``LLM.on_every_rank`` pickles them, so
they live at module level) and the engines they compare."""

from __future__ import annotations

from collections import Counter

import torch

from engine.llm import LLM

PROMPT = [(7 * i + 3) % 251 for i in range(70)]
"""A 70-token prompt (U = 16: four whole units and a part)."""


def decode_logits(llm: LLM, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Prefill ``prompt`` through the cache, then decode ``tokens`` one at a time (the engine's
    own decode path); the logits of the prompt's last position and of every decode step."""
    lifecycle = llm.lifecycle
    lease = lifecycle.start(list(prompt), len(tokens))
    try:
        rows = [lifecycle.prefill(lease, keep_logits=False)[-1]]
        lifecycle.prefill_done(lease)
        rows += [lifecycle.decode_step(lease.seq, t) for t in tokens]
    finally:
        lifecycle.release(lease)
    return rows


def collectives_of_prefill(llm: LLM, prompt: list[int]) -> dict[str, int]:
    """The collectives one ``prefill_logits`` of ``prompt`` runs on this rank, by kind."""
    assert llm.ranks is not None
    before = Counter(llm.ranks.group.counts)
    llm.prefill_logits(prompt)
    return dict(Counter(llm.ranks.group.counts) - before)


def parameter_shapes(llm: LLM) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every parameter's shape and bytes on this rank."""
    return {n: (tuple(p.shape), p.numel() * p.element_size()) for n, p in llm.model.named_parameters()}


def pool_bytes(llm: LLM) -> dict[str, int]:
    """Every cache pool's bytes on this rank (its memory plan)."""
    return {p.name: p.bytes for p in llm.cache.pool_plans()}


def check_invariants(llm: LLM) -> bool:
    """:meth:`PrefixCache.check_invariants` on this rank (raises when broken)."""
    llm.cache.check_invariants()
    return True


def kv_heads(llm: LLM) -> int:
    return llm.layout.num_kv_heads
