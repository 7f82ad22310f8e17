"""What the engine returns for a request."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from engine.cache.coordinator import FormLookup
from engine.events import Admission, Form, Reason


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheReport:
    """How the prefix cache served one request.

    ``resume_tokens`` is L*; every prompt token is either recoverable (< L*) or recomputed.
    ``forms`` holds each form's outcome, usable tokens and reason.
    """

    prompt_tokens: int
    hash_hit_tokens: int
    resume_tokens: int
    limiting_form: Form | None
    limiting_reason: Reason
    admission: Admission
    approximate: bool
    forms: tuple[FormLookup, ...]

    @property
    def recoverable_tokens(self) -> int:
        return self.resume_tokens

    @property
    def recomputed_tokens(self) -> int:
        return self.prompt_tokens - self.resume_tokens

    def form(self, form: Form) -> FormLookup:
        for f in self.forms:
            if f.form == form:
                return f
        raise KeyError(form)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOutput:
    """One finished ``generate`` request (like vLLM's ``RequestOutput``)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    cache: CacheReport
    ttft_seconds: float
    e2e_seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoreOutput:
    """``LLM.score``: logits ``[T − L*, vocab]`` (float32) for positions L* … T−1, computed on
    top of the reused state. Warm equals cold: ``logits ≈ prefill_logits(ids)[L*:]``."""

    request_id: str
    logits: Tensor
    cache: CacheReport

    @property
    def resume_tokens(self) -> int:
        return self.cache.resume_tokens

    @property
    def approximate(self) -> bool:
        return self.cache.approximate

    @property
    def forms(self) -> tuple[FormLookup, ...]:
        return self.cache.forms
