"""One request in the serving runtime: its prompt, what it produced, what it holds while it runs,
and why it ended (:class:`RuntimeRequest`, :class:`FinishReason`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from torch import Tensor

from engine.cache.prefix_cache import Admitted
from engine.cache.sequence import PagedSequence
from engine.events import Form
from engine.outputs import CacheReport
from engine.request_lifecycle import AdmissionRecord, Lease
from engine.sampling import Sampler, SamplingParams


class FinishReason(StrEnum):
    """Why a request ended (OpenAI's ``finish_reason`` values, plus ``abort``)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class RuntimeRequest:
    """One request in the runtime: its prompt, what it produced, and the cache objects it holds
    while running (its :class:`~engine.request_lifecycle.Lease`: the sequence, and the admission's
    recovery budget until its prefill is done)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    session: str
    serial: int
    max_chunk: int
    on_token: Callable[[int], None] | None = None
    on_finish: Callable[[RuntimeRequest], None] | None = None
    keep_logits: bool = False
    arrival_wall: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    sampled_logits: list[Tensor] = field(default_factory=list)
    """With ``keep_logits``: the logits row ``[vocab]`` each output token was sampled from."""
    lease: Lease | None = None
    """What the request holds while it runs (None while it waits and once it ended)."""
    first_admission: AdmissionRecord | None = None
    """The first admission: what the cache gave the user's prompt (a re-admission after a
    preemption resumes on pages the request published itself, which are not cache hits)."""
    report: CacheReport | None = None
    ttft_seconds: float | None = None
    e2e_seconds: float | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    decode_slot: int | None = None
    """The decode runner's slot holding this request's recurrent state while it decodes."""
    sampler: Sampler = field(init=False)

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.params)

    @property
    def seq(self) -> PagedSequence | None:
        """The running sequence (None while waiting and once ended)."""
        return self.lease.seq if self.lease is not None else None

    @property
    def admitted(self) -> Admitted | None:
        """The current admission (None while waiting and once ended)."""
        return self.lease.record.admitted if self.lease is not None else None

    @property
    def epochs(self) -> dict[Form, int] | None:
        """Each form's epoch at the first admission's resume point (None before it)."""
        return self.first_admission.epochs if self.first_admission is not None else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens if self.seq is not None else 0

    @property
    def num_tokens(self) -> int:
        if self.seq is not None:
            return len(self.seq.token_ids)
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def next_chunk_end(self, budget: int) -> int:
        """A prefill chunk from the computed tokens: at most ``budget`` and ``max_chunk`` tokens,
        ending at the next checkpoint position that must end a chunk if one comes first
        (``PagedSequence.chunk_stops``)."""
        assert self.seq is not None
        start = self.num_computed_tokens
        ends = [self.num_tokens, start + budget, start + self.max_chunk]
        ends += [p for p in self.seq.chunk_stops if start < p < min(ends)]
        return min(ends)
