"""Issue 19's acceptance against a real Alertmanager (Debian's ``prometheus-alertmanager``): an
agent whose alert fires and is pushed is killed (SIGKILL) shortly before an evaluation and
restarted after a pause longer than the lease it had before issue 19 (``lease_intervals``
intervals), and Alertmanager's webhook receives no ``resolved`` notification: the lease carries
the restart margin, and the restarted agent re-pushes its restored alert at start-up. The alert
stays active in Alertmanager throughout, and is not paged twice.

What each part shows: with ``restart_margin: 30s`` the margin alone keeps the alert here (the
first evaluation after the restart comes well within the lease), so the re-push is checked in the
restarted agent's log (INFO): its line for the restored alert comes before the group's first run
(APScheduler's ``Running job`` line), and no push failed. ``tests/alerts/test_restart_resend.py``
checks what the re-push sends.

Intervals are second-scale; everything listens on 127.0.0.1 and is stopped by PID.
"""

from __future__ import annotations

import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.agent_process import ROOT, agent_command, agent_env, wait_ready
from tests.e2e.procs import start, stop, wait_for
from tests.e2e.test_alertmanager import ALERTMANAGER, MISSING, Hook
from tests.helpers import free_port

pytestmark = pytest.mark.e2e

INTERVAL = 2.0
LEASE_INTERVALS = 2
OLD_LEASE = LEASE_INTERVALS * INTERVAL
"""The lease before issue 19: ``lease_intervals`` intervals, nothing for a restart (4 s)."""
KILL_BEFORE = 0.5
"""The kill comes this long before an evaluation is due (its push ``INTERVAL - KILL_BEFORE`` old)."""
PAUSE = OLD_LEASE
"""How long the agent stays dead before it is started again (then it takes seconds to start): the
old lease would have run out ``KILL_BEFORE`` seconds after the kill's last push was an interval
old, 2.5 s into the pause, and Alertmanager resolved the alert then."""
RULES = {
    "groups": [
        {
            "name": "restart",
            "interval": f"{INTERVAL:g}s",
            "rules": [
                {
                    "alert": "AlwaysFiring",
                    "expr": "SELECT 'e1' AS engine, 1.0 AS value",
                    "labels": {"severity": "page"},
                    "annotations": {"summary": "fires as long as the agent runs"},
                }
            ],
        }
    ]
}
LOGGING = "import logging; logging.basicConfig(level=logging.INFO, format='%(asctime)s %(levelname)s %(name)s: %(message)s')\n"
"""Prepended to the agent's script: its INFO lines (the re-push, APScheduler's job runs) in its log."""
REPUSHED = "rule group restart: 1 restored alert(s) re-pushed to the Alertmanagers"
FIRST_RUN = 'Running job "kvscope rule group restart'
ALERTMANAGER_YML = """\
route: {receiver: hook, group_by: [alertname], group_wait: 1s, group_interval: 1s, repeat_interval: 1h}
receivers:
  - name: hook
    webhook_configs: [{url: "http://127.0.0.1:{port}/hook", send_resolved: true}]
"""


def am_alerts(port: int) -> list[dict[str, Any]]:
    """Alertmanager's alerts named AlwaysFiring (``GET /api/v2/alerts``: not yet resolved)."""
    found = httpx.get(f"http://127.0.0.1:{port}/api/v2/alerts", timeout=2).json()
    return [a for a in found if a["labels"].get("alertname") == "AlwaysFiring"]


def updated_at(port: int) -> float | None:
    """When Alertmanager last received the alert (unix seconds), None while it has none."""
    found = am_alerts(port)
    return datetime.fromisoformat(found[0]["updatedAt"].replace("Z", "+00:00")).timestamp() if found else None


@pytest.mark.skipif(not ALERTMANAGER, reason=f"Alertmanager not found: {MISSING}")
def test_a_restart_just_before_an_evaluation_sends_no_false_resolve(tmp_path: Path) -> None:
    hook = Hook()
    am_port, agent_port = free_port(), free_port()
    (tmp_path / "alertmanager.yml").write_text(ALERTMANAGER_YML.replace("{port}", str(hook.port)))
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(RULES))
    notify = {
        "route": {"receiver": "null"},
        "receivers": [{"name": "null"}],
        "alertmanagers": [{"url": f"http://127.0.0.1:{am_port}"}],
        "delivery": {"lease_intervals": LEASE_INTERVALS, "restart_margin": "30s"},
    }
    (tmp_path / "notify.yaml").write_text(yaml.safe_dump(notify))
    data = tmp_path / "data"
    alertmanager = agent = None

    def run_agent(log: str) -> subprocess.Popen[Any]:
        python, flag, script, *args = agent_command(agent_port, data, "info", tmp_path / "rules.yaml", tmp_path / "notify.yaml")
        with (tmp_path / log).open("wb") as out:
            process = subprocess.Popen(
                [python, flag, LOGGING + script, *args], cwd=ROOT, env=agent_env(), stdout=out, stderr=subprocess.STDOUT
            )
        wait_ready(process, agent_port)
        return process

    try:
        alertmanager = start(
            [
                ALERTMANAGER, f"--config.file={tmp_path / 'alertmanager.yml'}", f"--storage.path={tmp_path / 'am'}",
                f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address=",
            ],
            tmp_path / "alertmanager.log",
        )  # fmt: skip
        agent = run_agent("agent-1.log")  # while Alertmanager starts
        wait_for(
            "alertmanager /-/ready", alertmanager, 30,
            lambda: httpx.get(f"http://127.0.0.1:{am_port}/-/ready", timeout=1).status_code == 200,
        )  # fmt: skip
        seen = wait_for("the first push", alertmanager, 30, lambda: updated_at(am_port))
        # the next evaluation pushed just now (Alertmanager's updatedAt moved): kill the agent
        # shortly before the one after, so its last lease is as old as it gets
        wait_for("a second push", alertmanager, 10, lambda: updated_at(am_port) != seen)
        time.sleep(INTERVAL - KILL_BEFORE)
        agent.kill()
        agent.wait(10)
        time.sleep(PAUSE)
        restarted_at = time.time()
        agent = run_agent("agent-2.log")
        wait_for("a push after the restart", alertmanager, 20, lambda: (updated_at(am_port) or 0) > restarted_at)
        wait_for("the first evaluation after the restart", agent, 20, lambda: FIRST_RUN in (tmp_path / "agent-2.log").read_text())
        time.sleep(1.5)  # a resolve or a second page (Alertmanager's 1 s group_interval) would be in by now
        active = am_alerts(am_port)
    finally:
        if agent is not None:
            agent.kill()
            agent.wait(10)
        stop(alertmanager)
        hook.close()
    restarted = (tmp_path / "agent-2.log").read_text()
    # the restored alert was re-pushed at start-up, before the group's first evaluation, and no push failed
    assert REPUSHED in restarted and restarted.index(REPUSHED) < restarted.index(FIRST_RUN), restarted
    assert "push to Alertmanager" not in restarted and "re-pushing the restored alerts failed" not in restarted, restarted
    assert hook.alerts("resolved") == [], hook.received
    assert len(hook.received) == 1 and hook.alerts("firing"), hook.received  # one page, none again after the restart
    [alert] = active
    assert alert["status"]["state"] == "active"
    assert datetime.fromisoformat(alert["endsAt"].replace("Z", "+00:00")).timestamp() > time.time()
