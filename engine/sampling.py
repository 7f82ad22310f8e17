"""Sampling parameters and the token sampler (greedy, temperature, nucleus / top-p)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to pick output tokens, as in vLLM's ``SamplingParams``.

    Attributes:
        max_tokens: tokens to generate (≥ 0; 0 runs the prefill only).
        temperature: 0 is greedy; otherwise logits are divided by it before the softmax.
        top_p: keep the smallest set of tokens whose probability mass reaches ``top_p``
            (Holtzman et al. 2020).
        seed: seeds a per-request generator so sampling is reproducible.
        stop_token_ids: generation stops after emitting one of these.

    Raises:
        ValueError: a value out of range, naming it.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens = {self.max_tokens!r} must be a non-negative integer")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature = {self.temperature!r} must be finite and >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p = {self.top_p!r} must be in (0, 1]")


class Sampler:
    """Picks one token from a logits row ``[vocab]``."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: Tensor) -> int:
        p = self.params
        if p.temperature == 0.0:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits.float().cpu() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < p.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator).item())
