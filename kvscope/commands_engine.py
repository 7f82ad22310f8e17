"""The engine's subcommands: ``up``, ``replay``, ``generate``, ``serve`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from engine.cache.config import CacheConfig
from kvscope.cli_args import UserError, cache_config, cache_error, engine_id_arg, replay_config

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
        engine_id=engine_id_arg(args),
    )
    try:
        return run_up(opts)
    except (TraceError, ValueError) as exc:
        raise cache_error(exc) from None


def cmd_replay(args: argparse.Namespace) -> int:
    from rich.console import Console

    from engine.trace.formats import TraceError, load_trace
    from kvscope.replaying import run_replay, stored_summary
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
            engine_id=engine_id_arg(args),
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
        doc = {"engine_id": run.engine_id, "run_id": run.run_id, "skipped_requests": run.tally.skipped_requests}
        print(json.dumps({**summary.to_json(), **doc}))
    else:
        summary.render(Console())
    return 1 if run.lost_events or not consistent else 0


def _replay_over_http(args: argparse.Namespace, config: ReplayConfig) -> int:
    """``kvscope replay TRACE --server URL``: the clients' view as one JSON object."""
    import asyncio

    from rich.console import Console

    from engine.trace.formats import TraceError, is_swe_agent, load_trace, read_swe_agent
    from engine.trace.http_replay import ServerError, replay_chats_over_http, replay_over_http
    from kvscope.progress import ProgressLines

    err = Console(stderr=True, soft_wrap=True)
    try:
        if is_swe_agent(args.trace):
            sessions = read_swe_agent(args.trace)
            lines = ProgressLines(err, "replay --server", sum(len(s.turns) for s in sessions), unit="model calls")
            run = replay_chats_over_http(
                args.server, sessions, max_output_tokens=config.max_output_tokens, max_sessions=args.max_sessions,
                on_request=lambda: lines.update(lines.done + 1),
            )  # fmt: skip
        else:
            requests = load_trace(args.trace)
            lines = ProgressLines(err, "replay --server", min(len(requests), config.max_requests or len(requests)))
            run = replay_over_http(args.server, requests, config, max_sessions=args.max_sessions, on_request=lambda *_: lines.update(lines.done + 1))
        with lines:
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

    from engine.llm import LLM
    from engine.runtime import Runtime, SchedulerConfig
    from engine.runtime.engine_loop import EngineLoop
    from engine.runtime.engine_thread import EngineThread
    from engine.runtime.server import create_app
    from engine.telemetry import TelemetryClient
    from kvscope.replaying import drain_earlier_spools

    engine_id = engine_id_arg(args)
    telemetry: str | TelemetryClient | None = args.agent
    try:
        config = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
        if args.agent and args.telemetry_spool_dir is not None:
            drain_earlier_spools(args.telemetry_spool_dir, args.agent, current_engine_id=engine_id)
            telemetry = TelemetryClient(args.agent, engine_id, spool_path=args.telemetry_spool_dir / f"{engine_id}.spool")
        cache = cache_config(args)
    except ValueError as exc:
        raise cache_error(exc) from None
    engine = EngineThread()  # the model is built and stepped on one thread (engine_thread's docstring)
    try:
        llm = engine.run(
            LLM, args.model, device=args.device, cache=cache, telemetry=telemetry, engine_id=engine_id, dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size, check_invariants=args.check_invariants,
        )  # fmt: skip
    except ValueError as exc:
        engine.close()
        raise cache_error(exc) from None  # a cache setting is named by its flag
    except BaseException:
        engine.close()
        raise
    try:
        runtime = engine.run(Runtime, llm, config, cuda_graphs=False if args.enforce_eager else None)
    except ValueError as exc:
        engine.run(llm.close)
        engine.close()
        raise UserError(str(exc)) from None
    from engine.runtime import server_log

    logging.getLogger(server_log.__name__).setLevel(logging.INFO)  # banner, access log, stats line: shown without -v
    host = f"[{args.host}]" if ":" in args.host else args.host
    app = create_app(
        EngineLoop(runtime, engine), args.served_model_name or str(args.model), url=f"http://{host}:{args.port}/v1",
        access_log=args.access_log, stats_interval_seconds=args.stats_interval_seconds,
    )  # fmt: skip
    previous = _stop_signals_return()  # SIGTERM/SIGINT: uvicorn stops, then the engine closes below
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info" if getattr(args, "verbose", False) else "warning", access_log=False, timeout_graceful_shutdown=SERVE_STOP_GRACE_SECONDS)
    finally:
        llm.close()  # after uvicorn: the engine loop has stopped; then the ranks and the telemetry flush
        engine.close(0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


SERVE_STOP_GRACE_SECONDS = 10
"""How long ``kvscope serve`` lets requests in flight finish after SIGTERM/SIGINT (then uvicorn
cancels them); the engine and its tensor-parallel ranks close after it (docs/serving.md)."""


def _stop_signals_return() -> dict[int, Any]:
    """uvicorn handles SIGTERM/SIGINT itself and re-raises the signal once it has shut down,
    which would end the process (SIGTERM's default) before ``llm.close()`` stops the ranks and
    flushes telemetry. The handlers set here receive that re-raised signal and only log it; the
    previous handlers are returned, to restore. Main thread only (else nothing is set)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def note(sig: int, frame: FrameType | None) -> None:
        print(f"kvscope serve: {signal.Signals(sig).name}: server stopped, closing the engine", file=sys.stderr, flush=True)

    return {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}


def cmd_bench(args: argparse.Namespace) -> int:
    from kvscope.bench_ttft import run

    try:
        doc = run(args.model, args.prefix_tokens, args.suffix_tokens, args.text, args.device, args.plans)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print(json.dumps(doc))
    return 0
