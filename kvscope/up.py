"""``kvscope up``: the main job — agent (+ alerts), dashboard and the engine replaying a real trace.

1. Read the trace first (a bad trace fails before anything starts).
2. Start the agent (``kvscope agent``, the only process that opens the DuckDB file) and wait for
   ``/readyz``; start the dashboard (Streamlit) pointed at the agent.
3. Replay the trace through ``engine.LLM`` with telemetry to the agent; a progress bar shows
   requests done and the recoverable hit rate of the recent requests.
4. Flush telemetry, read the per-form summary back from the agent (so it is what was stored),
   check it against the in-process tally, print it (table, or one JSON object with ``--json``).
   Exit status 1 if any event was lost or the stored totals differ from the engine's.
5. Keep agent and dashboard up until Ctrl-C unless ``--exit-when-done``; then stop them by PID.

Shutdown (docs/serving.md): SIGTERM or Ctrl-C starts no more requests (the running ones finish), then
the dashboard, then the agent (last, so the telemetry is flushed to it), each SIGTERMed and
SIGKILLed 10 s later if still there. A ``kvscope up`` SIGKILLed leaves nothing either: the
dashboard gets the kernel's parent-death SIGKILL, the agent sees it was re-parented and stops.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

import duckdb
from rich.console import Console

from agent.client import AgentClient, AgentError
from agent.store import lock_holder
from alerts.notify_config import DEFAULT_NOTIFY_PATH, load_notify_config
from alerts.rulefile import DEFAULT_RULES_PATH, load_rule_file
from engine.cache import CacheConfig
from engine.identity import derived_engine_id
from engine.llm import check_cache_config
from engine.presets import check_model_ref
from engine.trace.formats import TraceError, TraceRequest, load_trace
from engine.trace.replay import ReplayConfig
from kvscope.data import bundled_trace
from kvscope.drill import DRILL_NOTIFY_PATH, DrillPlan, DrillWatch, calibrate
from kvscope.replaying import (
    PoolSqueeze,
    drain_earlier_spools,
    run_replay,
    stored_summary,
)
from kvscope.services import ServiceError, ServiceGroup, port_is_free

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
    alert_rules: Path | None = None
    """The agent's rule file (None: the shipped default, ``alerts/default_rules.yaml``)."""
    alert_notify: Path | None = None
    """The agent's notification file (None: the shipped default, ``alerts/default_notify.yaml``)."""
    squeeze: PoolSqueeze | None = None
    """A window-pool squeeze drill during the replay (None: none)."""
    drill: bool = False
    """The drill sized to this machine (:mod:`kvscope.drill`): its own rules and squeeze."""
    engine_id: str | None = None
    """The engine's id, kept across restarts (None: :func:`engine.identity.derived_engine_id`)."""


def run_up(opts: UpOptions) -> int:
    err = Console(stderr=True, soft_wrap=True)
    trace_path = opts.trace or bundled_trace()
    requests = load_trace(trace_path)
    if not requests:
        raise TraceError(f"{trace_path}: the trace holds no requests")
    check_model_ref(opts.model)  # an unknown model fails before anything starts
    check_cache_config(opts.model, opts.cache)  # so does a cache the model cannot use
    if opts.drill and (opts.squeeze is not None or opts.alert_rules is not None):
        raise ValueError("--drill sizes its own squeeze and rules: leave out --squeeze-window-pool and --alert-rules")
    load_rule_file(opts.alert_rules or DEFAULT_RULES_PATH)  # and a bad rule or notification file
    load_notify_config(opts.alert_notify or DEFAULT_NOTIFY_PATH, data_dir=opts.data_dir)
    if opts.data_dir.exists() and not opts.data_dir.is_dir():
        raise ValueError(f"--data-dir {opts.data_dir} is a file, not a directory")
    for name, port in (("agent", opts.agent_port), ("dashboard", opts.dashboard_port)):
        if (name == "agent" or opts.dashboard) and not port_is_free("127.0.0.1", port):
            err.print(
                f"[red]kvscope up: port {port} for the {name} is in use (another kvscope up?): stop it, or run "
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
    plan: DrillPlan | None = None
    if opts.drill:
        plan = _plan_drill(opts, requests, err)
        rules_path = opts.data_dir / "drill_rules.yaml"
        rules_path.write_text(plan.rule_file_text())
        opts = replace(opts, alert_rules=rules_path, alert_notify=opts.alert_notify or DRILL_NOTIFY_PATH, squeeze=plan.squeeze)
    agent_url = f"http://127.0.0.1:{opts.agent_port}"
    stop = threading.Event()
    _install_stop_handlers(stop)
    services = ServiceGroup()
    try:
        agent_cmd = [
            sys.executable, "-m", "kvscope", "agent",
            "--data-dir", str(opts.data_dir), "--host", "127.0.0.1", "--port", str(opts.agent_port),
            "--exit-with-parent",  # a killed `up` must not leave the agent holding the DuckDB lock
        ]  # fmt: skip
        if opts.alert_interval_seconds:
            agent_cmd += ["--alert-interval-seconds", str(opts.alert_interval_seconds)]
        agent_cmd += ["--alert-rules", str(opts.alert_rules or DEFAULT_RULES_PATH)]
        if opts.alert_notify is not None:
            agent_cmd += ["--alert-notify", str(opts.alert_notify)]
        if opts.dashboard:  # the shipped rules' runbook links open this dashboard's Forms page
            agent_cmd += ["--dashboard-url", f"http://127.0.0.1:{opts.dashboard_port}"]
        # no parent-death signal: the agent watches its parent itself and shuts down gracefully
        agent = services.start("agent", agent_cmd, opts.data_dir / "agent.log", parent_death_signal=None)
        services.wait_http_ok(agent, agent_url + "/readyz", timeout_seconds=60, stop=stop)
        err.print(f"agent      {agent_url}  (DuckDB {opts.data_dir / 'kvscope.duckdb'}, metrics {agent_url}/metrics)")
        _warn_if_degraded(err, agent_url)
        engine_id = opts.engine_id or derived_engine_id(opts.model)
        resent = drain_earlier_spools(opts.data_dir / "spool", agent_url, current_engine_id=engine_id)
        if resent:
            err.print(f"telemetry: sent {resent} events that spools of earlier runs still held")
        if opts.dashboard:
            from dashboard.launch import streamlit_command

            services.start(
                "dashboard",
                streamlit_command(agent_url, opts.dashboard_port),
                opts.data_dir / "dashboard.log",
                env={"KVSCOPE_AGENT_URL": agent_url},
                parent_death_signal=signal.SIGKILL,  # nothing to flush: it dies with `up`, even SIGKILLed
            )
            err.print(f"dashboard  http://127.0.0.1:{opts.dashboard_port}")
        watch = DrillWatch(plan=plan, client=AgentClient(base_url=agent_url, timeout_seconds=10), stop=stop) if plan is not None else None
        if watch is not None:
            watch.start()
        run = run_replay(
            model=opts.model,
            cache=opts.cache,
            config=opts.replay,
            requests=requests,
            agent_url=agent_url,
            engine_id=engine_id,
            console=err,
            stop=stop,
            spool_dir=opts.data_dir / "spool",
            squeeze=opts.squeeze,
            on_squeeze=watch.on_squeeze if watch is not None else None,
        )
        if watch is not None:
            watch.close()
            err.print(_drill_line(watch))
        summary, consistent = stored_summary(agent_url, run, err)
        if summary is None:
            return 1
        if opts.json:
            doc: dict[str, Any] = {"engine_id": run.engine_id, "run_id": run.run_id, "trace": str(trace_path), "skipped_requests": run.tally.skipped_requests}
            if watch is not None:
                doc["drill"] = watch.to_json()
            print(json.dumps({**summary.to_json(), **doc}), flush=True)
        else:
            summary.render(Console())
        if run.lost_events or not consistent or (watch is not None and watch.verdict() is not None):
            return 1
        interrupted = stop.is_set() and not (watch is not None and watch.ended_replay)
        if not opts.exit_when_done and not interrupted:
            stop.clear()
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


def _plan_drill(opts: UpOptions, requests: list[TraceRequest], err: Console) -> DrillPlan:
    """Measure this machine's replay rate and size the drill from it (:mod:`kvscope.drill`)."""
    err.print("drill: measuring this machine's replay rate (at most 20 s) ...")
    untiered = replace(opts.cache, host_tier_bytes=0, disk_tier_bytes=0, disk_tier_dir=None)
    calibration = calibrate(model=opts.model, cache=untiered, config=opts.replay, requests=requests)
    plan = DrillPlan.derive(calibration, max_wait_seconds=opts.replay.max_wait_seconds)
    err.print(f"drill: {plan.describe()}")
    return plan


def _drill_line(watch: DrillWatch) -> str:
    result = watch.to_json()
    failure = watch.verdict()
    if failure is not None:
        return f"[red]drill failed: {failure}[/]"
    return (
        f"drill: paged {result['detection_seconds']:.1f} s after the squeeze began, "
        f"resolved {result['resolve_seconds']:.1f} s after the pool was released"
    )


def _warn_if_degraded(err: Console, agent_url: str) -> None:
    """Print the agent's degraded conditions (a quarantined WAL, acknowledged batches missing),
    if any: it serves, but an operator must look."""
    try:
        ready = AgentClient(base_url=agent_url, timeout_seconds=5).readyz()
    except AgentError:
        return
    for item in ready.get("degraded", []):
        err.print(f"[yellow]agent DEGRADED ({item.get('reason')}): {item.get('detail')}[/]")


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


def _install_stop_handlers(stop: threading.Event) -> None:
    """First SIGINT/SIGTERM: finish the running requests, print the summary, stop the children.
    A second SIGINT interrupts immediately."""

    def handler(sig: int, frame: FrameType | None) -> None:
        if stop.is_set() and sig == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
