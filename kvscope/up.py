"""``kvscope up``: the main job — agent (+ alerts), dashboard and the engine replaying a real trace.

1. Read the trace first (a bad trace fails before anything starts).
2. Start the agent (``kvscope agent``, the only process that opens the DuckDB file) and wait for
   ``/readyz``; start the dashboard (Streamlit) pointed at the agent.
3. Replay the trace through ``engine.LLM`` with telemetry to the agent; a progress bar shows
   requests done and the recoverable hit rate of the recent requests.
4. Flush telemetry, read the per-form summary back from the agent (so it is what was stored),
   check it against the in-process tally, print it (table, or one JSON object with ``--json``).
5. Keep agent and dashboard up until Ctrl-C unless ``--exit-when-done``; then stop them by PID.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import duckdb
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agent.client import AgentClient, AgentError
from agent.store import lock_holder
from engine.cache import CacheConfig
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.telemetry import TelemetryClient
from engine.trace.formats import TraceError, TraceRequest, load_trace
from engine.trace.replay import ReplayConfig, ReplayTally, replay
from kvscope.data import bundled_trace
from kvscope.services import ServiceError, ServiceGroup, port_is_free
from kvscope.summary import Summary

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class UpOptions:
    trace: Path | None
    model: str
    data_dir: Path
    agent_port: int
    dashboard_port: int
    dashboard: bool
    replay: ReplayConfig
    cache: CacheConfig
    exit_when_done: bool
    json: bool
    alert_interval_seconds: float | None


class _RollingRate:
    """Recoverable and raw hit rate over the last ``n`` requests (token sums)."""

    def __init__(self, n: int = 50) -> None:
        self._rows: deque[tuple[int, int, int]] = deque(maxlen=n)

    def add(self, out: RequestOutput) -> None:
        c = out.cache
        self._rows.append((c.prompt_tokens, c.hash_hit_tokens, c.recoverable_tokens))

    def text(self) -> str:
        prompt = sum(r[0] for r in self._rows)
        if not prompt:
            return ""
        raw = sum(r[1] for r in self._rows) / prompt
        rec = sum(r[2] for r in self._rows) / prompt
        return f"last {len(self._rows)} requests: recoverable {100 * rec:5.1f}% (raw {100 * raw:5.1f}%)"


def run_up(opts: UpOptions) -> int:
    err = Console(stderr=True, soft_wrap=True)
    trace_path = opts.trace or bundled_trace()
    requests = load_trace(trace_path)
    if not requests:
        raise TraceError(f"{trace_path}: the trace holds no requests")
    for name, port in (("agent", opts.agent_port), ("dashboard", opts.dashboard_port)):
        if (name == "agent" or opts.dashboard) and not port_is_free("127.0.0.1", port):
            err.print(
                f"[red]port {port} for the {name} is in use (another kvscope up?): stop it, or run "
                f"this one with --{name}-port and its own --data-dir[/]"
            )
            return 2
    holder = database_holder(opts.data_dir / "kvscope.duckdb")
    if holder is not None:
        err.print(
            f"[red]{opts.data_dir / 'kvscope.duckdb'} is open in another process ({holder}); "
            "stop that agent or choose another --data-dir[/]"
        )
        return 2
    opts.data_dir.mkdir(parents=True, exist_ok=True)
    agent_url = f"http://127.0.0.1:{opts.agent_port}"
    stop = threading.Event()
    _install_stop_handlers(stop)
    services = ServiceGroup()
    try:
        agent_cmd = [
            sys.executable, "-m", "kvscope", "agent",
            "--data-dir", str(opts.data_dir), "--host", "127.0.0.1", "--port", str(opts.agent_port),
        ]  # fmt: skip
        if opts.alert_interval_seconds:
            agent_cmd += ["--alert-interval-seconds", str(opts.alert_interval_seconds)]
        agent = services.start("agent", agent_cmd, opts.data_dir / "agent.log")
        services.wait_http_ok(agent, agent_url + "/readyz", timeout_seconds=60)
        err.print(f"agent      {agent_url}  (DuckDB {opts.data_dir / 'kvscope.duckdb'}, metrics {agent_url}/metrics)")
        if opts.dashboard:
            from dashboard.launch import streamlit_command

            services.start(
                "dashboard",
                streamlit_command(agent_url, opts.dashboard_port),
                opts.data_dir / "dashboard.log",
                env={"KVSCOPE_AGENT_URL": agent_url},
            )
            err.print(f"dashboard  http://127.0.0.1:{opts.dashboard_port}")
        engine_id = f"replay-{socket.gethostname()}-{os.getpid()}-{int(time.time())}"
        tally = _replay_with_progress(opts, requests, agent_url, engine_id, stop, err)
        summary = _stored_summary(agent_url, engine_id, tally, err)
        if summary is None:
            return 1
        if opts.json:
            doc = {"engine_id": engine_id, "trace": str(trace_path), "skipped_requests": tally.skipped_requests}
            print(json.dumps({**summary.to_json(), **doc}))
        else:
            summary.render(Console())
        if not opts.exit_when_done and not stop.is_set():
            err.print("replay done; agent and dashboard keep running. Press Ctrl-C to stop.")
            while not stop.wait(1.0):
                dead = [s.name for s in services.services if not s.alive()]
                if dead:
                    err.print(f"[red]{', '.join(dead)} exited; stopping[/]")
                    return 1
        return 0
    except ServiceError as exc:
        err.print(f"[red]{exc}[/]")
        return 1
    finally:
        services.stop_all()


def database_holder(db: Path) -> str | None:
    """Who holds the DuckDB file's write lock (DuckDB's own description), or None if nobody."""
    if not db.exists():
        return None
    try:
        duckdb.connect(str(db), read_only=True).close()
    except duckdb.IOException as exc:
        holder = lock_holder(exc)
        if holder is None:
            raise
        return holder
    return None


def _replay_with_progress(
    opts: UpOptions, requests: list[TraceRequest], agent_url: str, engine_id: str, stop: threading.Event, err: Console
) -> ReplayTally:
    telemetry = TelemetryClient(agent_url, engine_id)
    llm = LLM(opts.model, cache=opts.cache, telemetry=telemetry, engine_id=engine_id)
    total = min(len(requests), opts.replay.max_requests or len(requests))
    rolling = _RollingRate()
    columns = (
        TextColumn("[bold]replay[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[rate]}"),
    )
    try:
        with Progress(*columns, console=err, transient=False) as progress:
            task = progress.add_task("replay", total=total, rate="")

            def on_request(done: int, _total: int, _req: TraceRequest, out: RequestOutput | None) -> None:
                if out is not None:
                    rolling.add(out)
                progress.update(task, completed=done, rate=rolling.text())

            tally = replay(llm, requests, opts.replay, on_request=on_request, stop=stop)
        llm.emit_engine_stats()
    finally:
        llm.close(timeout=60)
    if telemetry.dropped_events or telemetry.rejected_batches:
        err.print(
            f"[red]telemetry lost {telemetry.dropped_events} events "
            f"({telemetry.rejected_batches} batches rejected by the agent)[/]"
        )
    return tally


def _stored_summary(agent_url: str, engine_id: str, tally: ReplayTally, err: Console) -> Summary | None:
    try:
        stored = Summary.from_agent(AgentClient(base_url=agent_url, timeout_seconds=60), engine_id)
    except AgentError as exc:
        err.print(f"[red]cannot read the summary back from the agent: {exc}[/]")
        return None
    local = Summary.from_tally(tally)
    if stored.to_json() != local.to_json():
        err.print(
            "[yellow]warning: the agent stored different totals than the engine counted "
            f"(stored {stored.requests} requests, engine {local.requests}); see the agent log[/]"
        )
    return stored


def _install_stop_handlers(stop: threading.Event) -> None:
    """First SIGINT/SIGTERM: finish the current request, print the summary, stop the children.
    A second SIGINT interrupts immediately."""

    def handler(sig: int, frame: FrameType | None) -> None:
        if stop.is_set() and sig == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
