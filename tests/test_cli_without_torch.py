"""The operators' commands run without torch: ``kvscope --help``, ``sql``, ``alerts``, ``agent``
and ``dashboard`` never import it (only the commands that run a model do, inside their functions).

Each case is a fresh interpreter (``sys.executable -c``) whose ``sys.modules`` maps ``torch`` and
``triton`` to ``None`` before ``kvscope.cli`` is imported, so any import of either raises
``ModuleNotFoundError`` and the command fails. Times are never asserted here
(``benchmarks/cli_start.py`` measures them).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 'import sys\nsys.modules["torch"] = None\nsys.modules["triton"] = None\n'
CLI = BLOCK + "import json\nfrom kvscope.cli import main\nmain(json.loads(sys.argv[1]))\n"
"""``main(argv)`` with torch blocked; its ``sys.exit`` code is the process's."""
GOLDEN = "tests/alerts/golden/indexer_sync_delay.yaml"
"""A short golden series (1 h) the shipped rules pass: IndexerSyncDelay fires at 22m, resolves at 39m."""


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVSCOPE_TOKEN", "KVSCOPE_AGENT_URL")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def kvscope(*argv: str) -> subprocess.CompletedProcess[str]:
    """``kvscope ARGV`` with torch blocked, from the repository root."""
    return subprocess.run(
        [sys.executable, "-c", CLI, json.dumps(argv)], cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--help"], ["usage: kvscope", "sql", "alerts", "dashboard"]),
        (["sql", "--help"], ["usage: kvscope sql", "--db DB", "(default: table)"]),
        (["agent", "--help"], ["usage: kvscope agent", "--data-dir", "--alert-rules"]),
        (["dashboard", "--help"], ["usage: kvscope dashboard", "(default: 8501)"]),
        (["alerts", "check", "alerts/default_rules.yaml", "alerts/default_notify.yaml"],
         ["alerts/default_rules.yaml: SUCCESS", "alerts/default_notify.yaml: SUCCESS: notification file"]),
        (["alerts", "export-prometheus", "alerts/default_rules.yaml"], ["groups:", "- alert: RecoverableHitRateDrop"]),
        (["alerts", "test", "alerts/default_rules.yaml", "--series", GOLDEN], ["22m  firing    IndexerSyncDelay{", "39m  resolved  IndexerSyncDelay{"]),
    ],
    ids=["help", "sql-help", "agent-help", "dashboard-help", "alerts-check", "alerts-export-prometheus", "alerts-test"],
)  # fmt: skip
def test_command_runs_without_torch(argv: list[str], expected: list[str]) -> None:
    done = kvscope(*argv)
    assert done.returncode == 0, done.stderr
    for text in expected:
        assert text in done.stdout, (text, done.stdout[-2000:])


def test_sql_on_a_file_runs_without_torch(tmp_path: Path) -> None:
    db = tmp_path / "empty.duckdb"
    duckdb.connect(str(db)).close()
    done = kvscope("sql", "SELECT 42 AS answer", "--db", str(db), "--format", "csv")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["answer", "42"]


def test_alerts_silence_runs_without_torch() -> None:
    """Nothing listens on the port: the command gets as far as the HTTP call and says so (status 2)."""
    done = kvscope("alerts", "silence", "--agent", f"http://127.0.0.1:{free_port()}", "list")
    assert done.returncode == 2, done.stderr
    assert "unreachable" in done.stderr
    assert "ModuleNotFoundError" not in done.stderr


def test_agent_starts_and_serves_without_torch(tmp_path: Path) -> None:
    port = free_port()
    argv = ["agent", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    with (tmp_path / "agent.log").open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", CLI, json.dumps(argv)], cwd=ROOT, env=environment(), stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 60
            ready = None
            while ready is None:
                assert process.poll() is None, (tmp_path / "agent.log").read_text()
                assert time.monotonic() < deadline, "/readyz never answered 200"
                try:
                    response = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
                    ready = response.json() if response.status_code == 200 else None
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
            assert ready["status"] == "ready"
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            assert "kvscope_ingest_batches_total" in metrics
            assert [line for line in metrics.splitlines() if "_created" in line] == []
        finally:
            process.terminate()
            code = process.wait(timeout=30)
    assert code == 0, (tmp_path / "agent.log").read_text()
    assert "checkpointed and closed" in (tmp_path / "agent.log").read_text()


def test_every_dashboard_module_imports_without_torch() -> None:
    """Every module of ``dashboard/`` but ``app.py`` (the Streamlit script: importing it runs the app)."""
    names = sorted(f"dashboard.{p.stem}" for p in (ROOT / "dashboard").glob("*.py") if p.stem not in ("__init__", "app"))
    assert {"dashboard.overview", "dashboard.forms_page", "dashboard.requests_page", "dashboard.alerts_page",
            "dashboard.sql_page", "dashboard.capacity_page", "dashboard.pages"} <= set(names)  # fmt: skip
    code = BLOCK + "import importlib\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint('imported', len(sys.argv) - 1)\n"
    done = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["imported", str(len(names))]
