"""Serving throughput and time to first token at 1, 8 and 32 concurrent sessions, with continuous
batching on and off, in one run.

For each setting a fresh engine (so no run inherits another's cache) is served by ``kvscope
serve``'s app (uvicorn on loopback, in this process) and driven over HTTP by the trace replay's
clients (:func:`engine.trace.http_replay.replay_over_http`): the first N sessions of the bundled
weka slice, their first ``--turns`` requests each, closed loop (every session sends its next
request as soon as its previous answer is in), ``--max-output-tokens`` tokens per answer, prompts
of one token per trace block. Batching off is the same server with ``max_num_seqs = 1`` (one
request at a time, first come first served); on is ``max_num_seqs = 32`` with a budget of
``--max-num-batched-tokens`` per step.

Reported per setting: output and total tokens per second, TTFT p50 / p99 (client side, to the
first streamed chunk), the cached share of prompt tokens; and per session count the ratios
batching on / off. Prints one JSON object; progress on stderr.

``--output-tokens N`` makes every answer exactly N tokens instead of the trace's (scaled) output
lengths, which with one prompt token per block are a few tokens each: a decode-heavy run, where
batched decode steps show.

Run: ``python -m benchmarks.serving [--model M] [--turns T] [--max-output-tokens N] [--output-tokens N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.llm import LLM
from engine.runtime import Runtime, SchedulerConfig
from engine.runtime.engine_loop import EngineLoop
from engine.runtime.server import create_app, serve_in_thread
from engine.trace.formats import TraceRequest, load_trace
from engine.trace.http_replay import replay_over_http
from engine.trace.replay import ReplayConfig
from tests.helpers import free_port

WEKA_SLICE = Path(__file__).resolve().parent.parent / "kvscope" / "data" / "weka_slice" / "traces"


def sessions_of(requests: list[TraceRequest], n: int, turns: int) -> list[TraceRequest]:
    chosen: dict[str, list[TraceRequest]] = {}
    for r in sorted(requests, key=lambda r: r.arrival_seconds):
        if r.session_id not in chosen and len(chosen) == n:
            continue
        turns_so_far = chosen.setdefault(r.session_id, [])
        if len(turns_so_far) < turns:
            turns_so_far.append(r)
    return [r for rs in chosen.values() for r in rs]


def measure(model: str, max_num_seqs: int, budget: int, requests: list[TraceRequest], config: ReplayConfig) -> dict[str, Any]:
    llm = LLM(model)
    runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs))
    try:
        with serve_in_thread(create_app(EngineLoop(runtime), model), free_port()) as url:
            run = asyncio.run(replay_over_http(url, requests, config))
        return run.to_json() | {"engine_steps": runtime.num_steps, "preemptions": runtime.num_preemptions}
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="kvscope_hybrid-tiny")
    parser.add_argument("--turns", type=int, default=2, help="requests per session (default: %(default)s)")
    parser.add_argument("--max-output-tokens", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--sessions", default="1,8,32", help="session counts (default: %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=None, help="every answer exactly this many tokens, replacing --max-output-tokens (default: the trace's, capped)")
    args = parser.parse_args()
    if args.output_tokens is not None and args.output_tokens < 1:
        parser.error(f"--output-tokens {args.output_tokens}: must be at least 1")
    trace = load_trace(WEKA_SLICE)
    cap = args.max_output_tokens
    if args.output_tokens is not None:  # the replay decodes ceil(output_tokens / block_tokens) at one token per block
        trace = [dataclasses.replace(r, output_tokens=args.output_tokens * r.block_tokens) for r in trace]
        cap = args.output_tokens
    config = ReplayConfig(block_tokens=1, speed=1e9, max_wait_seconds=0.0, max_output_tokens=cap)
    results = []
    ratios: dict[str, dict[str, float | None]] = {}
    for n in (int(x) for x in args.sessions.split(",")):
        requests = sessions_of(trace, n, args.turns)
        row: dict[str, dict[str, Any]] = {}
        for batching, seqs in (("off", 1), ("on", 32)):
            print(f"{n} sessions, batching {batching} ...", file=sys.stderr)
            row[batching] = measure(args.model, seqs, args.max_num_batched_tokens, requests, config)
            results.append({"sessions": n, "batching": batching, **row[batching]})
        on, off = row["on"], row["off"]
        ratios[str(n)] = {
            "throughput_on_over_off": on["output_tokens_per_second"] / off["output_tokens_per_second"] if off["output_tokens_per_second"] else None,
            "ttft_p50_on_over_off": on["ttft_p50_seconds"] / off["ttft_p50_seconds"] if off["ttft_p50_seconds"] else None,
            "ttft_p99_on_over_off": on["ttft_p99_seconds"] / off["ttft_p99_seconds"] if off["ttft_p99_seconds"] else None,
        }
    print(json.dumps({"benchmark": "serving", "model": args.model, "turns": args.turns, "max_output_tokens": cap, "output_tokens": args.output_tokens, "results": results, "ratios": ratios}))


if __name__ == "__main__":
    main()
