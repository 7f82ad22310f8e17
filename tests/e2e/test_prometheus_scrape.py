"""A real Prometheus (Debian's ``prometheus`` package) scrapes a real agent on loopback, and a
PromQL query over the ``kvscope_`` lookup counters returns the recoverable hit rate per form;
``promtool check metrics`` accepts the agent's /metrics text.

Run it as ``make test`` does (``python -m pytest``): it imports the shared test helpers.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests.agent.agent_testdata import lookup_event
from tests.agent_process import ROOT, agent_command, agent_env
from tests.e2e.procs import start, stop, wait_for
from tests.helpers import free_port

pytestmark = pytest.mark.e2e

PROMETHEUS = shutil.which("prometheus") or ""
PROMTOOL = shutil.which("promtool") or ""
MISSING = "install Debian's `prometheus` package (`apt-get install prometheus`; `make test` does it as root)"

QUERY = (
    "sum by (form) (kvscope_lookup_recoverable_tokens_total)"
    " / sum by (form) (kvscope_lookup_hash_hit_tokens_total)"
)
EXPECTED = {"full_kv": 0.75, "linear_state": 0.5}
"""The recoverable hit rate per form of :func:`lookups` (exact binary fractions)."""

PROMETHEUS_YML = """\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: kvscope-agent
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


def lookups(ts: float) -> list[dict[str, Any]]:
    """full_kv: (600 + 900) / (800 + 1200) = 3/4; linear_state: (400 + 600) / (800 + 1200) = 1/2."""
    return [
        lookup_event(ts, "r1", hash_hit_tokens=800, usable_tokens=800, recoverable_tokens=600),
        lookup_event(
            ts,
            "r1",
            form="linear_state",
            outcome="replayed",
            reason="linear_checkpoint_missing",
            hash_hit_tokens=800,
            usable_tokens=600,
            recoverable_tokens=400,
            replayed_tokens=200,
            approximate=True,
        ),
        lookup_event(
            ts + 1,
            "r2",
            tier="host",
            outcome="recovered",
            reason="kv_evicted",
            hash_hit_tokens=1200,
            usable_tokens=1200,
            recoverable_tokens=900,
        ),
        lookup_event(
            ts + 1,
            "r2",
            form="linear_state",
            outcome="invalidated",
            reason="linear_checkpoint_missing",
            hash_hit_tokens=1200,
            usable_tokens=600,
            recoverable_tokens=600,
        ),
    ]


@pytest.mark.skipif(
    not PROMETHEUS or not PROMTOOL, reason=f"prometheus/promtool not found: {MISSING}"
)
def test_prometheus_scrapes_recoverable_hit_rate_per_form(tmp_path: Path) -> None:
    agent_port, prom_port = free_port(), free_port()
    agent_url = f"http://127.0.0.1:{agent_port}"
    prom_url = f"http://127.0.0.1:{prom_port}"
    agent: subprocess.Popen[bytes] | None = None
    prometheus: subprocess.Popen[bytes] | None = None
    passed = False
    try:
        agent = start(
            agent_command(agent_port, tmp_path / "data"),
            tmp_path / "agent.log",
            cwd=ROOT,
            env=agent_env(),
        )
        wait_for(
            "agent /readyz",
            agent,
            30,
            lambda: httpx.get(f"{agent_url}/readyz", timeout=1).status_code == 200,
        )
        body = {
            "schema_version": 1,
            "engine_id": "e1",
            "seq": 1,
            "sent_at": time.time(),
            "events": lookups(time.time() - 60),
        }
        response = httpx.post(
            f"{agent_url}/v1/events",
            content=msgspec.json.encode(body),
            headers={"content-type": "application/json"},
            timeout=10,
        )
        assert response.status_code == 200, response.text
        assert response.json() | {"agent_instance": None} == {"status": "stored", "events": 4, "seq": 1, "checkpoint_epoch": 1, "durable_seq": None, "agent_instance": None}, response.text

        exposition = httpx.get(f"{agent_url}/metrics", timeout=10)
        assert exposition.status_code == 200
        check = subprocess.run(
            [PROMTOOL, "check", "metrics"],
            input=exposition.content,
            capture_output=True,
            timeout=30,
        )
        problems = (check.stdout + check.stderr).decode().strip()
        assert check.returncode == 0 and not problems, (
            f"promtool (rc {check.returncode}):\n{problems}"
        )

        config = tmp_path / "prometheus.yml"
        config.write_text(PROMETHEUS_YML.format(port=agent_port))
        prometheus = start(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            tmp_path / "prometheus.log",
        )

        def per_form() -> dict[str, float] | None:
            r = httpx.get(f"{prom_url}/api/v1/query", params={"query": QUERY}, timeout=2)
            if r.status_code != 200:
                return None
            data = r.json()["data"]
            assert data["resultType"] == "vector", data
            got = {s["metric"]["form"]: float(s["value"][1]) for s in data["result"]}
            return got if got.keys() >= EXPECTED.keys() else None

        assert wait_for("PromQL result", prometheus, 60, per_form) == EXPECTED
        passed = True
    finally:
        stop(prometheus)
        stop(agent)
        if not passed:  # pytest shows this with the failure
            for log in sorted(tmp_path.glob("*.log")):
                print(f"--- {log.name} (tail) ---\n{log.read_text(errors='replace')[-4000:]}")
