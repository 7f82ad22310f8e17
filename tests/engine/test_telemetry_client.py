"""the telemetry client after ``close``."""

from __future__ import annotations

import time

from engine.events import EngineStats, Form, Tier
from engine.telemetry import TelemetryClient


def test_emit_after_close_is_dropped_not_queued_forever() -> None:
    """After ``close`` the sender thread is gone, yet ``emit`` still counts the event as pending
    and queues it: nothing will ever send or settle it, so ``flush()`` (no timeout) hangs forever
    and every later ``close`` waits its full timeout. An event emitted after close must be dropped
    and counted in ``dropped_events``."""
    client = TelemetryClient("http://127.0.0.1:9", "e-review", max_retries=1)
    client.close(timeout=2)
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
    assert client.flush(timeout=1.0), "an event emitted after close() can never be flushed"
    assert client.dropped_events == 1


def test_restarted_engine_with_a_stable_id_does_not_reuse_seqs() -> None:
    """The agent is idempotent on (engine_id, seq) and acknowledges a repeat as ``duplicate``
    without storing it. ``TelemetryClient`` starts ``seq`` at 0 in every process, so an engine
    restarted under the same ``engine_id`` (``LLM(engine_id=...)`` is public API) sends seq 0, 1,
    … again and the agent silently drops every batch of the new run as a duplicate. The seq must
    stay monotonic per engine id across restarts (or the key must include a run id)."""
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
        client.close(timeout=5)
    assert len(sent) == 2
    assert sent[0] != sent[1], (
        f"both runs sent {sent[0]}: the second run's events are dropped as duplicates"
    )
