"""Processes the e2e tests run (Prometheus, Alertmanager, agents, kvscope up): start one in its
own process group with its output in a log file, poll it with a bounded loop, stop it by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


def wait_for(
    what: str, proc: subprocess.Popen[bytes], timeout: float, probe: Callable[[], Any]
) -> Any:
    """Poll ``probe`` until it returns something truthy; fail if ``proc`` dies or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"{what}: the process exited with {proc.returncode}"
        try:
            result = probe()
        except httpx.TransportError:
            result = None
        if result:
            return result
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.1)


def start(cmd: list[str], log: Path, **kwargs: Any) -> subprocess.Popen[bytes]:
    """``cmd`` in its own process group, stdout and stderr to ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **kwargs,
        )


def stop(proc: subprocess.Popen[bytes] | None, grace: float = 10) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL after ``grace`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
            return
