"""serve(): a real agent process answers, and SIGTERM/SIGINT shut it down cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from agent_testdata import batch, json_body, known_events, minute_start

from agent.store import Store

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from pathlib import Path
from agent.config import AgentConfig
from agent.server import serve
serve(AgentConfig(port=int(sys.argv[1]), data_dir=Path(sys.argv[2])), log_level="warning")
print("serve returned", flush=True)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_stores_events_and_shuts_down_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVSCOPE_TOKEN", None)
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(port), str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the agent did not become ready"
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        response = httpx.post(
            f"{url}/v1/events",
            content=json_body(batch(1, known_events(minute_start()))),
            headers={"content-type": "application/json"},
        )
        assert response.json() == {"status": "stored", "events": 8}
        process.send_signal(sig)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert stdout == "serve returned\n"
    assert not (tmp_path / "kvscope.duckdb.wal").exists()  # checkpointed on shutdown
    with Store.open(tmp_path / "kvscope.duckdb") as store, store.cursor() as cur:
        assert cur.execute("SELECT count(*) FROM requests").fetchall() == [(2,)]
