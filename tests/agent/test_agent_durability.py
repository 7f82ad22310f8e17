"""Durability (issue 6): two engines' telemetry clients with spools keep sending while the agent
is killed with SIGKILL at random moments (a bounded count) and restarted; once the spools drain,
every event sent is stored exactly once and the stored batches' seqs have no gaps."""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx

from agent.store import Store
from engine.events import EngineStats, Form, Tier
from engine.telemetry import TelemetryClient
from tests.agent_process import start_agent
from tests.helpers import free_port

EVENTS = 3_000
KILLS = 3


def test_sigkilled_agent_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    port, data = free_port(), tmp_path / "data"
    agent = start_agent(port, data, log_level="error")
    engines = ("e-durable-0", "e-durable-1")
    clients = {
        engine: TelemetryClient(
            f"http://127.0.0.1:{port}",
            engine,
            batch_max_events=50,
            batch_max_seconds=0.02,
            spool_path=tmp_path / f"{engine}.spool",
            timeout_seconds=2.0,
        )
        for engine in engines
    }
    done = {engine: threading.Event() for engine in engines}

    def send(engine: str) -> None:
        client = clients[engine]
        for i in range(EVENTS):
            client.emit(
                EngineStats(
                    ts=1_700_000_000.0 + i / 1000,
                    engine_id=engine,
                    model="m",
                    form=Form.FULL_KV,
                    tier=Tier.DEVICE,
                    used_bytes=i,  # the event's id
                    used_blocks=0,
                    cached_blocks=0,
                    free_blocks=0,
                    total_blocks=1,
                )
            )
            if i % 100 == 99:
                time.sleep(0.05)  # about 2 000 events/s per engine for 1.5 s
        done[engine].set()

    senders = [threading.Thread(target=send, args=(engine,)) for engine in engines]
    for sender in senders:
        sender.start()
    rng = random.Random(7)
    try:
        for _ in range(KILLS):  # bounded: kills at random moments while the senders run
            time.sleep(rng.uniform(0.1, 0.5))
            agent.send_signal(signal.SIGKILL)
            agent.wait(timeout=10)
            agent = start_agent(port, data, log_level="error")
        for sender in senders:
            sender.join(timeout=60)
        assert all(event.is_set() for event in done.values())
        deadline = time.monotonic() + 60
        for client in clients.values():
            assert client.flush(timeout_seconds=60)
            while client.spool:
                assert time.monotonic() < deadline, "the spool did not drain"
                time.sleep(0.05)
            client.close(timeout_seconds=10)
        agent_gaps = httpx.get(f"http://127.0.0.1:{port}/v1/query/ingest_seq_gaps", timeout=10).json()["rows"]
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    for client in clients.values():
        assert client.dropped_events == 0 and client.rejected_events == 0
    spooled = sum(c.spooled_events for c in clients.values())
    assert spooled > 0 and sum(c.replayed_events for c in clients.values()) == spooled  # the outages were real
    with Store.open(data / "kvscope.duckdb") as store, store.cursor() as cur:
        for engine in engines:
            ids = [r[0] for r in cur.execute("SELECT used_bytes FROM engine_stats WHERE engine_id = $e ORDER BY 1", {"e": engine}).fetchall()]
            seqs = [r[0] for r in cur.execute("SELECT seq FROM ingest_batches WHERE engine_id = $e AND status = 'stored' ORDER BY 1", {"e": engine}).fetchall()]
            assert ids == list(range(EVENTS)), engine  # every event, exactly once
            assert seqs == list(range(len(seqs))), engine  # seqs 0..n-1: no gaps
    # as the agent itself reports them: nothing missing for either engine
    assert sorted((row[0], row[3]) for row in agent_gaps) == [(engine, 0) for engine in engines]
