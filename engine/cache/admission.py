"""Admission: price each candidate plan of a request in seconds and pick the cheapest
(DESIGN.md §4, red line 1).

Candidates: cold prefill; the exact resume the device holds (or its Tail-Replay plan); the exact
resume at a deeper L* that needs a swap-in from host or disk. A plan's price is

    prefill(start, T) + Σ_tier (swap-in bytes / tier bandwidth + objects · per-object cost),

with ``prefill(s, T) = c·chunks + a·(T − s) + b·(T² − s²)/2`` seconds — ``a`` per token (projections,
MLP, recurrent layers) and ``b`` per (token × context token) (attention reading its keys) —
plus a fixed ``c`` per forward pass (the prefill runs in chunks that end at checkpoint
positions), fitted on this device at start from timed cold prefills
(:meth:`CostModel.measure`), and per tier a bandwidth and a per-object cost from timed round
trips through the tier's own copy path. A global cap on recovery work
in flight (swap-in bytes, replayed tokens) keeps a high hit rate from becoming a recovery storm:
a plan over the cap is degraded to the next candidate with reason ``recovery_cap_reached``.

Sources: the admission rule of the DESIGN (red line 1); the quadratic prefill cost model as used
by SGLang's and vLLM's schedulers to weigh recompute against transfer (e.g. LMCache /
CacheBlend discussions of "load vs recompute").
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.events import Admission, Tier

CALIBRATION_TOKENS = (64, 192, 384)
"""Prompt lengths of the timed cold prefills the per-token costs are fitted on."""

CALIBRATION_BYTES = 4 << 20
"""Bytes copied to time each tier's bandwidth."""

SMALL_OBJECT_BYTES = 4 << 10
"""Bytes of the small objects timed for each tier's per-object cost."""

SMALL_OBJECTS = 32
"""How many small objects are brought up together (as a swap-in does) for that cost."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Seconds a plan takes on this device.

    Attributes:
        seconds_per_token: ``a``, the cost of one prompt token independent of its context.
        seconds_per_token_pair: ``b``, the cost of one (token, context token) pair.
        seconds_per_chunk: ``c``, the fixed cost of one forward pass (kernel launches,
            bookkeeping); a prefill runs in chunks ending at checkpoint positions.
        tier_bytes_per_second: read bandwidth of each lower tier (bytes/s).
        tier_seconds_per_object: fixed cost of swapping in one object from each tier (a file
            open, header parse and checksum; a hand-off to the copy worker).
    """

    seconds_per_token: float
    seconds_per_token_pair: float = 0.0
    seconds_per_chunk: float = 0.0
    tier_bytes_per_second: Mapping[Tier, float] = field(default_factory=dict)
    tier_seconds_per_object: Mapping[Tier, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.seconds_per_token <= 0 or self.seconds_per_token_pair < 0 or self.seconds_per_chunk < 0:
            raise ValueError(
                f"CostModel: per-token costs must be positive, got {self.seconds_per_token}, "
                f"{self.seconds_per_token_pair}, {self.seconds_per_chunk}"
            )
        for tier, bw in self.tier_bytes_per_second.items():
            if bw <= 0:
                raise ValueError(f"CostModel: {tier} bandwidth must be positive, got {bw}")
        for tier, sec in self.tier_seconds_per_object.items():
            if sec < 0:
                raise ValueError(f"CostModel: {tier} seconds per object must be non-negative, got {sec}")

    def prefill_seconds(self, start: int, end: int, chunks: int = 1) -> float:
        """Predicted seconds to prefill positions ``[start, end)`` after ``start`` cached ones,
        in ``chunks`` forward passes."""
        n = max(0, end - start)
        return self.seconds_per_chunk * chunks + self.seconds_per_token * n + self.seconds_per_token_pair * (end * end - start * start) / 2

    def swap_in_seconds(self, bytes_by_tier: Mapping[Tier, int], objects_by_tier: Mapping[Tier, int] | None = None) -> float:
        """Predicted seconds to copy these bytes (and objects) up from each tier.

        Raises:
            RuntimeError: a tier with bytes has no measured bandwidth (an internal invariant).
        """
        total = 0.0
        for tier, nbytes in bytes_by_tier.items():
            if nbytes:
                bw = self.tier_bytes_per_second.get(tier)
                if bw is None:
                    raise RuntimeError(f"no bandwidth measured for the {tier} tier")
                total += nbytes / bw
        for tier, count in (objects_by_tier or {}).items():
            total += count * self.tier_seconds_per_object.get(tier, 0.0)
        return total

    @classmethod
    def measure(
        cls, prefill: Callable[[int], None], tiers: Mapping[Tier, Path | None], round_trip: Callable[[Tier, Path | None, int, int], float]
    ) -> CostModel:
        """Fit ``a``, ``b`` and ``c`` (least squares, clamped at 0) on timed cold prefills of
        :data:`CALIBRATION_TOKENS` (best of two each, after a warm-up), and take each enabled
        tier's ``round_trip(tier, directory, nbytes, count)`` — the seconds per object its own
        path needs to bring ``count`` objects back up together (best of three) — for one object
        of :data:`CALIBRATION_BYTES` (bandwidth) and for :data:`SMALL_OBJECTS` small ones (the
        per-object cost)."""
        def timed(fn: Callable[[], object]) -> float:
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            return best

        def best_of(fn: Callable[[], float], runs: int = 3) -> float:
            return min(fn() for _ in range(runs))

        prefill(CALIBRATION_TOKENS[0])  # warm-up
        times = [timed(functools.partial(prefill, n)) for n in CALIBRATION_TOKENS]
        x = torch.tensor([[1.0, n, n * n / 2] for n in CALIBRATION_TOKENS], dtype=torch.float64)
        y = torch.tensor(times, dtype=torch.float64).unsqueeze(1)
        c, a, b = (max(0.0, float(v)) for v in torch.linalg.lstsq(x, y).solution.squeeze(1))
        if a <= 0:  # a fit that puts everything elsewhere: fall back to the mean cost per token
            a = max(times[-1] / CALIBRATION_TOKENS[-1], 1e-9)
        bandwidth: dict[Tier, float] = {}
        per_object: dict[Tier, float] = {}
        for tier, where in tiers.items():
            small = best_of(functools.partial(round_trip, tier, where, SMALL_OBJECT_BYTES, SMALL_OBJECTS))
            large = best_of(functools.partial(round_trip, tier, where, CALIBRATION_BYTES, 1))
            per_object[tier] = small
            bandwidth[tier] = (CALIBRATION_BYTES - SMALL_OBJECT_BYTES) / max(large - small, 1e-6)
        return cls(
            seconds_per_token=a,
            seconds_per_token_pair=b,
            seconds_per_chunk=c,
            tier_bytes_per_second=bandwidth,
            tier_seconds_per_object=per_object,
        )


@dataclass(slots=True)
class RecoveryBudget:
    """The global cap on recovery work in flight: swap-in bytes and replayed tokens (None: no
    cap). :meth:`admits` checks a plan's share against what is in flight; :meth:`acquire` and
    :meth:`release` account for it while the request recovers."""

    max_bytes: int | None
    max_replay_tokens: int | None
    bytes_in_flight: int = 0
    replay_tokens_in_flight: int = 0

    def admits(self, nbytes: int, replay_tokens: int) -> bool:
        if self.max_bytes is not None and nbytes and self.bytes_in_flight + nbytes > self.max_bytes:
            return False
        return not (
            self.max_replay_tokens is not None and replay_tokens and self.replay_tokens_in_flight + replay_tokens > self.max_replay_tokens
        )

    def acquire(self, nbytes: int, replay_tokens: int) -> None:
        self.bytes_in_flight += nbytes
        self.replay_tokens_in_flight += replay_tokens

    def release(self, nbytes: int, replay_tokens: int) -> None:
        self.bytes_in_flight -= nbytes
        self.replay_tokens_in_flight -= replay_tokens
        if self.bytes_in_flight < 0 or self.replay_tokens_in_flight < 0:
            raise RuntimeError("recovery budget released more than it acquired")

    @property
    def in_flight(self) -> int:
        """Recoveries holding part of the budget (for ``engine_stats``)."""
        return int(self.bytes_in_flight > 0) + int(self.replay_tokens_in_flight > 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One priced plan: where computation starts, what it moves, its predicted seconds."""

    admission: Admission
    start_tokens: int
    swap_bytes: Mapping[Tier, int]
    replay_tokens: int
    predicted_seconds: float

    @property
    def total_swap_bytes(self) -> int:
        return sum(self.swap_bytes.values())


def price(
    costs: CostModel,
    admission: Admission,
    start: int,
    prompt_tokens: int,
    swap_bytes: Mapping[Tier, int],
    replay_tokens: int,
    swap_objects: Mapping[Tier, int] | None = None,
    chunks: int = 1,
) -> Candidate:
    """Price one plan: prefill from ``start`` in ``chunks`` forward passes plus the swap-in of
    ``swap_bytes`` (in ``swap_objects`` objects) per tier."""
    return Candidate(
        admission=admission,
        start_tokens=start,
        swap_bytes=dict(swap_bytes),
        replay_tokens=replay_tokens,
        predicted_seconds=costs.prefill_seconds(start, prompt_tokens, chunks) + costs.swap_in_seconds(swap_bytes, swap_objects),
    )


def choose(candidates: list[Candidate], budget: RecoveryBudget) -> tuple[Candidate, list[tuple[Candidate, str]]]:
    """The cheapest candidate the recovery cap admits (ties: the earlier one in the list, so
    list exact plans before approximate or costlier-to-recover ones), and the rejected cheaper
    ones with why: ``"cap"`` (over the recovery cap) or ``"cost"`` (a cheaper plan won).

    Raises:
        RuntimeError: no candidate at all (a cold prefill is always admissible).
    """
    if not candidates:
        raise RuntimeError("admission without candidates")
    admitted = [c for c in candidates if budget.admits(c.total_swap_bytes, c.replay_tokens)]
    if not admitted:
        raise RuntimeError("the recovery cap refused every plan, the cold prefill included")
    best = min(admitted, key=lambda c: c.predicted_seconds)
    rejected = [(c, "cost") for c in admitted if c is not best]
    rejected += [(c, "cap") for c in candidates if c not in admitted]
    return best, rejected
