"""Which tokens of which requests the next engine step computes: continuous batching with a token
budget, decode first, chunked prefill, and fair admission across sessions.

One step (vLLM's V1 scheduler, SGLang's chunked-prefill policy):

1. **Decode first.** Every running request past its prefill gets its one token, oldest first, as
   long as the budget (``max_num_batched_tokens``) lasts.
2. **Chunked prefill.** Running requests still prefilling get chunks from what budget is left, in
   arrival order; a chunk ends at the budget, at ``max_prefill_chunk_tokens`` or at the next
   position where the cache takes a recurrent checkpoint, whichever comes first (so checkpoints
   land exactly where the cache stores them).
3. **Admission.** While budget and ``max_num_seqs`` allow, waiting requests are admitted (the
   runtime looks each up in the prefix cache) and get a first chunk in the same step. The next one comes from the session with the fewest running
   requests (ties: earliest arrival), so one chatty session cannot starve the others; a
   preempted request goes first in its session.

The scheduler only decides; :class:`~engine.runtime.runtime.Runtime` admits (prefix-cache lookup,
leases), allocates pages and preempts when a pool runs out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Per-step limits (vLLM's names).

    max_num_batched_tokens: tokens computed per step, decode and prefill together.
    max_num_seqs: requests running at once (holding leases and a working state).
    max_model_len: the longest request, prompt and output tokens together (sizes the decode
        runner's block tables).

    Raises:
        ValueError: a limit below 1.
    """

    max_num_batched_tokens: int = 256
    max_num_seqs: int = 32
    max_model_len: int = 32768

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)} must be at least 1")


class Schedulable(Protocol):
    """What the scheduler reads of a request."""

    @property
    def serial(self) -> int:
        """Arrival order (lower first); a preempted request keeps its own."""
        ...

    @property
    def session(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int:
        """Tokens the request's sequence holds now (prompt and the outputs fed back)."""
        ...

    def next_chunk_end(self, budget: int) -> int:
        """Where a prefill chunk of at most ``budget`` tokens from ``num_computed_tokens`` ends."""
        ...


@dataclass(slots=True)
class StepPlan:
    """One step's work for the running requests: ``decodes`` (one token each) and ``prefills``
    as (request, chunk end); ``budget_left`` tokens remain for admissions."""

    decodes: list[Schedulable] = field(default_factory=list)
    prefills: list[tuple[Schedulable, int]] = field(default_factory=list)
    budget_left: int = 0


def is_decoding(r: Schedulable) -> bool:
    """Past its prefill: one token (the last one fed back) left to compute."""
    return r.num_computed_tokens == r.num_tokens - 1


class Scheduler:
    """Plans steps (module docstring). Stateless between steps: the runtime keeps the queues."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def schedule(self, running: Sequence[Schedulable]) -> StepPlan:
        """Decodes, then prefill chunks, for the running requests, within the token budget."""
        plan = StepPlan(budget_left=self.config.max_num_batched_tokens)
        ordered = sorted(running, key=lambda r: r.serial)
        for r in ordered:
            if plan.budget_left and is_decoding(r):
                plan.decodes.append(r)
                plan.budget_left -= 1
        for r in ordered:
            if plan.budget_left and r.num_computed_tokens < r.num_tokens - 1:
                end = r.next_chunk_end(plan.budget_left)
                plan.prefills.append((r, end))
                plan.budget_left -= end - r.num_computed_tokens
        return plan

    def next_admission(self, running: Sequence[Schedulable], waiting: Sequence[Schedulable]) -> Schedulable | None:
        """The waiting request to admit next, or None when ``max_num_seqs`` are running: from the
        session with the fewest running requests, then the earliest arrival."""
        if not waiting or len(running) >= self.config.max_num_seqs:
            return None
        sessions = Counter(r.session for r in running)
        return min(waiting, key=lambda r: (sessions[r.session], r.serial))
