"""kvscope: a hybrid-attention engine with a per-form prefix cache, its telemetry agent, alerts and dashboard.

The command line of docs/design.md §10.

Every subcommand parses its flags here and calls into the package that does the work. User
errors (a bad trace, bad SQL, a bad config, a locked database) print one clear line on stderr
and exit with status 2; a failed service exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agent.client import AgentError, default_agent_url
from engine.cache.config import CacheConfig

if TYPE_CHECKING:
    from engine.trace.replay import ReplayConfig

def _number(text: str, kind: type[int] | type[float], what: str) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _positive_int(text: str) -> int:
    value = int(_number(text, int, "a positive integer"))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    value = int(_number(text, int, "a non-negative integer"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a non-negative integer")
    return value


def _port(text: str) -> int:
    value = int(_number(text, int, "a TCP port (1..65535)"))
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (1..65535)")
    return value


def _positive_float(text: str) -> float:
    value = float(_number(text, float, "a positive number"))
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def _squeeze(text: str) -> object:
    from kvscope.replaying import PoolSqueeze

    try:
        return PoolSqueeze.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_replay_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="kvscope_hybrid-small", help="preset name or model directory (default: %(default)s, trained)")
    p.add_argument("--speed", type=_positive_float, default=30.0, help="trace seconds per wall second (default: %(default)s)")
    p.add_argument("--max-wait-seconds", type=float, default=1.0, help="cap on one wait between arrivals (default: %(default)s)")
    p.add_argument("--max-requests", type=_positive_int, default=None, help="stop after N requests")
    p.add_argument("--block-tokens", type=_positive_int, default=None, help="tokens per trace block in the replay (default: the trace's block size / 16)")
    p.add_argument("--max-output-tokens", type=int, default=16, help="cap on decoded tokens per request (default: %(default)s)")
    p.add_argument("--unit-tokens", type=_positive_int, default=16, help="prefix-match unit U (default: %(default)s)")
    defaults = CacheConfig()
    p.add_argument("--full-kv-blocks", type=_positive_int, default=defaults.full_kv_blocks, help="full_kv pool pages (default: %(default)s)")
    p.add_argument("--swa-blocks", type=_positive_int, default=defaults.swa_blocks, help="swa_window pool pages (default: %(default)s)")
    p.add_argument("--linear-checkpoints", type=_positive_int, default=defaults.linear_checkpoints, help="linear_state checkpoint slots (default: %(default)s)")
    p.add_argument("--compressed-blocks", type=_positive_int, default=defaults.compressed_blocks, help="pages per compressed_kv / indexer key pool (default: %(default)s)")
    p.add_argument("--tail-slots", type=_positive_int, default=defaults.tail_slots, help="uncompressed_tail / indexer pending-row slots (default: %(default)s)")
    p.add_argument(
        "--tail-replay", default="off", choices=("off", "fallback", "on", "only"),
        help="rebuild linear_state by replaying the last tokens (approximate, flagged): fallback only when no exact "
        "checkpoint is within the replay budget, on always, only: on and no recurrent checkpoints stored (default: %(default)s)",
    )
    p.add_argument("--host-tier-mib", type=_non_negative_int, default=0, help="host-memory tier every evicted object is copied down to (MiB; 0: off)")
    p.add_argument("--disk-tier-mib", type=_non_negative_int, default=0, help="disk tier below the host tier (MiB; 0: off)")
    p.add_argument("--disk-tier-dir", type=Path, default=None, help="the disk tier's files, found again on restart (up: default tiers/ under --data-dir; replay: needed with --disk-tier-mib)")
    p.add_argument("--cache-memory-mib", type=_positive_int, default=None, help="one byte budget (MiB) for every pool: a memory plan replaces the block counts above")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvscope", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    # -v also after the subcommand (kvscope agent -v); SUPPRESS keeps a -v given before it
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", parents=[verbose], help="agent + alerts + dashboard + the engine replaying a real trace")
    up.add_argument("--trace", type=Path, default=None, help="weka directory/.json or mooncake .jsonl (default: the bundled weka slice)")
    up.add_argument("--data-dir", type=Path, default=Path("kvscope-data"), help="DuckDB, logs (default: %(default)s)")
    up.add_argument("--agent-port", type=_port, default=9400)
    up.add_argument("--dashboard-port", type=_port, default=8501)
    up.add_argument("--no-dashboard", action="store_true", help="do not start the Streamlit dashboard")
    up.add_argument("--exit-when-done", action="store_true", help="stop agent and dashboard after the replay")
    up.add_argument("--alert-interval-seconds", type=_positive_float, default=None, help="evaluate rule groups without their own interval every N s instead of every minute")
    up.add_argument("--alert-rules", type=Path, default=None, help="the agent's alert rule file (default: the shipped alerts/default_rules.yaml)")
    up.add_argument("--squeeze-window-pool", type=_squeeze, default=None, metavar="START:DURATION", help="drill: from START s into the replay, for DURATION s, the swa_window pool keeps no cached pages, so the recoverable hit rate drops and the alerts fire, then resolve")
    up.add_argument("--alert-notify", type=Path, default=None, help="the agent's notification file: routes, receivers, Alertmanagers (default: the shipped alerts/default_notify.yaml)")
    _add_replay_flags(up)

    agent = sub.add_parser("agent", parents=[verbose], help="the sidecar: ingest, DuckDB store, metrics, SQL, alerts")
    agent.add_argument("--config", type=Path, default=None, help="YAML file (flags override it)")
    agent.add_argument("--host", default=None)
    agent.add_argument("--port", type=_port, default=None)
    agent.add_argument("--data-dir", type=Path, default=None)
    agent.add_argument("--token", default=None, help="bearer token (or KVSCOPE_TOKEN)")
    agent.add_argument("--alert-interval-seconds", type=_positive_float, default=None, help=argparse.SUPPRESS)
    agent.add_argument("--alert-rules", type=Path, default=None, help="the alert rule file (overrides alert_rules_file; default: the shipped one)")
    agent.add_argument("--alert-notify", type=Path, default=None, help="the notification file (overrides alert_notify_file; default: the shipped one)")
    agent.add_argument("--exit-with-parent", action="store_true", help="shut down when the process that started the agent exits (kvscope up uses it)")

    dash = sub.add_parser("dashboard", parents=[verbose], help="the Streamlit dashboard")
    dash.add_argument("--agent", default=None, help="agent URL (default: KVSCOPE_AGENT_URL or http://127.0.0.1:9400)")
    dash.add_argument("--port", type=_port, default=8501)
    dash.add_argument("--host", default="127.0.0.1")

    rep = sub.add_parser("replay", parents=[verbose], help="replay a trace (weka, Mooncake; SWE-agent .traj chats with --server) through the engine")
    rep.add_argument("trace", type=Path)
    rep.add_argument("--agent", default=None, help="send events to this agent")
    rep.add_argument("--server", default=None, help="replay over HTTP against this kvscope serve URL, sessions concurrently (the server's engine and cache flags apply, not these)")
    rep.add_argument("--max-sessions", type=_positive_int, default=None, help="with --server: sessions in flight at once (default: all)")
    _add_replay_flags(rep)

    gen = sub.add_parser("generate", parents=[verbose], help="generate text")
    gen.add_argument("--model", default="kvscope_hybrid-small", help="preset name or model directory (default: %(default)s, trained)")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")

    srv = sub.add_parser("serve", parents=[verbose], help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions)")
    srv.add_argument("--model", default="kvscope_hybrid-small", help="preset name or model directory (default: %(default)s, trained)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=_port, default=8000)
    srv.add_argument("--device", default="auto", help="auto, cpu or cuda[:i] (default: %(default)s)")
    srv.add_argument("--agent", default=None, help="send the cache's events to this agent")
    srv.add_argument(
        "--telemetry-spool-dir",
        type=Path,
        default=None,
        help="with --agent: keep every event batch in a spool file here until the agent has checkpointed it "
        "(survives an agent outage or a damaged agent WAL; spools earlier runs left here are sent first) (default: no spool)",
    )
    srv.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once (default: %(default)s)")
    srv.add_argument("--max-num-batched-tokens", type=int, default=256, help="tokens computed per engine step (default: %(default)s)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    srv.add_argument("--enforce-eager", action="store_true", help="decode without CUDA graphs (default: captured on CUDA when the model allows)")

    bench = sub.add_parser("bench", parents=[verbose], help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from kvscope.bench_ttft import add_arguments as ttft_arguments

    ttft_arguments(bench_sub.add_parser("ttft", parents=[verbose], help="time to first token: cold, exact resume, Tail-Replay"))

    sql = sub.add_parser("sql", parents=[verbose], help="ad-hoc read-only SQL over the cache logs")
    sql.add_argument("query")
    where = sql.add_mutually_exclusive_group()
    where.add_argument("--agent", default=None, help="through a running agent (default when --db is absent)")
    where.add_argument("--db", type=Path, default=None, help="a DuckDB file, opened read-only (no agent running)")
    sql.add_argument("--format", choices=("table", "csv", "json"), default="table")

    alerts = sub.add_parser("alerts", parents=[verbose], help="alert rule tooling")
    alerts_sub = alerts.add_subparsers(dest="alerts_command", required=True)
    check = alerts_sub.add_parser("check", parents=[verbose], help="validate rule files and notification files (like promtool check rules, amtool check-config)")
    check.add_argument("files", type=Path, nargs="+", metavar="FILE")
    export = alerts_sub.add_parser(
        "export-prometheus", parents=[verbose], help="write equivalent Prometheus alerting rules over the agent's metrics"
    )
    export.add_argument("file", type=Path, metavar="FILE")
    export.add_argument("-o", "--output", type=Path, default=None, help="write here instead of stdout")
    golden = alerts_sub.add_parser(
        "test", parents=[verbose], help="run rules over a golden time series and print the notifications (like promtool test rules)"
    )
    golden.add_argument("file", type=Path, metavar="FILE", help="the rule file")
    golden.add_argument("--series", type=Path, required=True, metavar="FILE", help="the golden series (YAML; see alerts/golden.py)")
    golden.add_argument("--json", action="store_true", help="one JSON object per notification instead of a table")
    agent_flag = argparse.ArgumentParser(add_help=False)  # --agent before or after add/list/expire
    agent_flag.add_argument("--agent", default=argparse.SUPPRESS, help="agent URL (default: KVSCOPE_AGENT_URL or http://127.0.0.1:9400)")
    silence = alerts_sub.add_parser("silence", parents=[verbose], help="create, list and expire silences on a running agent")
    silence.add_argument("--agent", default=None, help="agent URL (default: KVSCOPE_AGENT_URL or http://127.0.0.1:9400)")
    silence_sub = silence.add_subparsers(dest="silence_command", required=True)
    add = silence_sub.add_parser("add", parents=[verbose, agent_flag], help="mute alerts matching every matcher, e.g. engine=\"e1\" alertname=~\"Recoverable.*\"")
    add.add_argument("matchers", nargs="+", metavar="MATCHER")
    add.add_argument("--duration", default="1h", help="how long (Prometheus duration; default: %(default)s)")
    add.add_argument("--comment", required=True, help="why")
    add.add_argument("--author", default=None, help="who (default: $USER)")
    silence_sub.add_parser("list", parents=[verbose, agent_flag], help="the silences, with their state")
    expire = silence_sub.add_parser("expire", parents=[verbose, agent_flag], help="end silences now (give the full ids)")
    expire.add_argument("ids", nargs="+", metavar="ID")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        code = COMMANDS[args.command](args)
    except UserError as exc:
        print(f"kvscope {args.command}: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


class UserError(Exception):
    """An error the user can fix (bad input, bad config, an unreachable agent)."""


CACHE_FLAGS = {
    "CacheConfig.unit_tokens": "--unit-tokens",
    "CacheConfig.full_kv_blocks": "--full-kv-blocks",
    "CacheConfig.swa_blocks": "--swa-blocks",
    "CacheConfig.linear_checkpoints": "--linear-checkpoints",
    "CacheConfig.compressed_blocks": "--compressed-blocks",
    "CacheConfig.tail_slots": "--tail-slots",
    "CacheConfig.memory_bytes": "--cache-memory-mib",
    "CacheConfig.host_tier_bytes": "--host-tier-mib",
    "CacheConfig.disk_tier_bytes": "--disk-tier-mib",
    "CacheConfig.disk_tier_dir": "--disk-tier-dir",
    "CacheConfig.tail_replay": "--tail-replay",
}


def _cache_error(exc: Exception) -> UserError:
    """A cache configuration error, worded with the flags the user typed."""
    text = str(exc)
    for field, flag in CACHE_FLAGS.items():
        text = text.replace(field, flag)
    return UserError(text)


def _replay_config(args: argparse.Namespace) -> tuple[ReplayConfig, CacheConfig]:
    """Replay and cache settings from the flags; the checkpoint interval (8·U) and the prefill
    chunk (32·U) follow the prefix-match unit."""
    from engine.trace.replay import ReplayConfig

    disk_dir = args.disk_tier_dir
    if disk_dir is None and args.disk_tier_mib and getattr(args, "data_dir", None) is not None:
        disk_dir = args.data_dir / "tiers"
    try:
        return (
            ReplayConfig(
                block_tokens=args.block_tokens,
                speed=args.speed,
                max_wait_seconds=args.max_wait_seconds,
                max_requests=args.max_requests,
                max_output_tokens=args.max_output_tokens,
            ),
            CacheConfig(
                unit_tokens=args.unit_tokens,
                full_kv_blocks=args.full_kv_blocks,
                swa_blocks=args.swa_blocks,
                linear_checkpoints=args.linear_checkpoints,
                compressed_blocks=args.compressed_blocks,
                tail_slots=args.tail_slots,
                checkpoint_interval_tokens=8 * args.unit_tokens,
                max_prefill_chunk_tokens=32 * args.unit_tokens,
                memory_bytes=None if args.cache_memory_mib is None else args.cache_memory_mib * 2**20,
                tail_replay=args.tail_replay,
                host_tier_bytes=args.host_tier_mib * 2**20,
                disk_tier_bytes=args.disk_tier_mib * 2**20,
                disk_tier_dir=str(disk_dir) if disk_dir is not None else None,
            ),
        )
    except ValueError as exc:
        raise _cache_error(exc) from None


def cmd_up(args: argparse.Namespace) -> int:
    from engine.trace.formats import TraceError
    from kvscope.up import UpOptions, run_up

    replay_cfg, cache_cfg = _replay_config(args)
    opts = UpOptions(
        trace=args.trace,
        model=args.model,
        data_dir=args.data_dir,
        agent_port=args.agent_port,
        dashboard_port=args.dashboard_port,
        dashboard=not args.no_dashboard,
        replay=replay_cfg,
        cache=cache_cfg,
        exit_when_done=args.exit_when_done,
        json=args.json,
        alert_interval_seconds=args.alert_interval_seconds,
        alert_rules=args.alert_rules,
        alert_notify=args.alert_notify,
        squeeze=args.squeeze_window_pool,
    )
    try:
        return run_up(opts)
    except (TraceError, ValueError) as exc:
        raise _cache_error(exc) from None


def cmd_agent(args: argparse.Namespace) -> int:
    parent_pid = os.getppid() if args.exit_with_parent else None  # before the slow start-up: see serve
    import duckdb

    from agent.config import AgentConfig, ConfigError, load_config
    from agent.server import serve
    from agent.store import SchemaTooNewError, lock_holder
    from agent.wal_guard import DatabaseUnusableError

    try:
        config = load_config(args.config) if args.config else AgentConfig()
        overrides = {
            k: v
            for k, v in {
                "host": args.host,
                "port": args.port,
                "data_dir": args.data_dir,
                "token": args.token,
                "alert_interval_seconds": args.alert_interval_seconds,
                "alert_rules_file": args.alert_rules,
                "alert_notify_file": args.alert_notify,
            }.items()
            if v is not None
        }
        config = dataclasses.replace(config, **overrides)
    except (ConfigError, ValueError) as exc:
        raise UserError(str(exc)) from None
    from alerts.notify_config import DEFAULT_NOTIFY_PATH, NotifyConfigError, load_notify_config
    from alerts.rulefile import DEFAULT_RULES_PATH, RuleFileError, load_rule_file

    try:
        load_rule_file(config.alert_rules_file or DEFAULT_RULES_PATH)
        load_notify_config(config.alert_notify_file or DEFAULT_NOTIFY_PATH, data_dir=config.data_dir)
    except (RuleFileError, NotifyConfigError) as exc:
        raise UserError(str(exc)) from None
    from kvscope.services import port_is_free

    if not port_is_free(config.host, config.port):
        raise UserError(f"port {config.port} on {config.host} is in use (another agent?): stop it, or choose another --port")
    print(
        f"kvscope agent: http://{config.host}:{config.port}, data in {config.data_dir} "
        f"(ingest queue {config.ingest_queue_max_events} events, full policy "
        f"{config.ingest_full_policy}; raw rows kept "
        f"{'forever' if config.raw_retention_hours is None else f'{config.raw_retention_hours:g} h'}; "
        f"Parquet export {'to ' + str(config.parquet_dir) if config.export_enabled else 'off'}; "
        f"alert rules {config.alert_rules_file or 'shipped default'}, notifications "
        f"{config.alert_notify_file or 'shipped default (JSONL log)'})",
        file=sys.stderr,
        flush=True,
    )
    try:
        serve(config, parent_pid=parent_pid)
    except (SchemaTooNewError, DatabaseUnusableError) as exc:
        raise UserError(f"{config.db_path}: {exc}") from None
    except duckdb.IOException as exc:
        holder = lock_holder(exc)
        if holder is None:
            raise
        raise UserError(
            f"{config.db_path} is open in another process ({holder}); stop that agent or choose another --data-dir"
        ) from None
    print(f"kvscope agent: stopped; {config.db_path} checkpointed and closed", file=sys.stderr, flush=True)
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    import os
    import subprocess

    from dashboard.launch import streamlit_command

    url = args.agent or default_agent_url()
    argv = streamlit_command(url, args.port, args.host)
    return subprocess.call(argv, env={**os.environ, "KVSCOPE_AGENT_URL": url})


def cmd_replay(args: argparse.Namespace) -> int:
    from rich.console import Console

    from engine.trace.formats import TraceError, load_trace
    from kvscope.replaying import new_engine_id, run_replay, stored_summary
    from kvscope.summary import Summary

    replay_cfg, cache_cfg = _replay_config(args)
    err = Console(stderr=True, soft_wrap=True)
    if args.server:
        return _replay_over_http(args, replay_cfg)
    from engine.trace.formats import is_swe_agent

    if is_swe_agent(args.trace):
        raise UserError(f"{args.trace}: SWE-agent trajectories are text chats; replay them through a server (--server URL)")
    try:
        requests = load_trace(args.trace)
        run = run_replay(
            model=args.model,
            cache=cache_cfg,
            config=replay_cfg,
            requests=requests,
            agent_url=args.agent,
            engine_id=new_engine_id(),
            console=err,
        )
    except (TraceError, ValueError) as exc:
        raise _cache_error(exc) from None
    consistent = True
    if args.agent:
        summary, consistent = stored_summary(args.agent, run, err)
        if summary is None:
            return 1
    else:
        summary = Summary.from_tally(run.tally)
    if args.json:
        doc = {"engine_id": run.engine_id, "skipped_requests": run.tally.skipped_requests}
        print(json.dumps({**summary.to_json(), **doc}))
    else:
        summary.render(Console())
    return 1 if run.lost_events or not consistent else 0


def _replay_over_http(args: argparse.Namespace, config: ReplayConfig) -> int:
    """``kvscope replay TRACE --server URL``: the clients' view as one JSON object."""
    import asyncio

    from engine.trace.formats import TraceError, is_swe_agent, load_trace, read_swe_agent
    from engine.trace.http_replay import ServerError, replay_chats_over_http, replay_over_http

    try:
        if is_swe_agent(args.trace):
            sessions = read_swe_agent(args.trace)
            run = replay_chats_over_http(args.server, sessions, max_output_tokens=config.max_output_tokens, max_sessions=args.max_sessions)
        else:
            run = replay_over_http(args.server, load_trace(args.trace), config, max_sessions=args.max_sessions)
        result = asyncio.run(run)
    except (TraceError, ServerError) as exc:
        raise UserError(str(exc)) from None
    print(json.dumps(result.to_json()))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream the completion of ``--prompt`` to stdout as tokens are sampled."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from engine.tokenizer import StreamDecoder

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        llm = LLM(args.model)
        prompt = llm.tokenizer.encode(args.prompt)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    decoder = StreamDecoder(llm.tokenizer)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()

    def show(_index: int, token: int) -> None:
        sys.stdout.write(decoder.push(token))
        sys.stdout.flush()

    try:
        llm.generate([prompt], params, on_token=show)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    sys.stdout.write(decoder.finish() + "\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve ``--model`` over HTTP until interrupted."""
    import uvicorn

    from engine.llm import LLM, default_engine_id
    from engine.runtime import Runtime, SchedulerConfig
    from engine.runtime.engine_loop import EngineLoop
    from engine.runtime.server import create_app
    from engine.telemetry import TelemetryClient
    from kvscope.replaying import drain_earlier_spools

    engine_id = default_engine_id()
    telemetry: str | TelemetryClient | None = args.agent
    try:
        config = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
        if args.agent and args.telemetry_spool_dir is not None:
            drain_earlier_spools(args.telemetry_spool_dir, args.agent, current_engine_id=engine_id)
            telemetry = TelemetryClient(args.agent, engine_id, spool_path=args.telemetry_spool_dir / f"{engine_id}.spool")
        llm = LLM(args.model, device=args.device, telemetry=telemetry, engine_id=engine_id)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        runtime = Runtime(llm, config, cuda_graphs=False if args.enforce_eager else None)
    except ValueError as exc:
        llm.close()
        raise UserError(str(exc)) from None
    app = create_app(EngineLoop(runtime), args.served_model_name or str(args.model))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info" if getattr(args, "verbose", False) else "warning")
    finally:
        llm.close()
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from kvscope.sql import run_sql

    try:
        sys.stdout.write(run_sql(args.query, db=args.db, agent=args.agent or (None if args.db else default_agent_url()), fmt=args.format))
    except (AgentError, ValueError) as exc:
        raise UserError(str(exc)) from None
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from kvscope.bench_ttft import run

    try:
        doc = run(args.model, args.prefix_tokens, args.suffix_tokens, args.text, args.device, args.plans)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print(json.dumps(doc))
    return 0


def cmd_alerts(args: argparse.Namespace) -> int:
    from alerts.rulefile import RuleFileError, load_rule_file

    if args.alerts_command == "silence":
        return _silence(args)
    if args.alerts_command == "test":
        from alerts.golden import GoldenError, load_series, render_notifications, run_golden

        if not args.verbose:  # the transitions are the output; the scheduler's log lines would repeat them
            logging.getLogger("alerts.rule_scheduler").setLevel(logging.ERROR)
        try:
            rules = load_rule_file(args.file)
            series = load_series(args.series)
            result = run_golden(rules, series)
        except (RuleFileError, GoldenError) as exc:
            raise UserError(str(exc)) from None
        sys.stdout.write(render_notifications(result, as_json=args.json))
        for problem in result.mismatches:
            print(f"FAILED: {problem}", file=sys.stderr)
        return 1 if result.mismatches else 0
    if args.alerts_command == "export-prometheus":
        from alerts.prometheus_export import export_prometheus

        try:
            text = export_prometheus(load_rule_file(args.file))
        except RuleFileError as exc:
            raise UserError(str(exc)) from None
        if args.output is None:
            sys.stdout.write(text)
        else:
            args.output.write_text(text, encoding="utf-8")
        return 0
    import yaml

    from alerts.notify_config import NOTIFY_KEYS, NotifyConfigError, load_notify_config

    failed = 0
    for path in args.files:
        try:
            try:
                document = yaml.safe_load(path.read_text(encoding="utf-8"))
            except OSError as exc:
                print(f"FAILED: {path}: cannot read: {exc.strerror or exc}", file=sys.stderr)
                failed += 1
                continue
            except (yaml.YAMLError, UnicodeDecodeError):
                document = None  # the rule loader reports it
            # a notification file has only its own top-level keys; anything else is read as rules
            notify_file = isinstance(document, dict) and bool(document) and set(document) <= NOTIFY_KEYS
            if notify_file:
                config = load_notify_config(path, data_dir=Path("kvscope-data"))
                counts = ((len(config.receivers), "receiver"), (len(config.inhibit_rules), "inhibit rule"), (len(config.alertmanagers), "Alertmanager"))
                print(f"{path}: SUCCESS: notification file, " + ", ".join(f"{n} {what}{'' if n == 1 else 's'}" for n, what in counts))
            else:
                rules = load_rule_file(path)
                print(f"{path}: SUCCESS: {len(rules.groups)} groups, {len(rules.rules)} rules found")
        except (RuleFileError, NotifyConfigError) as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def _silence(args: argparse.Namespace) -> int:
    import getpass

    from agent.client import AgentClient

    try:
        client = AgentClient(base_url=args.agent or default_agent_url(), timeout_seconds=10)
        if args.silence_command == "add":
            created = client.create_silence(
                matchers=args.matchers, duration=args.duration, comment=args.comment, created_by=args.author or getpass.getuser()
            )
            print(created["id"])
            return 0
        if args.silence_command == "expire":
            failed = 0
            for silence_id in args.ids:
                try:
                    client.expire_silence(silence_id)
                except AgentError as exc:
                    print(f"kvscope alerts silence: {silence_id}: {exc}", file=sys.stderr)
                    failed += 1
                    continue
                print(f"expired {silence_id}")
            return 1 if failed else 0
        found = client.silences()
    except (AgentError, ValueError) as exc:
        raise UserError(str(exc)) from None
    from datetime import UTC, datetime

    def when(unix: float) -> str:
        try:
            return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%d %H:%M:%S")
        except (OverflowError, OSError, ValueError):
            return f"{unix:.0f}"

    print(f"{'ID':36}  {'STATE':8}  {'ENDS (UTC)':19}  {'CREATED BY':12}  MATCHERS  COMMENT")
    for s in found:
        comment = "".join(ch if ch.isprintable() else " " for ch in s["comment"])
        print(f"{s['id']:36}  {s['state']:8}  {when(s['ends_at']):19}  {s['created_by'][:12]:12}  {' '.join(s['matchers'])}  {comment}")
    return 0


COMMANDS = {
    "alerts": cmd_alerts,
    "bench": cmd_bench,
    "up": cmd_up,
    "agent": cmd_agent,
    "dashboard": cmd_dashboard,
    "replay": cmd_replay,
    "generate": cmd_generate,
    "serve": cmd_serve,
    "sql": cmd_sql,
}
