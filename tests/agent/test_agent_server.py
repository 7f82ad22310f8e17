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


def test_sigkilled_agent_leaves_no_decode_workers(tmp_path: Path) -> None:
    """The agent decodes batches in worker processes; killed with SIGKILL (no cleanup runs), it
    must not leave them behind: each worker watches the agent's pid and exits."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVSCOPE_TOKEN", None)
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(port), str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, "the agent exited during start-up"
            assert time.monotonic() < deadline, "the agent did not become ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        descendants = _descendants(process.pid)
        assert len(descendants) >= 2, descendants  # the decode workers (and their forkserver)
        process.kill()
        process.wait(timeout=10)
        deadline = time.monotonic() + 15
        while alive := [pid for pid in descendants if _running(pid)]:
            assert time.monotonic() < deadline, f"processes left behind: {alive}"
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    found, frontier = [], [root]
    while frontier:
        current = frontier.pop()
        children = [pid for pid, parent in parents.items() if parent == current]
        found.extend(children)
        frontier.extend(children)
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
