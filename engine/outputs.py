"""What the engine returns for a request."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from engine.cache.coordinator import FormLookup, ResumePlan
from engine.events import Admission, Form, Reason


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheReport:
    """How the prefix cache served one request: the lookup's plan (L*, every form's verdict)
    and the path that ran.

    Token split (DESIGN.md §3): ``prompt_tokens = recoverable_tokens + replayed_tokens +
    recomputed_tokens`` with recoverable = L* − replayed and recomputed = T − L*.
    """

    plan: ResumePlan
    admission: Admission
    approximate: bool = False
    replayed_tokens: int = 0
    predicted_seconds: float = 0.0
    """The admission's prediction for the chosen plan (recovery + prefill; 0 without a cost
    model)."""
    actual_seconds: float = 0.0
    """Measured seconds from admission to the end of the prefill."""

    @property
    def prompt_tokens(self) -> int:
        return self.plan.prompt_tokens

    @property
    def hash_hit_tokens(self) -> int:
        return self.plan.hash_hit_tokens

    @property
    def resume_tokens(self) -> int:
        """L*: the prompt tokens not computed as new."""
        return self.plan.resume_tokens

    @property
    def limiting_form(self) -> Form | None:
        return self.plan.limiting_form

    @property
    def limiting_reason(self) -> Reason:
        return self.plan.limiting_reason

    @property
    def limiting_forms(self) -> tuple[Form, ...]:
        """Every limiting form (ties), ``limiting_form`` among them; empty when none lowered L*."""
        return self.plan.limiting_forms

    @property
    def forms(self) -> tuple[FormLookup, ...]:
        return self.plan.forms

    @property
    def recoverable_tokens(self) -> int:
        return self.plan.resume_tokens - self.replayed_tokens

    @property
    def recomputed_tokens(self) -> int:
        return self.plan.prompt_tokens - self.plan.resume_tokens

    def form(self, form: Form) -> FormLookup:
        return self.plan.form(form)


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
    top of the reused state. Warm equals cold: ``logits ≈ prefill_logits(ids)[L*:]``. After a
    Tail-Replay of R tokens (``approximate``) the logits cover L* − R … T−1."""

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
