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


def test_serve_runs_a_rule_file(tmp_path: Path) -> None:
    """With ``alert_rules_file`` the agent evaluates the file's groups on their schedules: an
    expr rule whose query returns a row fires into the log receiver."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "groups:\n  - name: fast\n    interval: 200ms\n    rules:\n"
        "      - alert: Always\n        expr: \"SELECT 'x' AS engine, 1.0 AS value\"\n"
        "        labels: {severity: info}\n        annotations: {summary: 'always {{ $labels.engine }}'}\n"
    )
    process = start_agent(free_port(), tmp_path / "data", rules=rules)
    try:
        log_file = tmp_path / "data" / "alerts.log"
        deadline = time.monotonic() + 20
        while not log_file.exists():
            assert time.monotonic() < deadline, "the rule file was not evaluated"
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert process.returncode == 0
    [line] = log_file.read_text().splitlines()
    assert '"annotations": {"summary": "always x"}' in line and '"status": "firing"' in line
