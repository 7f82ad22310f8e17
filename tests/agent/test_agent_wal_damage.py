"""End-to-end acknowledgement (issue 19): two engines with spools keep sending while the agent is
killed with its batches still in the WAL and the WAL is damaged — a byte flipped anywhere, the
header overwritten, truncated, garbage appended — and once more killed while a checkpoint runs.
Every time the agent starts (degraded where it lost acknowledged batches, saying so); once the
spools drain, every event sent is stored exactly once."""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from agent.store import Store
from agent.wal_guard import wal_path
from engine.events import EngineStats
from engine.telemetry import TelemetryClient
from kvscope.replaying import drain_earlier_spools
from tests.agent_process import start_agent
from tests.helpers import free_port, numbered_stats

ENGINES = ("e-wal-0", "e-wal-1")
PER_ROUND = 200
CONFIG = {"checkpoint_interval_seconds": 3600, "decode_processes": 0}
"""No timed checkpoint: what the engines send stays in the WAL until the agent is killed."""


def stats(engine: str, i: int) -> EngineStats:
    return numbered_stats(engine, i, ts_step=0.001)


def wait_until(condition: Callable[[], bool], what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def flip_random_byte(rng: random.Random) -> Callable[[bytes], bytes]:
    def damage(data: bytes) -> bytes:
        i = rng.randrange(len(data))
        return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1 :]

    return damage


def test_damaged_wals_and_a_kill_during_a_checkpoint_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    rng = random.Random(19)
    port, data = free_port(), tmp_path / "data"
    db = data / "kvscope.duckdb"
    agent = start_agent(port, data, log_level="error", config=CONFIG)
    url = f"http://127.0.0.1:{port}"
    clients = {
        engine: TelemetryClient(
            url,
            engine,
            batch_max_events=25,
            batch_max_seconds=0.02,
            spool_path=tmp_path / f"{engine}.spool",
            timeout_seconds=2.0,
            watermark_poll_seconds=0.1,
        )
        for engine in ENGINES
    }
    sent = dict.fromkeys(ENGINES, 0)

    def send_round() -> None:
        for engine, client in clients.items():
            for i in range(sent[engine], sent[engine] + PER_ROUND):
                client.emit(stats(engine, i))
            sent[engine] += PER_ROUND
        for client in clients.values():
            assert client.flush(timeout_seconds=60)
        # everything acknowledged (nothing unsent) yet kept: none of it is durable
        wait_until(lambda: all(not c.spool for c in clients.values()), "the spools did not send their backlog")
        assert all(c.spool is not None and c.spool.awaiting_records > 0 for c in clients.values())

    damages: list[tuple[str, Callable[[bytes], bytes] | None]] = [
        ("flip a random byte", flip_random_byte(rng)),
        ("flip another random byte", flip_random_byte(rng)),
        ("header overwritten", lambda b: b"\x00" * 32 + b[32:]),
        ("truncated by 37 bytes", lambda b: b[:-37]),
        ("garbage appended", lambda b: b + rng.randbytes(300)),
        ("killed during a checkpoint", None),
    ]
    seen: dict[str, tuple[str, list[str]]] = {}
    details: dict[str, list[str]] = {}
    try:
        for name, damage in damages:
            send_round()
            if damage is None:
                asked = threading.Thread(target=_ask_checkpoint, args=(url,), daemon=True)
                asked.start()
                time.sleep(rng.uniform(0.0, 0.02))
            agent.send_signal(signal.SIGKILL)
            agent.wait(timeout=10)
            wal = wal_path(db)
            if damage is not None:
                assert wal.exists(), "the acknowledged batches were not in the WAL"
                wal.write_bytes(damage(wal.read_bytes()))
            agent = start_agent(port, data, log_level="error", config=CONFIG)  # starts: no crash loop
            ready = httpx.get(f"{url}/readyz", timeout=5).json()
            seen[name] = (ready["status"], [d["reason"] for d in ready.get("degraded", [])])
            details[name] = [d["detail"] for d in ready.get("degraded", [])]
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            lost = _sample(metrics, "kvscope_store_acknowledged_batches_missing_total")
            if seen[name][0] == "degraded":
                assert lost > 0 or "wal_quarantined" in seen[name][1], (name, ready)
            else:
                assert seen[name] == ("ready", []) and lost == 0, (name, ready)
        send_round()
        for client in clients.values():
            client.close(timeout_seconds=30)  # asks the agent to checkpoint, then releases
        # a run that ended while its agent was away left its spool: the next `kvscope up` sends it
        orphans = tmp_path / "spool"
        orphan = TelemetryClient(f"http://127.0.0.1:{free_port()}", "e-orphan", spool_path=orphans / "e-orphan.spool", timeout_seconds=0.2)
        for i in range(120):
            orphan.emit(stats("e-orphan", i))
        orphan.close(timeout_seconds=1)
        assert orphan.spooled_events == 120 and (orphans / "e-orphan.spool").stat().st_size > 0
        assert drain_earlier_spools(orphans, url, current_engine_id="e-this-run") == 120
        assert list(orphans.iterdir()) == []  # drained, durable, removed
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    # the damages that lose batches were noticed and said so
    for name in ("flip a random byte", "flip another random byte", "header overwritten", "truncated by 37 bytes"):
        assert seen[name][0] == "degraded" and "acknowledged_batches_missing" in seen[name][1], (name, seen[name])
    assert seen["garbage appended"] == ("ready", []), details["garbage appended"]
    for engine, client in clients.items():
        assert client.dropped_events == 0 and client.rejected_events == 0, engine
        assert client.resent_events > 0, engine  # the losses were real and refilled by re-sending
        assert (tmp_path / f"{engine}.spool").stat().st_size == 0, engine  # all durable: released
    with Store.open(db) as store, store.cursor() as cur:
        for engine in ENGINES:
            ids = [r[0] for r in cur.execute("SELECT used_bytes FROM engine_stats WHERE engine_id = $e ORDER BY 1", {"e": engine}).fetchall()]
            assert ids == list(range(sent[engine])), engine  # every event sent, exactly once
        orphan_ids = [r[0] for r in cur.execute("SELECT used_bytes FROM engine_stats WHERE engine_id = 'e-orphan' ORDER BY 1").fetchall()]
        assert orphan_ids == list(range(120))


def _ask_checkpoint(url: str) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the agent is killed while it answers
        httpx.post(f"{url}/v1/ingest/checkpoint", params={"engine_id": "x"}, timeout=5)


def _sample(exposition: str, name: str) -> float:
    for line in exposition.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")
