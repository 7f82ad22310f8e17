"""The alert drill against a real Alertmanager (Debian's ``prometheus-alertmanager``), test-sized:
``kvscope up --drill`` with the tiny model measures the machine's replay rate, derives its
second-scale drop rule and ``swa_window`` squeeze from it (:mod:`kvscope.drill`), and the page
reaches a webhook the test runs, through Alertmanager, within two evaluation intervals of the
evaluation that fired it; the resolve arrives after the pool is released and the hit rate
recovers, and the drill then ends the replay by itself. Everything listens on 127.0.0.1 and is
stopped by PID.

Run it as ``make test`` does (``python -m pytest``): it imports the shared test helpers.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.agent_process import ROOT, agent_env
from tests.e2e.procs import start, stop, wait_for
from tests.helpers import free_port

pytestmark = pytest.mark.e2e

ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager") or ""
MISSING = "install Debian's `prometheus-alertmanager` package (`apt-get install prometheus-alertmanager`; `make test` does it as root)"

DRILL_NOTIFY = ROOT / "alerts" / "examples" / "drill_notify.yaml"
ALERTMANAGER_YML = """\
route:
  receiver: hook
  group_by: [alertname, engine]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: hook
    webhook_configs:
      - url: http://127.0.0.1:{port}/hook
        send_resolved: true
"""
DRILL_WITHIN = 600
"""Seconds the whole drill may take (about 110 s on an idle 2-core machine with the tiny model)."""


class Hook:
    """The on-call webhook: records (arrival time, Alertmanager's webhook payload)."""

    def __init__(self) -> None:
        self.received: list[tuple[float, dict[str, Any]]] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                hook.received.append((time.time(), json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def alerts(self, status: str) -> list[tuple[float, dict[str, Any]]]:
        return [(at, a) for at, body in self.received for a in body["alerts"] if a["status"] == status]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.skipif(not ALERTMANAGER, reason=f"Alertmanager not found: {MISSING}")
def test_the_drill_pages_through_alertmanager_and_resolves(tmp_path: Path) -> None:
    hook = Hook()
    am_port, agent_port = free_port(), free_port()
    (tmp_path / "alertmanager.yml").write_text(ALERTMANAGER_YML.format(port=hook.port))
    notify = yaml.safe_load(DRILL_NOTIFY.read_text())
    notify["alertmanagers"] = [{"url": f"http://127.0.0.1:{am_port}"}]
    (tmp_path / "notify.yaml").write_text(yaml.safe_dump(notify))
    data = tmp_path / "data"
    alertmanager = up = None
    try:
        alertmanager = start(
            [
                ALERTMANAGER,
                f"--config.file={tmp_path / 'alertmanager.yml'}",
                f"--storage.path={tmp_path / 'am'}",
                f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address=",
            ],
            tmp_path / "alertmanager.log",
        )
        wait_for(
            "alertmanager /-/ready", alertmanager, 30,
            lambda: httpx.get(f"http://127.0.0.1:{am_port}/-/ready", timeout=1).status_code == 200,
        )  # fmt: skip
        up = start(
            [
                sys.executable, "-m", "kvscope", "up", "--no-dashboard", "--exit-when-done", "--json", "--drill",
                "--model", "kvscope_hybrid-tiny", "--data-dir", str(data), "--agent-port", str(agent_port),
                "--alert-notify", str(tmp_path / "notify.yaml"),
            ],
            tmp_path / "up.log",
            cwd=ROOT,
            env=agent_env(),
        )  # fmt: skip
        try:  # bounded: the drill ends the replay once the alert resolved (or its deadline passed)
            up_rc = up.wait(timeout=DRILL_WITHIN)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the drill did not end within {DRILL_WITHIN} s: {_progress(tmp_path)}")
        time.sleep(3)  # anything more from Alertmanager (a second page, a second resolve) would arrive now
    finally:
        stop(up)
        stop(alertmanager)
        hook.close()
    log = (tmp_path / "up.log").read_text()
    assert up_rc == 0, log[-3000:]
    drill = json.loads(next(line for line in log.splitlines() if line.startswith("{")))["drill"]
    assert drill["failure"] is None, drill
    rules = yaml.safe_load((data / "drill_rules.yaml").read_text())["groups"][0]
    interval = float(rules["interval"].removesuffix("s"))
    assert interval == drill["plan"]["interval_seconds"] and rules["rules"][0]["window"] == f"{drill['plan']['window_seconds']}s"
    squeezed_at = _clock(log, "squeezed to 0 cached pages")
    released_at = _clock(log, "released")
    assert abs(squeezed_at - drill["squeezed_at"]) < 1 and abs(released_at - drill["released_at"]) < 1
    transitions = [json.loads(line) for line in (data / "alerts.log").read_text().splitlines()]
    assert [t["status"] for t in transitions] == ["firing", "resolved"], transitions
    fired, resolved = transitions
    assert fired["value"] < 0.2 and fired["labels"]["severity"] == "page"
    assert squeezed_at < fired["at"] < released_at  # it fired during the squeeze ...
    assert resolved["at"] > released_at  # ... and resolved only once the pool was released
    assert drill["detection_seconds"] == pytest.approx(fired["at"] - squeezed_at, abs=1.0)
    assert drill["resolve_seconds"] == pytest.approx(resolved["at"] - released_at, abs=1.0)
    # the page: one firing alert through Alertmanager, within two evaluation intervals (plus
    # Alertmanager's own group_wait of 1 s) of the evaluation that fired it after `for`
    firing = hook.alerts("firing")
    assert firing, hook.received
    assert {a["labels"]["alertname"] for _, a in firing} == {"RecoverableHitRateDrop"}
    first_page = min(at for at, _ in firing)
    assert first_page - fired["at"] <= 2 * interval + 1.0, (first_page, fired["at"])
    assert firing[0][1]["labels"]["engine"] == fired["labels"]["engine"]
    assert "fell to" in firing[0][1]["annotations"]["summary"]
    # no page before the drill started, no second page for the same alert
    assert len({at for at, _ in firing}) == 1, [at for at, _ in firing]
    # the resolve arrives after recovery (the pool was released first)
    resolves = hook.alerts("resolved")
    assert len(resolves) == 1 and resolves[0][0] >= resolved["at"] > fired["at"]
    assert resolves[0][1]["labels"] == firing[0][1]["labels"]
    # and the agent's own log receiver got the same page and resolve once each
    notified = [json.loads(line) for line in (data / "notifications.jsonl").read_text().splitlines()]
    assert [n["status"] for n in notified] == ["firing", "resolved"]


def _progress(tmp_path: Path) -> str:
    """The replay's last progress line and the drill's lines, for a failure message."""
    lines = (tmp_path / "up.log").read_text().splitlines()
    return " | ".join([line for line in lines if "swa_window pool" in line] + [line.strip() for line in lines if "replay" in line][-1:])


def _clock(log: str, event: str) -> float:
    """The unix time ``kvscope up`` logged for a squeeze event (``... at 30 s (2026-...Z)``)."""
    match = re.search(rf"swa_window pool {event}.* at \d+ s \((\S+)Z\)", log)
    assert match, f"no '{event}' line in the log"
    return datetime.fromisoformat(match.group(1)).replace(tzinfo=UTC).timestamp()
