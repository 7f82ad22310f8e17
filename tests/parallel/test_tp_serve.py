"""``kvscope serve --tensor-parallel-size 2`` as a user runs it (its own process on loopback,
stopped by PID): it answers the ``openai`` client with what one rank computes, replays 20 weka
sessions with the cache's invariants checked on every rank after every step, reports its ranks on
``/health``, and once a rank dies answers 503 naming it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.trace.formats import TraceRequest, load_trace
from engine.trace.http_replay import replay_over_http
from engine.trace.replay import ReplayConfig
from tests.agent_process import wait_ready
from tests.helpers import free_port

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
WEKA_SLICE = ROOT / "kvscope" / "data" / "weka_slice" / "traces"
MODEL = "kvscope_hybrid-tiny"


def twenty_sessions() -> list[TraceRequest]:
    """The first two requests of the bundled slice's first 20 sessions (by arrival)."""
    sessions: dict[str, list[TraceRequest]] = {}
    for r in sorted(load_trace(WEKA_SLICE), key=lambda r: r.arrival_seconds):
        turns = sessions.setdefault(r.session_id, []) if len(sessions) < 20 or r.session_id in sessions else None
        if turns is not None and len(turns) < 2:
            turns.append(r)
    return [r for turns in sessions.values() for r in turns]


def test_a_two_rank_server_serves_replays_and_reports_a_dead_rank(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    command = [
        sys.executable, "-m", "kvscope", "serve", "--model", MODEL, "--port", str(port), "--device", "cpu",
        "--tensor-parallel-size", "2", "--check-invariants", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        server = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(server, port, timeout=120, path="/health")
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["status"] == "ok" and [r["rank"] for r in health["ranks"]] == [0, 1]
        assert all(r["alive"] for r in health["ranks"])

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.completions.create(model=MODEL, prompt="The cache", max_tokens=6, temperature=0.0)
        expected = LLM(MODEL, device="cpu").generate(["The cache"], SamplingParams(max_tokens=6, temperature=0.0))[0]
        assert answer.choices[0].text == expected.text and answer.usage.completion_tokens == 6

        chosen = twenty_sessions()
        config = ReplayConfig(block_tokens=1, speed=1e6, max_wait_seconds=0.0, max_output_tokens=2)
        result = asyncio.run(replay_over_http(url, chosen, config))
        assert result.sessions == 20 and result.requests == len(chosen) and result.skipped == 0
        assert result.cached_tokens > 0  # later turns resumed from the prefix cache on both ranks
        assert server.poll() is None, "the server stopped during the replay (an invariant failed on some rank?)"

        worker = next(r for r in health["ranks"] if r["rank"] == 1)
        os.kill(worker["pid"], signal.SIGKILL)
        for _ in range(100):  # bounded: the sentinel is seen as soon as the process is reaped
            dead = httpx.get(f"{url}/health", timeout=10)
            if dead.status_code == 503:
                break
            time.sleep(0.1)
        assert dead.status_code == 503 and dead.json()["rank"] == 1
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "again", "max_tokens": 2}, timeout=60)
        assert refused.status_code == 503 and "tensor-parallel rank" in refused.json()["error"]["message"]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert "Traceback" not in log_path.read_text(errors="replace").split("the engine thread stopped")[0]
