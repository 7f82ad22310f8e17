"""Issue 7's acceptance against a real Alertmanager (Debian's ``prometheus-alertmanager``): a
recoverable-hit-rate drop injected into a running ``kvscope up`` (the ``swa_window`` pool
squeezed to no cached pages, so evictions start and no resume point survives) reaches a webhook
the test runs, through Alertmanager, within two evaluation intervals after the rule's ``for``;
its resolve arrives after the pool is released and the hit rate recovers. Intervals are
second-scale; everything listens on 127.0.0.1 and is stopped by PID.

Run it as ``make test`` does (``python -m pytest``): it imports the shared test helpers.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
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

DRILL = ROOT / "alerts" / "examples"
INTERVAL = 1.0
"""The drill rule group's interval (alerts/examples/drill_rules.yaml)."""
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
SQUEEZE_AT, SQUEEZE_FOR = 30, 25
RESOLVE_WITHIN = 240
"""Seconds from the pool's release to the resolve at the webhook (about 35 s on an idle machine)."""


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
def test_a_squeezed_window_pool_pages_through_alertmanager_and_resolves(tmp_path: Path) -> None:
    hook = Hook()
    am_port, agent_port = free_port(), free_port()
    (tmp_path / "alertmanager.yml").write_text(ALERTMANAGER_YML.format(port=hook.port))
    notify = yaml.safe_load((DRILL / "drill_notify.yaml").read_text())
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
                sys.executable, "-m", "kvscope", "up", "--no-dashboard", "--exit-when-done", "--json",
                "--data-dir", str(data), "--agent-port", str(agent_port), "--max-requests", "1000",
                "--alert-rules", str(DRILL / "drill_rules.yaml"), "--alert-notify", str(tmp_path / "notify.yaml"),
                "--squeeze-window-pool", f"{SQUEEZE_AT}:{SQUEEZE_FOR}",
            ],
            tmp_path / "up.log",
            cwd=ROOT,
            env=agent_env(),
        )  # fmt: skip
        # bounded: the squeeze ends SQUEEZE_AT + SQUEEZE_FOR wall seconds into the replay whatever
        # the machine's load; the resolve then needs the sessions to come back to the re-filled
        # pool, which a slowed replay does proportionally later, hence the wide second bound
        deadline, released = time.monotonic() + 300, False
        while not hook.alerts("resolved"):
            assert up.poll() is None, f"kvscope up ended before the resolve reached the webhook: {_progress(tmp_path)}"
            if not released and "pool released" in (tmp_path / "up.log").read_text():
                deadline, released = time.monotonic() + RESOLVE_WITHIN, True
            assert time.monotonic() < deadline, f"no resolve reached the webhook: {_progress(tmp_path)}"
            time.sleep(0.2)
        time.sleep(3)  # anything more (a second page, a second resolve) would arrive now
        up.send_signal(signal.SIGTERM)  # stop the replay: it prints its summary and stops the agent
        up_rc = up.wait(timeout=180)
    finally:
        stop(up)
        stop(alertmanager)
        hook.close()
    log = (tmp_path / "up.log").read_text()
    assert up_rc == 0, log[-3000:]
    squeezed_at = _clock(log, "squeezed to 0 cached pages")
    released_at = _clock(log, "released")
    transitions = [json.loads(line) for line in (data / "alerts.log").read_text().splitlines()]
    assert [t["status"] for t in transitions] == ["firing", "resolved"], transitions
    fired, resolved = transitions
    assert fired["value"] < 0.2 and fired["labels"]["severity"] == "page"
    assert squeezed_at < fired["at"] < released_at  # it fired during the squeeze ...
    assert resolved["at"] > released_at  # ... and resolved only once the pool was released
    # the page: one firing alert through Alertmanager, within two evaluation intervals (plus
    # Alertmanager's own group_wait of 1 s) of the evaluation that fired it after `for`
    firing = hook.alerts("firing")
    assert firing, hook.received
    assert {a["fingerprint"] for _, a in firing} and {a["labels"]["alertname"] for _, a in firing} == {"RecoverableHitRateDrop"}
    first_page = min(at for at, _ in firing)
    assert first_page - fired["at"] <= 2 * INTERVAL + 1.0, (first_page, fired["at"])
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
