"""Ingest latency while heavy SQL runs: a real agent process receives a steady stream of event
batches (``POST /v1/events``, one sender thread, a fixed rate); first nothing else runs (idle),
then ``--queries`` client threads keep heavy ``POST /v1/sql`` queries in flight (each runs until
the agent's time limit). Reported side by side in one run: the ingest ack latency (p50, p99,
max) in both phases, their ``p99_ratio`` (loaded / idle; target: within 2x), and the answers the
query threads got (200, 408 time limit, 429 refused by the concurrency cap), with
``os.getloadavg()`` before and after. Prints one JSON object; progress goes to stderr.

``python -m benchmarks.query_isolation [--phase-seconds 12] [--queries 10] [--batch-events 250]
[--interval-seconds 0.05] [--agent-config FILE] [--uncapped]``

``--uncapped`` runs the same with the cap lifted (``sql_max_concurrent_queries: 64``) and all
CPUs given to DuckDB (``duckdb_threads``), for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import msgspec

from agent.duckdb_settings import usable_cpus
from benchmarks.bench_agent import free_port, percentile, start_agent, stop_agent
from benchmarks.bench_events import build_events, stamp
from engine.events import SCHEMA_VERSION, EventBatch

HEAVY_SQL = (
    "SELECT count(*) FROM range(100000000) a, range(100000000) b WHERE (a.range + b.range) % 7 = 3"
)
"""CPU-bound and parallel: runs until the agent interrupts it at its time limit."""
TARGET_P99_RATIO = 2.0


def log(message: str) -> None:
    print(f"[query_isolation] {message}", file=sys.stderr, flush=True)


def ingest_phase(
    base: str, seconds: float, batch_events: int, interval: float, seq0: int
) -> tuple[list[float], int]:
    """Send one batch every ``interval`` seconds for ``seconds``; the ack latency of each."""
    events = build_events("isolation-engine", batch_events)
    batch = EventBatch(
        schema_version=SCHEMA_VERSION,
        engine_id="isolation-engine",
        seq=seq0,
        sent_at=0.0,
        events=events,
    )
    lags: list[float] = []
    with httpx.Client(timeout=60.0, headers={"Content-Type": "application/msgpack"}) as client:
        deadline = time.monotonic() + seconds
        next_at = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += interval
            t0 = time.time()
            stamp(events, t0, f"iso-{batch.seq}-")
            batch.sent_at = t0
            response = client.post(f"{base}/v1/events", content=msgspec.msgpack.encode(batch))
            if response.status_code != 200:
                raise RuntimeError(f"ingest answered {response.status_code}: {response.text[:200]}")
            lags.append(time.time() - t0)
            batch.seq += 1
    return lags, batch.seq


def query_loop(
    base: str, stop: threading.Event, statuses: Counter[str], lock: threading.Lock
) -> None:
    with httpx.Client(timeout=120.0) as client:
        while not stop.is_set():
            response = client.post(f"{base}/v1/sql", json={"sql": HEAVY_SQL})
            with lock:
                statuses[str(response.status_code)] += 1
            if response.status_code == 429:
                time.sleep(float(response.headers.get("retry-after", "1")))


def run(args: argparse.Namespace, config_text: str | None) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="kvscope-query-isolation-") as tmp:
        where = Path(tmp)
        config = None
        if config_text is not None:
            config = where / "agent.yaml"
            config.write_text(config_text)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        agent = start_agent(port, where / "data", where / "agent.log", config)
        try:
            ingest_phase(base, 1.0, args.batch_events, args.interval_seconds, 0)  # warm-up
            log(f"idle phase, {args.phase_seconds:g} s")
            idle, seq = ingest_phase(
                base, args.phase_seconds, args.batch_events, args.interval_seconds, 1_000
            )
            statuses: Counter[str] = Counter()
            lock = threading.Lock()
            stop = threading.Event()
            threads = [
                threading.Thread(target=query_loop, args=(base, stop, statuses, lock), daemon=True)
                for _ in range(args.queries)
            ]
            for t in threads:
                t.start()
            time.sleep(0.5)  # the queries are in flight
            log(f"loaded phase, {args.queries} heavy queries, {args.phase_seconds:g} s")
            loaded, _ = ingest_phase(
                base, args.phase_seconds, args.batch_events, args.interval_seconds, seq
            )
            stop.set()
            for t in threads:
                t.join(timeout=60)
        finally:
            stop_agent(agent)
    p99_idle, p99_loaded = percentile(idle, 0.99), percentile(loaded, 0.99)
    return {
        "idle": {
            "batches": len(idle),
            "p50_seconds": percentile(idle, 0.5),
            "p99_seconds": p99_idle,
            "max_seconds": max(idle),
        },
        "loaded": {
            "batches": len(loaded),
            "p50_seconds": percentile(loaded, 0.5),
            "p99_seconds": p99_loaded,
            "max_seconds": max(loaded),
        },
        "p99_ratio": None if not p99_idle or p99_loaded is None else p99_loaded / p99_idle,
        "query_statuses": dict(sorted(statuses.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--phase-seconds", type=float, default=12.0)
    parser.add_argument("--queries", type=int, default=10)
    parser.add_argument("--batch-events", type=int, default=250)
    parser.add_argument("--interval-seconds", type=float, default=0.05)
    parser.add_argument("--agent-config", type=Path, default=None)
    parser.add_argument(
        "--uncapped", action="store_true", help="also run with the cap lifted, for comparison"
    )
    args = parser.parse_args()
    if (
        args.phase_seconds <= 0
        or args.queries < 1
        or args.batch_events < 1
        or args.interval_seconds <= 0
    ):
        parser.error(
            "need --phase-seconds > 0, --queries >= 1, --batch-events >= 1, --interval-seconds > 0"
        )
    base_config = args.agent_config.read_text() if args.agent_config else ""
    load_before = os.getloadavg()
    doc: dict[str, object] = {
        "phase_seconds": args.phase_seconds,
        "queries": args.queries,
        "batch_events": args.batch_events,
        "interval_seconds": args.interval_seconds,
        "heavy_sql": HEAVY_SQL,
        "latency_definition": "per batch: the sender's ack time - its send time (POST /v1/events, one in flight)",
        "capped": run(args, base_config or None),
    }
    if args.uncapped:
        doc["uncapped"] = run(
            args,
            base_config + f"\nsql_max_concurrent_queries: 64\nduckdb_threads: {usable_cpus()}\n",
        )
    capped = doc["capped"]
    assert isinstance(capped, dict)
    doc["p99_ratio"] = capped["p99_ratio"]
    doc["target_p99_ratio"] = TARGET_P99_RATIO
    doc["meets_target"] = (
        capped["p99_ratio"] is not None and capped["p99_ratio"] <= TARGET_P99_RATIO
    )
    doc["loadavg_before"] = load_before
    doc["loadavg_after"] = os.getloadavg()
    doc["cpu_count"] = os.cpu_count()
    print(json.dumps(doc))
    log(
        f"ingest p99 idle {capped['idle']['p99_seconds']:.3f} s, loaded {capped['loaded']['p99_seconds']:.3f} s, ratio {capped['p99_ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
