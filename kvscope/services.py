"""Child processes of ``kvscope up``: start them with their output in a log file, wait until they
answer, stop them by PID (SIGTERM, then SIGKILL after a grace period).

Each child runs in its own process group (a stop reaches its children too) and, unless told
otherwise, receives SIGKILL from the kernel when ``kvscope up`` dies, SIGKILLed included
(:mod:`engine.parent_death`): nothing is left listening on its port. The agent is the exception:
it watches its parent itself (``--exit-with-parent``) and shuts down as on SIGTERM, so what it
ingested is checkpointed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.parent_death import preexec_die_with_parent


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
    """One started child: its name, process and log file."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_seconds: float = 10.0) -> None:
        """SIGTERM to its process group; SIGKILL after ``grace_seconds`` (bounded: at most
        ``grace_seconds`` + 5 s)."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)

    def kill(self) -> None:
        """SIGKILL to its process group at once (nothing waited for)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)


class ServiceGroup:
    """Processes started together and stopped together (in reverse start order)."""

    def __init__(self) -> None:
        self.services: list[Service] = []

    def start(
        self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None,
        *, parent_death_signal: int | None = signal.SIGKILL,
    ) -> Service:  # fmt: skip
        """Start ``argv`` (output appended to ``log_path``). The kernel sends it
        ``parent_death_signal`` when this process dies (None: nothing; the child watches its
        parent itself). Call from the main thread: the signal fires when the starting thread
        exits."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        preexec = None if parent_death_signal is None else preexec_die_with_parent(parent_death_signal)
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # its own process group: a stop reaches its children too
                preexec_fn=preexec,
            )
        service = Service(name, process, log_path)
        self.services.append(service)
        return service

    def wait_http_ok(self, service: Service, url: str, timeout_seconds: float, stop: threading.Event | None = None) -> None:
        """Poll ``url`` until it answers 2xx; bounded by ``timeout_seconds``.

        Raises:
            ServiceError: the process exited, the deadline passed, or ``stop`` was set (a
                SIGTERM while waiting).
        """
        deadline = time.monotonic() + timeout_seconds
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if stop is not None and stop.is_set():
                    raise ServiceError(f"stopped while waiting for {service.name} to answer {url}")
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
        """Stop every service, the last started first (the agent, started first, stops last so
        what the others sent is flushed)."""
        try:
            for service in reversed(self.services):
                service.stop()
        except BaseException:  # a second Ctrl-C mid-stop: kill what is left, leave nothing behind
            for service in self.services:
                service.kill()
            raise
        finally:
            self.services.clear()
