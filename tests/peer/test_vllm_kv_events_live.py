"""Issue 26, item 4, against a real vLLM: its CPU build runs a tiny Qwen3-Next with its ZMQ
KV-event publisher on (``vllm_kv_events_run.py`` in ``.venv-vllm``), a real agent process
subscribes (``vllm_kv_events`` / ``vllm_kv_events_replay``), and the agent's ``block_events``
hold one row per block hash the run published. Skips without ``make peer-vllm``."""

from __future__ import annotations

import base64
import json
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import msgspec
import pytest

from tests.agent_process import ROOT, start_agent
from tests.helpers import free_port

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's CPU build is not installed: run `make peer-vllm`")


def hash_rows(path: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for message in json.loads(path.read_text())["messages"]:
        for event in msgspec.msgpack.decode(base64.b64decode(message["payload"]))[1]:
            if event["type"] in ("BlockStored", "BlockRemoved"):
                counts[event["type"]] += len(event["block_hashes"])
    return counts


def test_a_real_vllm_runs_events_reach_the_agent_once(tmp_path: Path) -> None:
    pub, replay, port = free_port(), free_port(), free_port()
    agent = start_agent(
        port, tmp_path / "data",
        config={"vllm_kv_events": f"tcp://127.0.0.1:{pub}", "vllm_kv_events_replay": f"tcp://127.0.0.1:{replay}", "vllm_engine_id": "vllm-live"},
    )  # fmt: skip
    try:
        out = tmp_path / "published.json"
        run = subprocess.run(
            [str(VLLM_PYTHON), str(ROOT / "tests/peer/vllm_kv_events_run.py"), str(out), "--pub", f"tcp://127.0.0.1:{pub}", "--replay", f"tcp://127.0.0.1:{replay}"],
            cwd=ROOT, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        published = hash_rows(out)
        assert published["BlockStored"] > 0, run.stdout
        query = "SELECT action, count(*) FROM block_events WHERE engine_id = 'vllm-live' GROUP BY action"
        deadline = time.monotonic() + 30
        while True:
            stored = dict(httpx.post(f"http://127.0.0.1:{port}/v1/sql", json={"sql": query}, timeout=10).json()["rows"])
            if stored.get("stored") == published["BlockStored"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert stored.get("stored", 0) == published["BlockStored"]
        assert stored.get("removed", 0) == published["BlockRemoved"]
    finally:
        agent.terminate()
        agent.wait(30)
