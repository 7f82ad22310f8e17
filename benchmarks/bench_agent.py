"""A real agent process for the benchmarks: start it on loopback, ask it SQL and metrics, read
its CPU time, stop it."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
AGENT_SCRIPT = """
import dataclasses, sys
from pathlib import Path
from agent.config import AgentConfig, load_config
from agent.server import serve
base = load_config(sys.argv[3]) if len(sys.argv) > 3 else AgentConfig()
serve(dataclasses.replace(base, port=int(sys.argv[1]), data_dir=Path(sys.argv[2])), log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_agent(port: int, data: Path, log_path: Path, config: Path | None = None) -> subprocess.Popen[bytes]:
    return launch_agent(AGENT_SCRIPT, [str(port), str(data), *([str(config)] if config else [])], port, log_path)


def launch_agent(script: str, args: list[str], port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """Run ``python -c script *args`` (an agent on 127.0.0.1:``port``, stderr to ``log_path``)
    and wait, at most 60 s, until its ``/readyz`` answers 200."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVSCOPE_TOKEN", None)
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log_file,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the agent exited during start-up:\n{log_path.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            stop_agent(process)
            raise RuntimeError("the agent did not become ready within 60 s")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process
        time.sleep(0.05)


def stop_agent(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def sql_rows(base: str, query: str) -> list[list[Any]]:
    resp = httpx.post(f"{base}/v1/sql", json={"sql": query}, timeout=60)
    resp.raise_for_status()
    rows: list[list[Any]] = resp.json()["rows"]
    return rows


def stored_counts(base: str) -> dict[str, int]:
    ((lookups,),) = sql_rows(base, "SELECT count(*) FROM cache_lookups")
    ((requests,),) = sql_rows(base, "SELECT count(*) FROM requests")
    ((batches, rows),) = sql_rows(
        base, "SELECT count(*), coalesce(sum(rows), 0) FROM ingest_batches WHERE status = 'stored'"
    )
    return {"cache_lookups": lookups, "requests": requests, "batches": batches, "batch_rows": rows}


METRIC_LINE = re.compile(
    r'^kvscope_ingest_batches_total\{status="([^"]*)"\}\s+(\S+)$', re.MULTILINE
)


def ingest_batches_metric(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {status: float(value) for status, value in METRIC_LINE.findall(text)}


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process and of all its live descendants (the agent's forkserver
    and decode workers), from /proc (None where that is not available)."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (parent, clock ticks)
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = path.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(path.parent.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    if pid not in stats:
        return None
    total, frontier = 0, [pid]
    while frontier:
        current = frontier.pop()
        total += stats[current][1]
        frontier.extend(p for p, (parent, _) in stats.items() if parent == current)
    return total / os.sysconf("SC_CLK_TCK")


_SAMPLE = re.compile(r'^([a-z_]+)(?:\{([^}]*)\})?\s+(\S+)$', re.MULTILINE)


def metric_samples(base: str, name: str) -> dict[str, float]:
    """The samples of metric ``name`` in the agent's ``/metrics``: label text (``stage="decode"``;
    empty without labels) → value."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {labels or "": float(value) for metric, labels, value in _SAMPLE.findall(text) if metric == name}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
