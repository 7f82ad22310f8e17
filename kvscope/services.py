"""Child processes of ``kvscope up``: start them with their output in a log file, wait until they
answer, stop them by PID (SIGTERM, then SIGKILL after a grace period)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx


class ServiceError(RuntimeError):
    """A child process failed to start or to become ready; the message includes its log tail."""


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now (SO_REUSEADDR, as uvicorn and
    Streamlit bind, so a closed connection lingering in TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_seconds: float = 10.0) -> None:
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)


class ServiceGroup:
    """Processes started together and stopped together (in reverse start order)."""

    def __init__(self) -> None:
        self.services: list[Service] = []

    def start(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> Service:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # its own process group: a stop reaches its children too
            )
        service = Service(name, process, log_path)
        self.services.append(service)
        return service

    def wait_http_ok(self, service: Service, url: str, timeout_seconds: float) -> None:
        """Poll ``url`` until it answers 2xx; bounded by ``timeout_seconds``.

        Raises:
            ServiceError: the process exited, or the deadline passed.
        """
        deadline = time.monotonic() + timeout_seconds
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if not service.alive():
                    raise ServiceError(
                        f"{service.name} exited with code {service.process.returncode}; "
                        f"last lines of {service.log_path}:\n{log_tail(service.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url).is_success:
                        return
                time.sleep(0.2)
        raise ServiceError(
            f"{service.name} did not answer {url} within {timeout_seconds:.0f} s; "
            f"last lines of {service.log_path}:\n{log_tail(service.log_path)}"
        )

    def stop_all(self) -> None:
        for service in reversed(self.services):
            service.stop()
        self.services.clear()
