"""Prefix-cache configuration: the prefix-match unit, per-form pool sizes, checkpoint policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TailReplayMode = Literal["off", "fallback", "on", "only"]
TAIL_REPLAY_MODES: tuple[TailReplayMode, ...] = ("off", "fallback", "on", "only")


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """How the prefix cache is laid out.

    Attributes:
        unit_tokens: U, the prefix-match unit: the token granularity of the hash chain, the page
            size of the KV pools and the only hard alignment of a resume point (DESIGN.md §3).
        full_kv_blocks: pages in the ``full_kv`` pool (all full-attention layers share a page id).
        swa_blocks: pages in the ``swa_window`` pool (all sliding layers share a page id).
        linear_checkpoints: slots in the ``linear_state`` checkpoint pool (one slot holds the
            conv and recurrent state of every linear layer at one boundary).
        compressed_blocks: pages in each ``compressed_kv`` pool and each indexer key pool (one
            pool per compressor geometry; a page holds the entries of ``max(U, r)`` tokens of
            every layer of that geometry).
        tail_slots: slots in the ``uncompressed_tail`` pool and the indexer's pending-row pool
            (one slot holds the pending and previous-group rows of every CSA/HCA layer at one
            boundary).
        checkpoint_interval_tokens: a recurrent checkpoint is taken at every multiple of this
            (a multiple of U) during prefill, plus at the last U boundary strictly before the
            prompt end (the resume point a follow-up request needs).
        max_prefill_chunk_tokens: prefill runs in chunks of at most this many tokens.
        enable_prefix_caching: when False every request is a cold prefill and nothing is stored.
        tail_replay: Tail-Replay for ``linear_state``: when the exact resume point is held back
            by a missing recurrent checkpoint, resume the other forms at their common point L
            and rebuild the linear layers' state by replaying the last R tokens from a zero
            state (approximate, flagged; nothing the request computes is cached). ``"off"``
            (default); ``"fallback"``: only when no exact checkpoint lies within the replay
            budget (exact L* < L − R); ``"on"``: whenever the linear checkpoint is what holds L*
            back (the paper's setting, ignoring checkpoints inside the budget); ``"only"``: as
            ``"on"`` and no recurrent checkpoints are stored at all (the memory saved is in the
            memory plan). Source: "Tail-Replay: Escaping the Curse of Linear Attention in
            Prefix Caching for Hybrid LLMs" (2026).
        replay_fraction, replay_min_tokens, replay_max_tokens: R = the fraction of L, rounded
            up to U, clamped to [min, max] tokens.
        memory_bytes: when set, one byte budget for every pool: the block counts above are
            replaced by a memory plan that gives each form room for the same prefix length
            after headroom for running requests (:mod:`engine.cache.memory_plan`).
        host_tier_bytes, disk_tier_bytes: capacity of the host and disk tiers every evicted
            object is copied down to (0: the tier is off; :mod:`engine.cache.tiers`).
        disk_tier_dir: the disk tier's directory (default: ``tiers/`` under the engine's data
            directory); files found there at start are indexed again.
        swap_in_wait: a lookup that needs an object whose swap-in is in flight waits for it
            (True) or resumes lower with reason ``in_flight_swap`` (False).
        max_recovery_bytes, max_replay_tokens: the global cap on recovery work in flight
            (swap-in bytes; Tail-Replay tokens); a plan over it is degraded with reason
            ``recovery_cap_reached``. None: no cap.

    The pools are pre-allocated at start; one id in each pool (id 0) is a permanent sentinel
    that no request owns. Raises ValueError on a non-positive size or a misaligned interval.
    """

    unit_tokens: int = 16
    full_kv_blocks: int = 4096
    swa_blocks: int = 512
    linear_checkpoints: int = 128
    compressed_blocks: int = 4096
    tail_slots: int = 128
    checkpoint_interval_tokens: int = 128
    max_prefill_chunk_tokens: int = 512
    enable_prefix_caching: bool = True
    memory_bytes: int | None = None
    tail_replay: TailReplayMode = "off"
    replay_fraction: float = 0.05
    replay_min_tokens: int = 64
    replay_max_tokens: int = 4096
    host_tier_bytes: int = 0
    disk_tier_bytes: int = 0
    disk_tier_dir: str | None = None
    swap_in_wait: bool = True
    max_recovery_bytes: int | None = None
    max_replay_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "unit_tokens",
            "full_kv_blocks",
            "swa_blocks",
            "linear_checkpoints",
            "compressed_blocks",
            "tail_slots",
            "checkpoint_interval_tokens",
            "max_prefill_chunk_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"CacheConfig.{name} = {value!r} must be a positive integer")
        if self.memory_bytes is not None and (not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0):
            raise ValueError(f"CacheConfig.memory_bytes = {self.memory_bytes!r} must be a positive integer or None")
        if self.tail_replay not in TAIL_REPLAY_MODES:
            raise ValueError(f"CacheConfig.tail_replay = {self.tail_replay!r} must be one of {', '.join(TAIL_REPLAY_MODES)}")
        for name in ("host_tier_bytes", "disk_tier_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"CacheConfig.{name} = {value!r} must be a non-negative integer")
        for name in ("max_recovery_bytes", "max_replay_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"CacheConfig.{name} = {value!r} must be a non-negative integer or None")
        if not 0.0 < self.replay_fraction <= 1.0:
            raise ValueError(f"CacheConfig.replay_fraction = {self.replay_fraction!r} must be in (0, 1]")
        if not 0 < self.replay_min_tokens <= self.replay_max_tokens:
            raise ValueError(
                f"CacheConfig.replay_min_tokens = {self.replay_min_tokens} and replay_max_tokens = "
                f"{self.replay_max_tokens} must satisfy 0 < min <= max"
            )
        if self.checkpoint_interval_tokens % self.unit_tokens:
            raise ValueError(
                f"CacheConfig.checkpoint_interval_tokens = {self.checkpoint_interval_tokens} is not "
                f"a multiple of unit_tokens = {self.unit_tokens}"
            )
        if self.max_prefill_chunk_tokens % self.unit_tokens:
            raise ValueError(
                f"CacheConfig.max_prefill_chunk_tokens = {self.max_prefill_chunk_tokens} is not "
                f"a multiple of unit_tokens = {self.unit_tokens}"
            )
        for name in ("linear_checkpoints", "compressed_blocks", "tail_slots"):
            if getattr(self, name) < 2:
                raise ValueError(f"CacheConfig.{name} must be at least 2 (one is the sentinel)")
