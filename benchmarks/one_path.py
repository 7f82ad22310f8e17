"""One path: the same trace requests replayed in process (``kvscope up`` / ``kvscope replay``) and
served over HTTP (``kvscope serve`` driven by ``kvscope replay --server``), CPU side by side.

Both replays run the engine's batched runtime (:class:`engine.runtime.Runtime`): in process
through :func:`engine.trace.replay.replay`, served through the OpenAI server with the clients of
:func:`engine.trace.http_replay.replay_over_http`. Same model, same cache flags, same requests
(the first ``--requests`` of the bundled weka slice), same pacing (``--speed``, 1 s wait cap).

Measured per round, after the model is loaded (start-up is not counted on either side):

- in process: this process's CPU seconds (user + system) across the replay;
- main thread: the same with the engine built and its loop driven on the main thread (for the
  record);
- served: the server process's CPU seconds across the replay (``/proc/PID/stat``) plus this
  process's (the HTTP clients).

Reported: both CPU figures and wall seconds per round, their medians, ``cpu_ratio`` (in process /
served; the goal is at most 1.2), the requests' totals on each side (prompt and cached tokens,
so a difference in reuse is visible), and the load average before and after. One JSON object on
stdout; progress on stderr. Run it alone: the machine is shared.

With ``--burners N``, N busy-loop processes compete for the cores throughout (stopped by PID).

``python -m benchmarks.one_path [--model NAME] [--requests N] [--rounds R] [--burners N]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from engine.cache import CacheConfig
from engine.llm import LLM
from engine.parallel.group import free_port
from engine.runtime.engine_thread import EngineThread
from engine.trace.formats import TraceRequest, load_trace
from engine.trace.http_replay import replay_over_http
from engine.trace.replay import ReplayConfig, ReplayTally, _replay, replay
from kvscope.data import bundled_trace

UNIT = 16
"""The prefix-match unit of both sides (the CLI's default ``--unit-tokens``)."""


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (and its waited-for children) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / os.sysconf("SC_CLK_TCK")


def in_process(model: str, requests: list[TraceRequest], config: ReplayConfig, *, main_thread: bool = False) -> dict[str, Any]:
    """:func:`replay` with the engine built and stepped on one engine thread (as ``kvscope up``
    does), or with ``main_thread`` both on this thread."""
    cache = CacheConfig(unit_tokens=UNIT, checkpoint_interval_tokens=8 * UNIT, max_prefill_chunk_tokens=32 * UNIT)
    engine = None if main_thread else EngineThread("one-path-engine")
    llm = LLM(model, cache=cache) if engine is None else engine.run(LLM, model, cache=cache)
    try:
        cpu, wall = own_cpu(), time.monotonic()
        tally = replay(llm, requests, config, thread=engine) if engine is not None else _main_thread(llm, requests, config)
        cpu, wall = own_cpu() - cpu, time.monotonic() - wall
    finally:
        if engine is not None:
            engine.run(llm.close)
            engine.close()
        else:
            llm.close()
    return {
        "cpu_seconds": round(cpu, 2), "wall_seconds": round(wall, 2), "requests": tally.requests,
        "prompt_tokens": tally.prompt_tokens, "cached_tokens": tally.recoverable_tokens,
    }  # fmt: skip


def _main_thread(llm: LLM, requests: list[TraceRequest], config: ReplayConfig) -> ReplayTally:
    return _replay(llm, requests, config, on_request=None, stop=threading.Event(), hard_stop=threading.Event(), sleep=time.sleep, clock=time.monotonic)


def served(model: str, requests: list[TraceRequest], config: ReplayConfig, log_dir: Path) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvscope", "serve", "--model", model, "--port", str(port), "--unit-tokens", str(UNIT),
           "--max-num-seqs", str(config.max_num_seqs), "--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    log = (log_dir / f"serve-{port}.log").open("wb")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"kvscope serve exited {server.returncode}; see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=2).is_success:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError("kvscope serve did not answer within 600 s")
        server_cpu, cpu, wall = process_cpu(server.pid), own_cpu(), time.monotonic()
        result = asyncio.run(replay_over_http(url, requests, config))
        wall, cpu, server_cpu = time.monotonic() - wall, own_cpu() - cpu, process_cpu(server.pid) - server_cpu
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        log.close()
    return {
        "cpu_seconds": round(server_cpu + cpu, 2), "server_cpu_seconds": round(server_cpu, 2), "client_cpu_seconds": round(cpu, 2),
        "wall_seconds": round(wall, 2), "requests": result.requests, "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="kvscope_hybrid-small", help="preset name or model directory (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=20, help="the first N requests of the bundled weka slice (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each both ways, alternating which goes first (default: %(default)s)")
    parser.add_argument("--speed", type=float, default=30.0, help="trace seconds per wall second (default: %(default)s)")
    parser.add_argument("--burners", type=int, default=0, help="busy-loop processes competing for the cores, as on a loaded machine (default: %(default)s)")
    args = parser.parse_args()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    try:
        run(args)
    finally:
        for b in burners:
            b.kill()
            b.wait()


def run(args: argparse.Namespace) -> None:
    config = ReplayConfig(speed=args.speed, max_wait_seconds=1.0, max_requests=args.requests)
    requests = load_trace(bundled_trace())[: args.requests]
    load_before = os.getloadavg()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvscope-one-path-") as tmp:
        for i in range(args.rounds):
            sides: dict[str, Any] = {}
            for side in ("in_process", "served", "main_thread") if i % 2 == 0 else ("main_thread", "served", "in_process"):
                if side == "served":
                    sides[side] = served(args.model, requests, config, Path(tmp))
                else:
                    sides[side] = in_process(args.model, requests, config, main_thread=side == "main_thread")
                print(f"round {i + 1} {side}: {sides[side]}", file=sys.stderr)
            rounds.append(sides)
    cpu_in = statistics.median(r["in_process"]["cpu_seconds"] for r in rounds)
    cpu_served = statistics.median(r["served"]["cpu_seconds"] for r in rounds)
    doc = {
        "benchmark": "one_path",
        "model": args.model,
        "requests": args.requests,
        "speed": args.speed,
        "burners": args.burners,
        "rounds": rounds,
        "in_process_cpu_seconds": cpu_in,
        "served_cpu_seconds": cpu_served,
        "cpu_ratio": round(cpu_in / cpu_served, 3) if cpu_served else None,
        "goal_cpu_ratio": 1.2,
        "main_thread_cpu_seconds": statistics.median(r["main_thread"]["cpu_seconds"] for r in rounds),
        "in_process_wall_seconds": statistics.median(r["in_process"]["wall_seconds"] for r in rounds),
        "served_wall_seconds": statistics.median(r["served"]["wall_seconds"] for r in rounds),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
