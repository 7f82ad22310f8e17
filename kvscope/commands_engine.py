"""The engine's subcommands: ``up``, ``replay``, ``generate``, ``serve`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from engine.cache.config import CacheConfig
from kvscope.cli_args import UserError, cache_error, replay_config

if TYPE_CHECKING:
    from engine.trace.replay import ReplayConfig

def cmd_up(args: argparse.Namespace) -> int:
    from engine.trace.formats import TraceError
    from kvscope.up import UpOptions, run_up

    replay_cfg, cache_cfg = replay_config(args)
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
        drill=args.drill,
    )
    try:
        return run_up(opts)
    except (TraceError, ValueError) as exc:
        raise cache_error(exc) from None


def cmd_replay(args: argparse.Namespace) -> int:
    from rich.console import Console

    from engine.trace.formats import TraceError, load_trace
    from kvscope.replaying import new_engine_id, run_replay, stored_summary
    from kvscope.summary import Summary

    replay_cfg, cache_cfg = replay_config(args)
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
        raise cache_error(exc) from None
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


def cache_budget(args: argparse.Namespace) -> CacheConfig | None:
    """The cache of ``--cache-memory-mib`` (one memory plan for every pool), else None (the defaults)."""
    if args.cache_memory_mib is None:
        return None
    try:
        return CacheConfig(memory_bytes=args.cache_memory_mib * 2**20)
    except ValueError as exc:
        raise cache_error(exc) from None


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream the completion of ``--prompt`` to stdout as tokens are sampled."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from engine.tokenizer import StreamDecoder

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        llm = LLM(args.model, device=args.device, cache=cache_budget(args), dtype=args.dtype)
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
        llm = LLM(
            args.model, device=args.device, cache=cache_budget(args), telemetry=telemetry, engine_id=engine_id, dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size, check_invariants=args.check_invariants,
        )  # fmt: skip
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


def cmd_bench(args: argparse.Namespace) -> int:
    from kvscope.bench_ttft import run

    try:
        doc = run(args.model, args.prefix_tokens, args.suffix_tokens, args.text, args.device, args.plans)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print(json.dumps(doc))
    return 0
