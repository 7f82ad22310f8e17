"""Agent ingest under load: several engine-like senders on loopback push event batches to a real
agent process (``POST /v1/events``) for a fixed time; the same kind of events is then inserted
as one Arrow table per table straight into a fresh DuckDB store, in the same run, as the floor.
Prints one JSON object (see :func:`main` for the fields); progress goes to stderr.

``python -m benchmarks.ingest_load [--seconds S] [--senders N] [--batch-events B]
[--format msgpack|json] [--warmup-seconds W] [--direct-max-events E]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.synchronize import Barrier
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import httpx
import msgspec

from agent.ingest import TABLE_SPECS, build_tables
from agent.store import Store, utc_now
from engine.events import (
    SCHEMA_VERSION,
    Admission,
    CacheLookup,
    ContentFormat,
    Event,
    EventBatch,
    Form,
    Outcome,
    Reason,
    RequestEvent,
    Tier,
    decode_batch,
    encode_batch,
)

ROOT = Path(__file__).resolve().parents[1]
TARGET_EVENTS_PER_SECOND = 200_000
MODEL = "kvscope_hybrid-small"
EVENTS_PER_REQUEST = 5
"""One ``request`` event and four ``cache_lookup`` events per request."""
AGENT_SCRIPT = """
import dataclasses, sys
from pathlib import Path
from agent.config import AgentConfig, load_config
from agent.server import serve
base = load_config(sys.argv[3]) if len(sys.argv) > 3 else AgentConfig()
serve(dataclasses.replace(base, port=int(sys.argv[1]), data_dir=Path(sys.argv[2])), log_level="warning")
"""
RETRY_STATUSES = frozenset({429, 503})
"""Back-pressure (queue full): the sender retries the same batch; any other error stops it."""
MEDIA_TYPES: dict[ContentFormat, str] = {
    "msgpack": "application/msgpack",
    "json": "application/json",
}


def log(message: str) -> None:
    print(f"[ingest_load] {message}", file=sys.stderr, flush=True)


# --- the events ----------------------------------------------------------------------------------


def _lookup(
    engine_id: str, form: Form, tier: Tier, outcome: Outcome, reason: Reason, hit: int, usable: int,
    recoverable: int, **extra: Any,
) -> CacheLookup:  # fmt: skip
    return CacheLookup(
        ts=0.0, engine_id=engine_id, request_id="-", model=MODEL, form=form, tier=tier,
        outcome=outcome, reason=reason, hash_hit_tokens=hit, usable_tokens=usable,
        recoverable_tokens=recoverable, **extra,
    )  # fmt: skip


def _request(
    engine_id: str, admission: Admission, hit: int, resume: int, recoverable: int, replayed: int,
    recomputed: int, **extra: Any,
) -> RequestEvent:  # fmt: skip
    return RequestEvent(
        ts=0.0, engine_id=engine_id, request_id="-", model=MODEL,
        prompt_tokens=recoverable + replayed + recomputed, output_tokens=128, hash_hit_tokens=hit,
        resume_tokens=resume, recoverable_tokens=recoverable, replayed_tokens=replayed,
        recomputed_tokens=recomputed, admission=admission, ttft_seconds=0.05, e2e_seconds=0.9,
        predicted_seconds=0.04, actual_seconds=0.05, **extra,
    )  # fmt: skip


def request_scenarios(engine_id: str) -> list[list[Event]]:
    """Five kinds of request, each one ``request`` event plus four ``cache_lookup`` events, that
    together cover every outcome (hit, recovered, replayed, invalidated, miss), all three tiers
    and six forms, with reasons and recovery times where a real engine would give them."""
    e = engine_id
    ok = Reason.NONE
    return [
        [  # exact resume from device
            _request(e, Admission.EXACT, 2048, 2048, 2048, 0, 2048),
            _lookup(e, Form.FULL_KV, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 2048),
            _lookup(e, Form.SWA_WINDOW, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 2048),
            _lookup(e, Form.LINEAR_STATE, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 2048),
            _lookup(e, Form.INDEXER_STATE, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 2048),
        ],
        [  # swap-in from host and disk
            _request(e, Admission.SWAP_IN, 3072, 3072, 3072, 0, 1024),
            _lookup(e, Form.FULL_KV, Tier.HOST, Outcome.RECOVERED, Reason.KV_EVICTED, 3072, 3072, 3072, recovery_seconds=0.0042, bytes_moved=96 << 20),
            _lookup(e, Form.SWA_WINDOW, Tier.DISK, Outcome.RECOVERED, Reason.SWA_EVICTED, 3072, 3072, 3072, recovery_seconds=0.011, bytes_moved=8 << 20),
            _lookup(e, Form.COMPRESSED_KV, Tier.HOST, Outcome.RECOVERED, Reason.COMPRESSED_EVICTED, 3072, 3072, 3072, recovery_seconds=0.0018, bytes_moved=12 << 20),
            _lookup(e, Form.LINEAR_STATE, Tier.DEVICE, Outcome.HIT, ok, 3072, 3072, 3072),
        ],
        [  # Tail-Replay of a missing linear checkpoint and tail
            _request(e, Admission.TAIL_REPLAY, 2048, 2048, 1920, 128, 2048, approximate=True, limiting_form=Form.LINEAR_STATE, limiting_reason=Reason.LINEAR_CHECKPOINT_MISSING),
            _lookup(e, Form.FULL_KV, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 1920),
            _lookup(e, Form.LINEAR_STATE, Tier.DEVICE, Outcome.REPLAYED, Reason.LINEAR_CHECKPOINT_MISSING, 2048, 1920, 1920, replayed_tokens=128, approximate=True),
            _lookup(e, Form.UNCOMPRESSED_TAIL, Tier.DEVICE, Outcome.REPLAYED, Reason.TAIL_MISSING, 2048, 1920, 1920, replayed_tokens=128),
            _lookup(e, Form.SWA_WINDOW, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 1920),
        ],
        [  # lower resume: compressed and indexer state invalidated
            _request(e, Admission.LOWER_RESUME, 2048, 1024, 1024, 0, 3072, limiting_form=Form.COMPRESSED_KV, limiting_reason=Reason.COMPRESSED_VERSION_MISMATCH),
            _lookup(e, Form.FULL_KV, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 1024),
            _lookup(e, Form.COMPRESSED_KV, Tier.DEVICE, Outcome.INVALIDATED, Reason.COMPRESSED_VERSION_MISMATCH, 2048, 1024, 1024, epoch=3),
            _lookup(e, Form.INDEXER_STATE, Tier.DEVICE, Outcome.INVALIDATED, Reason.INDEXER_STALE, 2048, 1024, 1024, epoch=3),
            _lookup(e, Form.SWA_WINDOW, Tier.DEVICE, Outcome.HIT, ok, 2048, 2048, 1024),
        ],
        [  # cold: nothing matched
            _request(e, Admission.COLD, 0, 0, 0, 0, 4096, limiting_form=Form.FULL_KV, limiting_reason=Reason.NO_PREFIX_MATCH),
            _lookup(e, Form.FULL_KV, Tier.DEVICE, Outcome.MISS, Reason.NO_PREFIX_MATCH, 0, 0, 0),
            _lookup(e, Form.SWA_WINDOW, Tier.DEVICE, Outcome.MISS, Reason.NO_PREFIX_MATCH, 0, 0, 0),
            _lookup(e, Form.LINEAR_STATE, Tier.DEVICE, Outcome.MISS, Reason.NO_PREFIX_MATCH, 0, 0, 0),
            _lookup(e, Form.COMPRESSED_KV, Tier.DEVICE, Outcome.MISS, Reason.NO_PREFIX_MATCH, 0, 0, 0),
        ],
    ]  # fmt: skip


def build_events(engine_id: str, n_events: int) -> list[Event]:
    """``n_events`` fresh events (the scenarios in turn; the last request may be cut short),
    each request's events sharing a request id ``-`` that :func:`stamp` fills in."""
    scenarios = request_scenarios(engine_id)
    events: list[Event] = []
    for r in range(math.ceil(n_events / EVENTS_PER_REQUEST)):
        events.extend(msgspec.structs.replace(ev) for ev in scenarios[r % len(scenarios)])
    return events[:n_events]


def stamp(events: list[Event], ts: float, request_prefix: str) -> None:
    """Re-stamp a batch in place: every event gets ``ts``, every request a fresh id
    ``{request_prefix}{n}`` (its lookups share it). Cheaper than building new structs."""
    request_id = ""
    for i, ev in enumerate(events):
        if i % EVENTS_PER_REQUEST == 0:
            request_id = f"{request_prefix}{i // EVENTS_PER_REQUEST}"
        ev.ts = ts
        ev.request_id = request_id  # type: ignore[union-attr]  # only requests and lookups here


def kind_counts(events: list[Event]) -> dict[str, int]:
    return {TABLE_SPECS[cls].table: n for cls, n in Counter(map(type, events)).items()}


# --- the senders ---------------------------------------------------------------------------------


def sender(
    index: int, url: str, batch_events: int, fmt: ContentFormat, ready: Barrier, go: MpEvent,
    window: Any, results: Any,
) -> None:  # fmt: skip
    """One engine: sequential POSTs (one in flight) of ``batch_events``-event batches until the
    deadline; puts its tallies on ``results``."""
    engine_id = f"bench-engine-{index}"
    events = build_events(engine_id, batch_events)
    batch = EventBatch(
        schema_version=SCHEMA_VERSION, engine_id=engine_id, seq=0, sent_at=0.0, events=events
    )
    encode: Callable[[EventBatch], bytes] = (
        msgspec.msgpack.encode if fmt == "msgpack" else msgspec.json.encode
    )
    client = httpx.Client(timeout=30.0, headers={"Content-Type": MEDIA_TYPES[fmt]})
    statuses: Counter[str] = Counter()
    lags: list[float] = []
    acked_batches = duplicate_batches = window_batches = window_events = 0
    prepare_seconds = 0.0
    prepared = 0
    first_error: str | None = None
    cpu0 = time.process_time()
    ready.wait(timeout=120)
    go.wait(timeout=120)
    measure_from, deadline = window[0], window[1]
    try:
        while time.time() < deadline:
            t0 = time.perf_counter()
            ts = time.time()
            stamp(events, ts, f"{engine_id}-{batch.seq}-")
            batch.sent_at = ts
            body = encode(batch)
            prepare_seconds += time.perf_counter() - t0
            prepared += 1
            while True:  # like the engine's client: the same batch (same seq) until it is taken
                try:
                    resp = client.post(url, content=body)
                except httpx.HTTPError as exc:
                    statuses[f"transport_error:{type(exc).__name__}"] += 1
                    time.sleep(0.01)
                    continue
                ack = time.time()
                statuses[str(resp.status_code)] += 1
                if resp.status_code == 200:
                    break
                if first_error is None:
                    first_error = f"{resp.status_code} {resp.text[:300]}"
                if resp.status_code not in RETRY_STATUSES:  # a bug, not back-pressure
                    raise RuntimeError(f"{engine_id} seq {batch.seq}: {first_error}")
                if time.time() >= deadline + 30:
                    raise RuntimeError(
                        f"{engine_id} seq {batch.seq}: still refused 30 s after the deadline"
                    )
                time.sleep(0.01)
            if msgspec.json.decode(resp.content).get("status") == "duplicate":
                duplicate_batches += 1
            else:
                acked_batches += 1
                if measure_from <= ack <= deadline:
                    window_batches += 1
                    window_events += len(events)
                    lags.append(ack - ts)
            batch.seq += 1
    except Exception as exc:  # report it; the main process decides
        first_error = first_error or f"{type(exc).__name__}: {exc}"
    finally:
        client.close()
    results.put(
        {
            "index": index,
            "acked_batches": acked_batches,
            "duplicate_batches": duplicate_batches,
            "window_batches": window_batches,
            "window_events": window_events,
            "events_per_batch": kind_counts(events),
            "statuses": dict(statuses),
            "lags": lags,
            "prepare_us_per_batch": prepare_seconds / max(prepared, 1) * 1e6,
            "cpu_seconds": time.process_time() - cpu0,
            "error": first_error,
        }
    )


# --- the agent -----------------------------------------------------------------------------------


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


# --- the floor: one Arrow table per table, straight into DuckDB ----------------------------------


def direct_insert(n_events: int, where: Path) -> dict[str, float]:
    """Build ``n_events`` events of the same mix as one batch, turn them into Arrow tables with
    the agent's own :func:`build_tables`, insert them into a fresh store in one transaction."""
    events = build_events("bench-direct", n_events)
    stamp(events, time.time(), "bench-direct-")
    batch = EventBatch(
        schema_version=SCHEMA_VERSION,
        engine_id="bench-direct",
        seq=0,
        sent_at=time.time(),
        events=events,
    )
    with Store.open(where / "direct.duckdb") as store:
        t0 = time.perf_counter()
        tables = build_tables(batch, ingested_at=utc_now())
        t1 = time.perf_counter()
        with store.transaction() as cur:
            for spec in TABLE_SPECS.values():
                table = tables.get(spec.table)
                if table is None:
                    continue
                view = f"_direct_{spec.table}"
                cur.register(view, table)
                cur.execute(
                    f"INSERT INTO {spec.table} ({spec.column_list}) SELECT {spec.column_list} FROM {view}"
                )
                cur.unregister(view)
        t2 = time.perf_counter()
        with store.cursor() as cur:
            stored = sum(cur.execute(f"SELECT count(*) FROM {t}").fetchall()[0][0] for t in tables)
    if stored != n_events:
        raise RuntimeError(f"direct insert stored {stored} rows, expected {n_events}")
    return {"build_seconds": t1 - t0, "insert_seconds": t2 - t1}


# --- main ----------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window")
    parser.add_argument("--senders", type=int, default=8)
    parser.add_argument("--agent-config", type=Path, default=None, help="the agent's YAML config (port and data_dir are set by the benchmark)")
    parser.add_argument("--batch-events", type=int, default=1000)
    parser.add_argument("--format", choices=("msgpack", "json"), default="msgpack")
    parser.add_argument("--warmup-seconds", type=float, default=3.0)
    parser.add_argument(
        "--direct-max-events", type=int, default=500_000,
        help="the direct insert uses the events stored in the window, at most this many",
    )  # fmt: skip
    args = parser.parse_args()
    if (
        args.seconds <= 0
        or args.senders < 1
        or not 1 <= args.batch_events <= 100_000
        or args.warmup_seconds < 0
    ):
        parser.error(
            "need --seconds > 0, --senders >= 1, 1 <= --batch-events <= 100000, --warmup-seconds >= 0"
        )
    fmt: ContentFormat = args.format

    # The batch must pass the agent's own checks, or every POST would be a 422.
    probe = build_events("bench-engine-0", args.batch_events)
    stamp(probe, time.time(), "probe-")
    probe_batch = EventBatch(
        schema_version=SCHEMA_VERSION,
        engine_id="bench-engine-0",
        seq=0,
        sent_at=time.time(),
        events=probe,
    )
    decode_batch(encode_batch(probe_batch, fmt), fmt)

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kvscope-ingest-load-") as tmp:
        where = Path(tmp)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log(f"starting the agent on {base}")
        agent = start_agent(port, where / "data", where / "agent.log", args.agent_config)
        try:
            ready = ctx.Barrier(args.senders + 1)
            go = ctx.Event()
            window = ctx.Array("d", 2)
            results = ctx.Queue()
            procs = [
                ctx.Process(target=sender, args=(i, f"{base}/v1/events", args.batch_events, fmt, ready, go, window, results))
                for i in range(args.senders)
            ]  # fmt: skip
            for p in procs:
                p.start()
            ready.wait(timeout=120)
            start = time.time()
            window[0] = start + args.warmup_seconds
            window[1] = start + args.warmup_seconds + args.seconds
            agent_cpu0 = process_cpu_seconds(agent.pid)
            go.set()
            log(
                f"{args.senders} senders running for {args.warmup_seconds:g} s warm-up + {args.seconds:g} s"
            )
            collected = [
                results.get(timeout=args.warmup_seconds + args.seconds + 180) for _ in procs
            ]
            agent_cpu1 = process_cpu_seconds(agent.pid)
            for p in procs:
                p.join(timeout=30)
            errors = [r["error"] for r in collected if r["error"]]
            if errors:
                log(f"sender errors: {errors}")

            acked = {"batches": sum(r["acked_batches"] for r in collected)}
            for table in TABLE_SPECS[CacheLookup].table, TABLE_SPECS[RequestEvent].table:
                acked[table] = sum(
                    r["acked_batches"] * r["events_per_batch"].get(table, 0) for r in collected
                )
            acked["batch_rows"] = acked["cache_lookups"] + acked["requests"]
            # Acknowledged should mean stored; poll briefly in case the agent acknowledges first.
            poll_until = time.monotonic() + 30
            while True:
                stored = stored_counts(base)
                if stored == acked or time.monotonic() > poll_until:
                    break
                time.sleep(0.2)
            metric = ingest_batches_metric(base)
        finally:
            agent_rc = stop_agent(agent)
        log(f"agent stopped (exit {agent_rc}); stored {stored}, acknowledged {acked}")
        if errors or agent_rc != 0:
            log(f"agent log (tail):\n{(where / 'agent.log').read_text(errors='replace')[-4000:]}")

        window_events = sum(r["window_events"] for r in collected)
        events_per_second = window_events / args.seconds
        lags = [lag for r in collected for lag in r["lags"]]
        statuses: Counter[str] = Counter()
        for r in collected:
            statuses.update(r["statuses"])

        direct_events = max(args.batch_events, min(window_events, args.direct_max_events))
        log(f"direct Arrow insert of {direct_events} events")
        direct = direct_insert(direct_events, where)
    direct_insert_only = direct_events / direct["insert_seconds"]
    direct_build_and_insert = direct_events / (direct["build_seconds"] + direct["insert_seconds"])
    agent_cpu = None if agent_cpu0 is None or agent_cpu1 is None else agent_cpu1 - agent_cpu0

    doc = {
        "seconds": args.seconds,
        "warmup_seconds": args.warmup_seconds,
        "senders": args.senders,
        "batch_events": args.batch_events,
        "format": fmt,
        "events_per_second_stored": events_per_second,
        "events_in_window": window_events,
        "batches_acked": sum(r["window_batches"] for r in collected),
        "batches_acked_total": acked["batches"],
        "duplicate_batches": sum(r["duplicate_batches"] for r in collected),
        "http_status_counts": dict(sorted(statuses.items())),
        "sender_errors": errors,
        "ingest_lag_definition": "per acknowledged batch in the window: sender's ack time - the batch's event ts",
        "ingest_lag_p50_seconds": percentile(lags, 0.50),
        "ingest_lag_p99_seconds": percentile(lags, 0.99),
        "ingest_lag_max_seconds": max(lags) if lags else None,
        "stored_counts": stored,
        "acked_counts": acked,
        "stored_matches_acked": stored == acked,
        "agent_exit_code": agent_rc,
        "kvscope_ingest_batches_total": metric,
        "agent_cpu_seconds": agent_cpu,
        "sender_cpu_seconds": sum(r["cpu_seconds"] for r in collected),
        "sender_prepare_us_per_batch": sum(r["prepare_us_per_batch"] for r in collected)
        / len(collected),
        "direct_events": direct_events,
        "direct_build_seconds": direct["build_seconds"],
        "direct_insert_seconds": direct["insert_seconds"],
        "direct_insert_only_events_per_second": direct_insert_only,
        "direct_build_and_insert_events_per_second": direct_build_and_insert,
        "direct_arrow_events_per_second": direct_build_and_insert,
        "ratio_basis": "direct_build_and_insert_events_per_second (build_tables from event objects + one-transaction INSERT)",
        "ratio_agent_to_direct_arrow": events_per_second / direct_build_and_insert,
        "ratio_agent_to_direct_insert_only": events_per_second / direct_insert_only,
        "target_events_per_second": TARGET_EVENTS_PER_SECOND,
        "meets_target": events_per_second >= TARGET_EVENTS_PER_SECOND,
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(doc))
    p99 = doc["ingest_lag_p99_seconds"]
    log(
        f"{events_per_second:,.0f} events/s stored (target {TARGET_EVENTS_PER_SECOND:,}), "
        f"lag p99 {p99 if p99 is None else f'{p99:.3f} s'}, "
        f"direct build+insert {direct_build_and_insert:,.0f} events/s "
        f"(ratio {doc['ratio_agent_to_direct_arrow']:.3f})"
    )


if __name__ == "__main__":
    main()
