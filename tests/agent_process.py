"""A real agent process for tests: ``kvscope``'s ``serve`` on loopback, started with
``sys.executable`` and waited for on ``/readyz`` with a bounded loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
AGENT_SCRIPT = """
import json
import os
import sys
from pathlib import Path
from agent.config import AgentConfig
from agent.server import serve
rules = Path(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] else None
notify = Path(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] else None
extra = json.loads(os.environ.get("KVSCOPE_TEST_AGENT_CONFIG", "{}"))
serve(
    AgentConfig(host="127.0.0.1", port=int(sys.argv[1]), data_dir=Path(sys.argv[2]), alert_rules_file=rules, alert_notify_file=notify, **extra),
    log_level=sys.argv[3],
)
print("serve returned", flush=True)
"""


def agent_command(
    port: int, data: Path, log_level: str = "warning", rules: Path | None = None, notify: Path | None = None
) -> list[str]:
    """The command line of an agent on 127.0.0.1:``port`` storing under ``data`` (with the rule
    file ``rules`` and the notification file ``notify`` when given, else the shipped ones)."""
    return [sys.executable, "-c", AGENT_SCRIPT, str(port), str(data), log_level, str(rules or ""), *([str(notify)] if notify else [])]


def agent_env(config: dict[str, Any] | None = None) -> dict[str, str]:
    """The environment for it: this checkout importable, no token, one intra-op thread.

    One thread: torch's CPU kernels spin-wait in every intra-op thread, so on a 2-core machine
    shared with the test runner and other services a two-thread replay ran 4-5 times slower than a
    one-thread one (27 vs 125 requests in 60 s with three busy loops beside it); alone the two
    differ by about 10 %.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("KVSCOPE_TOKEN", None)
    env.pop("KVSCOPE_TEST_AGENT_CONFIG", None)
    if config:  # more AgentConfig fields (JSON values)
        env["KVSCOPE_TEST_AGENT_CONFIG"] = json.dumps(config)
    return env


def start_agent(
    port: int,
    data: Path,
    *,
    log_level: str = "warning",
    rules: Path | None = None,
    notify: Path | None = None,
    config: dict[str, Any] | None = None,
    **popen: Any,
) -> subprocess.Popen[Any]:
    """Start an agent (output to DEVNULL unless ``popen`` says otherwise; ``config``: more
    ``AgentConfig`` fields) and wait until ready."""
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("stderr", subprocess.DEVNULL)
    process = subprocess.Popen(agent_command(port, data, log_level, rules, notify), cwd=ROOT, env=agent_env(config), **popen)
    wait_ready(process, port)
    return process


def wait_ready(process: subprocess.Popen[Any], port: int, timeout: float = 60, path: str = "/readyz") -> None:
    """Poll ``path`` (the agent's ``/readyz``; ``kvscope serve``'s ``/health``) until 200; fail if
    the process exits or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, f"the process exited during start-up ({process.returncode})"
        assert time.monotonic() < deadline, f"{path} never answered 200"
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
