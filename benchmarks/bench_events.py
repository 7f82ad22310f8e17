"""Engine-like events for the ingest benchmarks: five kinds of request, each one ``request``
event and four ``cache_lookup`` events, covering every outcome, tier and six forms."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import msgspec

from agent.ingest import TABLE_SPECS
from engine.events import Admission, CacheLookup, Event, Form, Outcome, Reason, RequestEvent, Tier

MODEL = "kvscope_hybrid-small"
EVENTS_PER_REQUEST = 5
"""One ``request`` event and four ``cache_lookup`` events per request."""


def _lookup(
    engine_id: str, form: Form, tier: Tier, outcome: Outcome, reason: Reason, hit: int, usable: int,
    recoverable: int, **extra: Any,
) -> CacheLookup:  # fmt: skip
    return CacheLookup(
        ts=0.0, engine_id=engine_id, request_id="-", model=MODEL, form=form, tier=tier,
        outcome=outcome, reason=reason, hash_hit_tokens=hit, usable_tokens=usable,
        recoverable_tokens=recoverable, **extra,
    )  # fmt: skip


def _request(
    engine_id: str, admission: Admission, hit: int, resume: int, recoverable: int, replayed: int,
    recomputed: int, **extra: Any,
) -> RequestEvent:  # fmt: skip
    return RequestEvent(
        ts=0.0, engine_id=engine_id, request_id="-", model=MODEL,
        prompt_tokens=recoverable + replayed + recomputed, output_tokens=128, hash_hit_tokens=hit,
        resume_tokens=resume, recoverable_tokens=recoverable, replayed_tokens=replayed,
        recomputed_tokens=recomputed, admission=admission, ttft_seconds=0.05, e2e_seconds=0.9,
        predicted_seconds=0.04, actual_seconds=0.05, **extra,
    )  # fmt: skip


def request_scenarios(engine_id: str) -> list[list[Event]]:
    """Five kinds of request, each one ``request`` event plus four ``cache_lookup`` events, that
    together cover every outcome (hit, recovered, replayed, invalidated, miss), all three tiers
    and six forms, with reasons and recovery times where a real engine would give them."""
    e = engine_id
    ok = Reason.NONE
    return [
        [  # exact resume from device
            _request(e, Admission.EXACT, 2048, 2048, 2048, 0, 2048),
            _lookup(e, Form.FULL_KV, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 2048),
            _lookup(e, Form.SWA_WINDOW, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 2048),
            _lookup(e, Form.LINEAR_STATE, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 2048),
            _lookup(e, Form.INDEXER_STATE, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 2048),
        ],
        [  # swap-in from host and disk
            _request(e, Admission.SWAP_IN, 3072, 3072, 3072, 0, 1024),
            _lookup(e, Form.FULL_KV, Tier.HOST, Outcome.RECOVERED, Reason.KV_EVICTED, 3072, 3072, 3072, recovery_seconds=0.0042, bytes_moved=96 << 20),
            _lookup(e, Form.SWA_WINDOW, Tier.DISK, Outcome.RECOVERED, Reason.SWA_EVICTED, 3072, 3072, 3072, recovery_seconds=0.011, bytes_moved=8 << 20),
            _lookup(e, Form.COMPRESSED_KV, Tier.HOST, Outcome.RECOVERED, Reason.COMPRESSED_EVICTED, 3072, 3072, 3072, recovery_seconds=0.0018, bytes_moved=12 << 20),
            _lookup(e, Form.LINEAR_STATE, Tier.DEVICE, Outcome.HIT, ok, 3072, 3072, 3072),
        ],
        [  # Tail-Replay of a missing linear checkpoint and tail
            _request(e, Admission.TAIL_REPLAY, 2048, 2048, 1920, 128, 2048, approximate=True, limiting_form=Form.LINEAR_STATE, limiting_reason=Reason.LINEAR_CHECKPOINT_MISSING),
            _lookup(e, Form.FULL_KV, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 1920),
            _lookup(e, Form.LINEAR_STATE, Tier.DEVICE, Outcome.REPLAYED, Reason.LINEAR_CHECKPOINT_MISSING, 2048, 1920, 1920, replayed_tokens=128, approximate=True),
            _lookup(e, Form.UNCOMPRESSED_TAIL, Tier.DEVICE, Outcome.REPLAYED, Reason.TAIL_MISSING, 2048, 1920, 1920, replayed_tokens=128),
            _lookup(e, Form.SWA_WINDOW, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 1920),
        ],
        [  # lower resume: compressed and indexer state invalidated
            _request(e, Admission.LOWER_RESUME, 2048, 1024, 1024, 0, 3072, limiting_form=Form.COMPRESSED_KV, limiting_reason=Reason.COMPRESSED_VERSION_MISMATCH),
            _lookup(e, Form.FULL_KV, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 1024),
            _lookup(e, Form.COMPRESSED_KV, Tier.DEVICE, Outcome.INVALIDATED, Reason.COMPRESSED_VERSION_MISMATCH, 2048, 1024, 1024, epoch=3),
            _lookup(e, Form.INDEXER_STATE, Tier.DEVICE, Outcome.INVALIDATED, Reason.INDEXER_STALE, 2048, 1024, 1024, epoch=3),
            _lookup(e, Form.SWA_WINDOW, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 1024),
        ],
        [  # cold: nothing matched
            _request(e, Admission.COLD, 0, 0, 0, 0, 4096, limiting_form=Form.FULL_KV, limiting_reason=Reason.NO_PREFIX_MATCH),
            _lookup(e, Form.FULL_KV, Tier.DEVICE, Outcome.MISS, Reason.NO_PREFIX_MATCH, 0, 0, 0),
            _lookup(e, Form.SWA_WINDOW, Tier.DEVICE, Outcome.MISS, Reason.NO_PREFIX_MATCH, 0, 0, 0),
            _lookup(e, Form.LINEAR_STATE, Tier.DEVICE, Outcome.MISS, Reason.NO_PREFIX_MATCH, 0, 0, 0),
            _lookup(e, Form.COMPRESSED_KV, Tier.DEVICE, Outcome.MISS, Reason.NO_PREFIX_MATCH, 0, 0, 0),
        ],
    ]  # fmt: skip


def build_events(engine_id: str, n_events: int) -> list[Event]:
    """``n_events`` fresh events (the scenarios in turn; the last request may be cut short),
    each request's events sharing a request id ``-`` that :func:`stamp` fills in."""
    scenarios = request_scenarios(engine_id)
    events: list[Event] = []
    for r in range(math.ceil(n_events / EVENTS_PER_REQUEST)):
        events.extend(msgspec.structs.replace(ev) for ev in scenarios[r % len(scenarios)])
    return events[:n_events]


def stamp(events: list[Event], ts: float, request_prefix: str) -> None:
    """Re-stamp a batch in place: every event gets ``ts``, every request a fresh id
    ``{request_prefix}{n}`` (its lookups share it). Cheaper than building new structs."""
    request_id = ""
    for i, ev in enumerate(events):
        if i % EVENTS_PER_REQUEST == 0:
            request_id = f"{request_prefix}{i // EVENTS_PER_REQUEST}"
        ev.ts = ts
        ev.request_id = request_id  # type: ignore[union-attr]  # only requests and lookups here


def kind_counts(events: list[Event]) -> dict[str, int]:
    return {TABLE_SPECS[cls].table: n for cls, n in Counter(map(type, events)).items()}
