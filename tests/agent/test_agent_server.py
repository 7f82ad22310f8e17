"""serve(): a real agent process answers, and SIGTERM/SIGINT shut it down cleanly."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from agent_testdata import batch, json_body, known_events, minute_start

from agent.store import Store
from tests.agent_process import ROOT, agent_command, agent_env, start_agent, wait_ready
from tests.helpers import free_port


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_stores_events_and_shuts_down_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    port = free_port()
    process = subprocess.Popen(
        agent_command(port, tmp_path),
        cwd=ROOT,
        env=agent_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(process, port)
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
    must not leave them behind: each worker watches the agent and exits."""
    process = start_agent(free_port(), tmp_path)
    try:
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
