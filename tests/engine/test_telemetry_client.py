"""The telemetry client: events after ``close`` and batch seqs across restarts."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from engine.events import EngineStats, Form, Tier
from engine.events_arrow_check import batch_dict
from engine.llm import default_engine_id
from engine.telemetry import TelemetryClient


def test_emit_after_close_is_dropped_not_queued_forever() -> None:
    """After ``close`` the sender thread is gone: an event emitted then is dropped and counted in
    ``dropped_events`` (never queued, so ``flush`` returns at once)."""
    client = TelemetryClient("http://127.0.0.1:9", "e-review", max_retries=1)
    client.close(timeout_seconds=2)
    client.emit(_stats("e-review"))
    assert client.flush(timeout_seconds=1.0), "an event emitted after close() can never be flushed"
    assert client.dropped_events == 1


def _stats(engine_id: str) -> EngineStats:
    return EngineStats(
        ts=time.time(),
        engine_id=engine_id,
        model="m",
        form=Form.FULL_KV,
        tier=Tier.DEVICE,
        used_bytes=0,
        used_blocks=0,
        cached_blocks=0,
        free_blocks=0,
        total_blocks=1,
    )


def _run_once(engine_id: str, sent: list[tuple[str, int]], spool: Path | None) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = batch_dict(request.content)
        sent.append((body["engine_id"], body["seq"]))
        return httpx.Response(200, json={"status": "stored"})

    client = TelemetryClient("http://agent.invalid", engine_id, batch_max_seconds=0.05, spool_path=spool)
    client._http = httpx.Client(transport=httpx.MockTransport(handler))
    for _ in range(2):
        client.emit(_stats(engine_id))
        assert client.flush(timeout_seconds=5)
    client.close(timeout_seconds=5)


def test_seqs_start_at_zero_and_a_restart_with_the_spool_continues_them(tmp_path: Path) -> None:
    """The agent deduplicates on (engine_id, seq) and reports seqs never received as gaps: each
    engine's seqs run 0, 1, 2, ... An engine restarted with its spool (and the same id) continues
    where it stopped instead of reusing a seq."""
    sent: list[tuple[str, int]] = []
    for _run in range(2):
        _run_once("e-stable", sent, tmp_path / "e.spool")
    assert sent == [("e-stable", 0), ("e-stable", 1), ("e-stable", 2), ("e-stable", 3)]


def test_without_a_spool_each_run_is_its_own_engine() -> None:
    """Without a spool nothing remembers the seq, so a run starts at 0 again: the default engine
    id is unique per run, so the two runs never collide (a fixed id would get 409 from the agent,
    see tests/agent/test_agent_pipeline.py)."""
    sent: list[tuple[str, int]] = []
    first = default_engine_id()
    time.sleep(0.002)
    second = default_engine_id()
    assert first != second
    for engine_id in (first, second):
        _run_once(engine_id, sent, None)
    assert sent == [(first, 0), (first, 1), (second, 0), (second, 1)]
