"""The engine's telemetry events, built and sent to its sink (DESIGN.md §5's vocabulary).

A finished request sends one ``cache_lookup`` event per form and one ``request`` event
(:meth:`EventEmitter.request`); at most every :data:`STATS_INTERVAL_SECONDS` that is followed by
the pools' ``engine_stats`` (:meth:`EventEmitter.engine_stats`); with ``block_events`` every block
or slot stored or removed in any pool or tier sends a ``block`` event (vLLM's KV-event
vocabulary). The events themselves are defined in :mod:`engine.events`.
"""

from __future__ import annotations

import functools
import time

from engine.cache import PrefixCache
from engine.events import (
    BlockAction,
    BlockEvent,
    CacheLookup,
    EngineStats,
    Form,
    RequestEvent,
    Tier,
)
from engine.outputs import CacheReport
from engine.telemetry import EventSink

STATS_INTERVAL_SECONDS = 5.0
"""Least wall-clock seconds between two rounds of ``engine_stats`` sent after requests."""


class EventEmitter:
    """Builds one engine's events and hands them to ``sink``.

    Args:
        sink: where the events go (:class:`~engine.telemetry.EventSink`; ``emit`` must not
            block).
        engine_id: names the engine in every event.
        model_name: the model the engine serves, in every event.
        cache: the prefix cache whose pools ``engine_stats`` describes.
    """

    def __init__(self, sink: EventSink, engine_id: str, model_name: str, cache: PrefixCache) -> None:
        self.sink = sink
        self.engine_id = engine_id
        self.model_name = model_name
        self.cache = cache
        self.last_stats_at = 0.0
        """Wall-clock seconds (``time.time``) of the last ``engine_stats`` round sent after a request."""

    def watch_blocks(self) -> None:
        """Send a ``block`` event whenever a block or slot of any device pool, or an object of a
        lower tier, is stored or removed: installs the pools' and tiers' observers."""
        tokens_of: dict[str, tuple[Form, int]] = {}
        for form, pool, _, _, tokens in self.cache.pool_entries():
            pool.observer = functools.partial(self.block, form, tokens, Tier.DEVICE)
            tokens_of[pool.name] = (form, tokens)
        if self.cache.tiers is not None:
            self.cache.tiers.observer = lambda action, pool, h, tier: self.block(*tokens_of[pool], tier, action, h, 0)

    def request(
        self,
        request_id: str,
        ts: float,
        report: CacheReport,
        output_tokens: int,
        ttft_seconds: float,
        e2e_seconds: float,
        epochs: dict[Form, int],
    ) -> None:
        """The events of one ended request: a ``cache_lookup`` per form of ``report`` (with that
        form's epoch at L* from ``epochs``, 0 when absent), then its ``request`` event; then an
        ``engine_stats`` round when the last one is :data:`STATS_INTERVAL_SECONDS` old.

        Args:
            ts: the request's arrival, wall-clock seconds (``time.time``).
            ttft_seconds: arrival to its first token (to its end when it produced none).
            e2e_seconds: arrival to its end.
        """
        for f in report.forms:
            self.sink.emit(
                CacheLookup(
                    ts=ts,
                    engine_id=self.engine_id,
                    request_id=request_id,
                    model=self.model_name,
                    form=f.form,
                    tier=f.tier,
                    outcome=f.outcome,
                    reason=f.reason,
                    hash_hit_tokens=report.hash_hit_tokens,
                    usable_tokens=f.usable_tokens,
                    recoverable_tokens=f.recoverable_tokens,
                    replayed_tokens=f.replayed_tokens,
                    approximate=f.replayed_tokens > 0,
                    recovery_seconds=f.recovery_seconds,
                    bytes_moved=f.bytes_moved,
                    epoch=epochs.get(f.form, 0),
                    tp_rank=f.tp_rank,
                    ghost_tokens=f.ghost_tokens,
                    ghost_bytes=f.ghost_bytes,
                    spare_bytes=f.spare_bytes,
                    layer_group=f.layer_group,
                    indexer_sync_delay_tokens=f.sync_delay_tokens,
                    indexer_sync_delay_seconds=f.sync_delay_seconds,
                )
            )
        self.sink.emit(
            RequestEvent(
                ts=ts,
                engine_id=self.engine_id,
                request_id=request_id,
                model=self.model_name,
                prompt_tokens=report.prompt_tokens,
                output_tokens=output_tokens,
                hash_hit_tokens=report.hash_hit_tokens,
                resume_tokens=report.resume_tokens,
                recoverable_tokens=report.recoverable_tokens,
                replayed_tokens=report.replayed_tokens,
                recomputed_tokens=report.recomputed_tokens,
                approximate=report.approximate,
                limiting_form=report.limiting_form,
                limiting_reason=report.limiting_reason,
                limiting_forms=report.limiting_forms,
                admission=report.admission,
                predicted_seconds=report.predicted_seconds,
                actual_seconds=report.actual_seconds,
                ttft_seconds=ttft_seconds,
                e2e_seconds=e2e_seconds,
            )
        )
        now = time.time()
        if now - self.last_stats_at >= STATS_INTERVAL_SECONDS:
            self.last_stats_at = now
            self.engine_stats(now)

    def block(self, form: Form, num_tokens: int, tier: Tier, action: str, h: bytes, block: int) -> None:
        """One ``block`` event: ``action`` (a :class:`~engine.events.BlockAction` value) on the
        object of ``form`` keyed by hash ``h`` in ``tier`` (``block``: its index in the device
        pool, 0 in a lower tier), covering ``num_tokens`` tokens.

        Raises:
            ValueError: ``action`` is not a :class:`~engine.events.BlockAction`.
        """
        self.sink.emit(
            BlockEvent(
                ts=time.time(),
                engine_id=self.engine_id,
                model=self.model_name,
                form=form,
                tier=tier,
                action=BlockAction(action),
                block_hash=h.hex(),
                block_id=block,
                num_tokens=num_tokens,
            )
        )

    def engine_stats(self, ts: float | None = None) -> None:
        """One ``engine_stats`` event per form on the device with the pools' occupancy, and one
        per (form, lower tier) holding objects (bytes and object counts); ``ts`` in wall-clock
        seconds (default now)."""
        ts = time.time() if ts is None else ts
        in_flight = self.cache.recovery.in_flight
        for occ in [*self.cache.occupancy(), *self.cache.tier_occupancy()]:
            self.sink.emit(
                EngineStats(
                    ts=ts,
                    engine_id=self.engine_id,
                    model=self.model_name,
                    form=occ.form,
                    tier=occ.tier,
                    used_bytes=occ.used_bytes,
                    used_blocks=occ.used_blocks,
                    cached_blocks=occ.cached_blocks,
                    free_blocks=occ.free_blocks,
                    total_blocks=occ.total_blocks,
                    recoveries_in_flight=in_flight,
                )
            )
