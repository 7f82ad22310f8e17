"""Event builders for the agent tests.

The known batch (engine ``e1``, model ``m1``) holds two requests — 4000 prompt tokens, 3800
hash-hit, 3000 recoverable, 200 replayed, 800 recomputed — their four cache lookups, one
``engine_stats`` and one ``block`` event.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec


def minute_start(offset_minutes: int = -2) -> int:
    """The start (unix seconds) of the minute ``offset_minutes`` from the current one."""
    return (int(time.time()) // 60 + offset_minutes) * 60


def request_event(ts: float, request_id: str, **fields: Any) -> dict[str, Any]:
    event = {
        "kind": "request",
        "ts": ts,
        "engine_id": "e1",
        "request_id": request_id,
        "model": "m1",
        "prompt_tokens": 1000,
        "output_tokens": 10,
        "hash_hit_tokens": 0,
        "resume_tokens": 0,
        "recoverable_tokens": 0,
        "replayed_tokens": 0,
        "recomputed_tokens": 1000,
        "admission": "cold",
        "ttft_seconds": 0.1,
        "e2e_seconds": 0.5,
    }
    event.update(fields)
    return event


def lookup_event(ts: float, request_id: str, **fields: Any) -> dict[str, Any]:
    event = {
        "kind": "cache_lookup",
        "ts": ts,
        "engine_id": "e1",
        "request_id": request_id,
        "model": "m1",
        "form": "full_kv",
        "tier": "device",
        "outcome": "hit",
        "reason": "none",
        "hash_hit_tokens": 0,
        "usable_tokens": 0,
        "recoverable_tokens": 0,
    }
    event.update(fields)
    return event


def known_events(base: float) -> list[dict[str, Any]]:
    """The known batch's events, at ``base + 1 .. base + 8`` seconds."""
    return [
        lookup_event(
            base + 1, "r1", hash_hit_tokens=800, usable_tokens=800, recoverable_tokens=600
        ),
        lookup_event(
            base + 1,
            "r1",
            form="swa_window",
            outcome="invalidated",
            reason="swa_evicted",
            hash_hit_tokens=800,
            usable_tokens=600,
            recoverable_tokens=600,
        ),
        request_event(
            base + 2,
            "r1",
            prompt_tokens=1000,
            hash_hit_tokens=800,
            resume_tokens=600,
            recoverable_tokens=600,
            recomputed_tokens=400,
            limiting_form="swa_window",
            limiting_reason="swa_evicted",
            admission="exact",
            ttft_seconds=0.125,
            e2e_seconds=1.5,
        ),
        lookup_event(
            base + 3,
            "r2",
            tier="host",
            outcome="recovered",
            reason="kv_evicted",
            hash_hit_tokens=3000,
            usable_tokens=3000,
            recoverable_tokens=2400,
            recovery_seconds=0.25,
            bytes_moved=1_048_576,
            epoch=7,
        ),
        lookup_event(
            base + 3,
            "r2",
            form="linear_state",
            outcome="replayed",
            reason="linear_checkpoint_missing",
            hash_hit_tokens=3000,
            usable_tokens=2400,
            recoverable_tokens=2400,
            replayed_tokens=200,
            approximate=True,
            layer_group=1,
        ),
        request_event(
            base + 4,
            "r2",
            prompt_tokens=3000,
            hash_hit_tokens=3000,
            resume_tokens=2600,
            recoverable_tokens=2400,
            replayed_tokens=200,
            recomputed_tokens=400,
            approximate=True,
            limiting_form="linear_state",
            limiting_reason="linear_checkpoint_missing",
            admission="tail_replay",
        ),
        {
            "kind": "engine_stats",
            "ts": base + 5,
            "engine_id": "e1",
            "model": "m1",
            "form": "full_kv",
            "tier": "device",
            "used_bytes": 4096,
            "used_blocks": 2,
            "cached_blocks": 1,
            "free_blocks": 5,
            "total_blocks": 8,
            "running_requests": 1,
        },
        {
            "kind": "block",
            "ts": base + 6,
            "engine_id": "e1",
            "model": "m1",
            "form": "full_kv",
            "tier": "device",
            "action": "stored",
            "block_hash": "ab12",
            "block_id": 3,
            "num_tokens": 16,
        },
    ]


def batch(seq: int, events: list[dict[str, Any]], engine_id: str = "e1") -> dict[str, Any]:
    return {
        "schema_version": 1,
        "engine_id": engine_id,
        "seq": seq,
        "sent_at": time.time(),
        "events": events,
    }


def json_body(value: Any) -> bytes:
    return msgspec.json.encode(value)


def arrow_tables(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The events (JSON-like dicts, as :func:`known_events`) as one wire table per kind, in the
    order each kind first appears; a field left out takes its default."""
    import pyarrow as pa

    from engine.events_arrow import WIRE_COLUMNS, WIRE_SCHEMAS

    rows: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        kind = event["kind"]
        filled = {}
        for column in WIRE_COLUMNS[kind]:
            if column.name in event:
                filled[column.name] = event[column.name]
            elif not column.required:
                filled[column.name] = list(column.default) if isinstance(column.default, tuple) else getattr(column.default, "value", column.default)
        rows.setdefault(kind, []).append(filled)
    return {kind: pa.Table.from_pylist(items, schema=WIRE_SCHEMAS[kind]) for kind, items in rows.items()}


def arrow_body(value: dict[str, Any]) -> bytes:
    """A batch dict (as :func:`batch`) as an ``application/vnd.apache.arrow.stream`` body."""
    from engine.events_arrow_encode import encode_tables

    return encode_tables(
        arrow_tables(value["events"]), engine_id=value["engine_id"], seq=value["seq"], sent_at=value["sent_at"], run_id=value.get("run_id")
    )
