"""serve(): a real agent process answers, and SIGTERM/SIGINT shut it down cleanly."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
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
        assert response.json() | {"agent_instance": None} == {"status": "stored", "events": 8, "seq": 1, "checkpoint_epoch": 1, "durable_seq": None, "agent_instance": None}
        process.send_signal(sig)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):  # its workers may hold the pipes a while
                process.communicate(timeout=30)
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


def test_serve_runs_a_rule_file_routes_and_silences(tmp_path: Path) -> None:
    """The agent evaluates the rule file's groups on their schedules and routes what fires: an
    expr rule whose query returns two rows fires two alerts into the transition log and, through
    the notification file's route, into its log receiver. A silence created with
    ``kvscope alerts silence add`` mutes one of them; ``list`` shows it; ``expire`` ends it."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "groups:\n  - name: fast\n    interval: 200ms\n    rules:\n"
        "      - alert: Always\n        expr: \"SELECT unnest(['x', 'y']) AS engine, 1.0 AS value\"\n"
        "        for: 8s\n"  # time for the CLI to create the silence before anything fires
        "        labels: {severity: info}\n        annotations: {summary: 'always {{ $labels.engine }}'}\n"
    )
    notify = tmp_path / "notify.yaml"
    notify.write_text(
        "route: {receiver: log, group_by: [engine], group_wait: 1s, group_interval: 1s, repeat_interval: 1h}\n"
        "receivers: [{name: log, log_configs: [{path: notifications.jsonl}]}]\n"
    )
    port = free_port()
    cli = [sys.executable, "-m", "kvscope", "alerts", "silence", "--agent", f"http://127.0.0.1:{port}"]
    process = start_agent(port, tmp_path / "data", rules=rules, notify=notify)
    try:
        added = subprocess.run(
            [*cli, "add", 'engine="y"', "--duration", "1h", "--comment", "test", "--author", "me"],
            cwd=ROOT, env=agent_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
        silence_id = added.stdout.strip()
        sent = tmp_path / "data" / "notifications.jsonl"
        deadline = time.monotonic() + 20
        while not sent.exists():
            assert time.monotonic() < deadline, "the rule file was not evaluated and routed"
            time.sleep(0.05)
        time.sleep(3)  # several group intervals: y would have been routed by now, were it not silenced
        assert [json.loads(line)["groupLabels"] for line in sent.read_text().splitlines()] == [{"engine": "x"}]
        active = httpx.get(f"http://127.0.0.1:{port}/v1/alerts", timeout=10).json()["alerts"]
        assert [(a["alertname"], a["state"], a["labels"]["engine"], a["annotations"]["summary"]) for a in active] == [
            ("Always", "firing", "x", "always x"),
            ("Always", "firing", "y", "always y"),  # silenced alerts still fire; only their notifications are muted
        ]
        listed = subprocess.run(  # --agent after the subcommand works too
            [*cli[:-2], "list", "--agent", f"http://127.0.0.1:{port}"], cwd=ROOT, env=agent_env(), capture_output=True, text=True, timeout=60
        )
        assert silence_id in listed.stdout and "active" in listed.stdout and 'engine="y"' in listed.stdout
        expired = subprocess.run([*cli, "expire", silence_id], cwd=ROOT, env=agent_env(), capture_output=True, text=True, timeout=60)
        assert expired.returncode == 0 and f"expired {silence_id}" in expired.stdout
        bad = subprocess.run([*cli, "add", "engine", "--comment", "c"], cwd=ROOT, env=agent_env(), capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "is not a matcher" in bad.stderr
        deadline = time.monotonic() + 20
        while len(sent.read_text().splitlines()) < 2:  # y is routed once its silence ended
            assert time.monotonic() < deadline, "the alert was not routed after its silence expired"
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert process.returncode == 0
    transitions = [json.loads(line) for line in (tmp_path / "data" / "alerts.log").read_text().splitlines()]
    assert sorted((t["labels"]["engine"], t["status"], t["annotations"]["summary"]) for t in transitions) == [
        ("x", "firing", "always x"),
        ("y", "firing", "always y"),
    ]
    notified = [json.loads(line) for line in sent.read_text().splitlines()]
    assert [(n["groupLabels"], n["status"], [a["labels"]["alertname"] for a in n["alerts"]]) for n in notified] == [
        ({"engine": "x"}, "firing", ["Always"]),
        ({"engine": "y"}, "firing", ["Always"]),
    ]
