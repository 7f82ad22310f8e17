"""The telemetry client: events after ``close`` and sequence numbers across restarts."""

from __future__ import annotations

import time

from engine.events import EngineStats, Form, Tier
from engine.telemetry import TelemetryClient


def test_emit_after_close_is_dropped_not_queued_forever() -> None:
    """After ``close`` the sender thread is gone: an event emitted then is dropped and counted in
    ``dropped_events`` (never queued, so ``flush`` returns at once)."""
    client = TelemetryClient("http://127.0.0.1:9", "e-review", max_retries=1)
    client.close(timeout_seconds=2)
    event = EngineStats(
        ts=time.time(),
        engine_id="e-review",
        model="m",
        form=Form.FULL_KV,
        tier=Tier.DEVICE,
        used_bytes=0,
        used_blocks=0,
        cached_blocks=0,
        free_blocks=0,
        total_blocks=1,
    )
    client.emit(event)
    assert client.flush(timeout_seconds=1.0), "an event emitted after close() can never be flushed"
    assert client.dropped_events == 1


def test_restarted_engine_with_a_stable_id_does_not_reuse_seqs() -> None:
    """The agent deduplicates on (engine_id, seq): an engine restarted under the same id must not
    send a seq its previous run used, or the new run's batches are dropped as duplicates."""
    import httpx
    import msgspec

    sent: list[tuple[str, int]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = msgspec.msgpack.decode(request.content)
        sent.append((body["engine_id"], body["seq"]))
        return httpx.Response(200, json={"status": "stored"})

    for _run in range(2):  # the same engine, started twice
        client = TelemetryClient("http://agent.invalid", "e-stable", batch_max_seconds=0.05)
        client._http = httpx.Client(transport=httpx.MockTransport(handler))
        client.emit(
            EngineStats(
                ts=time.time(),
                engine_id="e-stable",
                model="m",
                form=Form.FULL_KV,
                tier=Tier.DEVICE,
                used_bytes=0,
                used_blocks=0,
                cached_blocks=0,
                free_blocks=0,
                total_blocks=1,
            )
        )
        client.close(timeout_seconds=5)
    assert len(sent) == 2
    assert sent[0] != sent[1], (
        f"both runs sent {sent[0]}: the second run's events are dropped as duplicates"
    )
