"""The command line that starts the dashboard (what ``kvscope dashboard`` / ``kvscope up`` spawn),
and :func:`run_dashboard`, which runs it in the foreground for ``kvscope dashboard``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from engine.parent_death import preexec_die_with_parent

APP_PATH = Path(__file__).resolve().parent / "app.py"
"""The Streamlit entry script."""


def streamlit_command(agent_url: str, port: int, address: str = "127.0.0.1") -> list[str]:
    """``python -m streamlit run <app.py> --server.headless true --server.port P
    --server.address A --browser.gatherUsageStats false --client.toolbarMode minimal -- --agent
    URL``, with this interpreter (``minimal``: an operator's page has no "Deploy" button).

    Raises:
        ValueError: ``port`` outside 1..65535, or an empty ``agent_url``/``address``.
    """
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be in [1, 65535], got {port}")
    if not agent_url:
        raise ValueError("agent_url must not be empty")
    if not address:
        raise ValueError("address must not be empty")
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP_PATH),
        "--server.headless",
        "true",
        "--server.port",
        str(port),
        "--server.address",
        address,
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "minimal",
        "--",
        "--agent",
        agent_url,
    ]


STOP_GRACE_SECONDS = 10.0
"""How long :func:`run_dashboard` waits for Streamlit after forwarding a stop signal."""


def run_dashboard(agent_url: str, port: int, address: str = "127.0.0.1", *, grace_seconds: float = STOP_GRACE_SECONDS) -> int:
    """Run Streamlit (:func:`streamlit_command`) until it exits; returns its exit status (128 + N
    when signal N ended it).

    SIGTERM and SIGINT received here are forwarded to it; if it is still running
    ``grace_seconds`` after the first, it is SIGKILLed. If this process dies, SIGKILLed included,
    the kernel SIGKILLs it (:mod:`engine.parent_death`), so no Streamlit is left on ``port``.
    Call from the main thread (signal handlers; the parent-death signal follows the starting
    thread).

    Raises:
        ValueError: as :func:`streamlit_command`.
    """
    argv = streamlit_command(agent_url, port, address)
    process: subprocess.Popen[bytes] | None = None
    stop_deadline: list[float] = []  # set by the first stop signal

    def forward(sig: int, frame: FrameType | None) -> None:
        if not stop_deadline:
            stop_deadline.append(time.monotonic() + grace_seconds)
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        process = subprocess.Popen(
            argv, env={**os.environ, "KVSCOPE_AGENT_URL": agent_url}, preexec_fn=preexec_die_with_parent(signal.SIGKILL)
        )
        if stop_deadline:  # a signal came while it was starting
            process.send_signal(signal.SIGTERM)
        while process.poll() is None:
            if stop_deadline and time.monotonic() > stop_deadline[0]:
                print(f"kvscope dashboard: Streamlit still running {grace_seconds:g} s after the stop signal; killing it", file=sys.stderr, flush=True)
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(0.2)
    finally:
        if process is not None and process.poll() is None:  # an error here: leave nothing behind
            process.kill()
            process.wait(5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = process.returncode
    return code if code >= 0 else 128 - code
