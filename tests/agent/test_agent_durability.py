"""Durability (issue 6): an engine's telemetry client with a spool keeps sending while the agent
is killed with SIGKILL at random moments and restarted; once the spool drains, every event sent
is stored exactly once and the stored batches' seqs have no gaps."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from agent.store import Store
from engine.events import EngineStats, Form, Tier
from engine.telemetry import TelemetryClient
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from pathlib import Path
from agent.config import AgentConfig
from agent.server import serve
serve(AgentConfig(port=int(sys.argv[1]), data_dir=Path(sys.argv[2])), log_level="error")
"""
EVENTS = 3_000
KILLS = 2


def start_agent(port: int, data: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVSCOPE_TOKEN", None)
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(port), str(data)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, "the agent exited during start-up"
        assert time.monotonic() < deadline, "the agent did not become ready"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def test_sigkilled_agent_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    port, data = free_port(), tmp_path / "data"
    agent = start_agent(port, data)
    client = TelemetryClient(
        f"http://127.0.0.1:{port}", "e-durable", batch_max_events=50, batch_max_seconds=0.02, spool_path=tmp_path / "e.spool", timeout_seconds=2.0
    )
    done = threading.Event()

    def send() -> None:
        for i in range(EVENTS):
            client.emit(
                EngineStats(
                    ts=1_700_000_000.0 + i / 1000,
                    engine_id="e-durable",
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
                time.sleep(0.05)  # about 2 000 events/s for 1.5 s
        done.set()

    sender = threading.Thread(target=send)
    sender.start()
    rng = random.Random(7)
    try:
        for _ in range(KILLS):  # bounded: two kills at random moments while the sender runs
            time.sleep(rng.uniform(0.2, 0.6))
            agent.send_signal(signal.SIGKILL)
            agent.wait(timeout=10)
            agent = start_agent(port, data)
        sender.join(timeout=60)
        assert done.is_set()
        assert client.flush(timeout_seconds=60)
        deadline = time.monotonic() + 60
        while client.spool:
            assert time.monotonic() < deadline, "the spool did not drain"
            time.sleep(0.05)
        client.close(timeout_seconds=10)
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    assert client.dropped_events == 0 and client.rejected_events == 0
    assert client.spooled_events > 0 and client.replayed_events == client.spooled_events  # the outages were real
    with Store.open(data / "kvscope.duckdb") as store, store.cursor() as cur:
        ids = [row[0] for row in cur.execute("SELECT used_bytes FROM engine_stats WHERE engine_id = 'e-durable' ORDER BY 1").fetchall()]
        seqs = [row[0] for row in cur.execute("SELECT seq FROM ingest_batches WHERE engine_id = 'e-durable' AND status = 'stored' ORDER BY 1").fetchall()]
    assert ids == list(range(EVENTS))  # every event, exactly once
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps
