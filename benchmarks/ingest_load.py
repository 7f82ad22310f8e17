"""Agent ingest under load: several engine-like senders on loopback push event batches to a real
agent process (``POST /v1/events``) for a fixed time, for each body format in turn (a fresh agent
per format); then the same kind of events is inserted as one Arrow table per table straight into
a fresh DuckDB store, in the same run, as the floor. Every sender builds every batch from
engine-like events through the telemetry client's own encoder
(:func:`engine.events_arrow.encode_body`) and its CPU time is counted. Prints one JSON object (see
:func:`main` for the fields) with the load average beside the figures; progress goes to stderr.

``python -m benchmarks.ingest_load [--seconds S] [--senders N] [--batch-events B]
[--formats arrow,msgpack,json | --format F] [--warmup-seconds W] [--direct-max-events E]``
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections import Counter
from multiprocessing.synchronize import Barrier
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import httpx
import msgspec

from agent.ingest import TABLE_SPECS, build_tables
from agent.ingest_stages import STAGES
from agent.store import Store, utc_now
from benchmarks.bench_agent import (
    free_port,
    ingest_batches_metric,
    metric_samples,
    percentile,
    process_cpu_seconds,
    start_agent,
    stop_agent,
    stored_counts,
)
from benchmarks.bench_events import build_events, kind_counts, stamp
from engine.events import SCHEMA_VERSION, CacheLookup, EventBatch, RequestEvent
from engine.events_arrow import WireFormat, media_type
from engine.events_arrow_check import batch_dict
from engine.events_arrow_encode import encode_body
from engine.telemetry import TelemetryClient

TARGET_EVENTS_PER_SECOND = 200_000
DEFAULT_BATCH_EVENTS: int = inspect.signature(TelemetryClient).parameters["batch_max_events"].default
RETRY_STATUSES = frozenset({429, 503})
"""Back-pressure (queue full): the sender retries the same batch; any other error stops it."""
FORMATS: tuple[WireFormat, ...] = ("arrow", "msgpack", "json")


def log(message: str) -> None:
    print(f"[ingest_load] {message}", file=sys.stderr, flush=True)


# --- the senders ---------------------------------------------------------------------------------


def sender(
    index: int, url: str, batch_events: int, fmt: WireFormat, ready: Barrier, go: MpEvent,
    window: Any, results: Any,
) -> None:  # fmt: skip
    """One engine: sequential POSTs (one in flight) of ``batch_events``-event batches until the
    deadline, each encoded anew by the telemetry client's encoder; puts its tallies on
    ``results``."""
    engine_id = f"bench-engine-{index}"
    run_id = f"bench-run-{index}"
    events = build_events(engine_id, batch_events)
    client = httpx.Client(timeout=30.0)
    statuses: Counter[str] = Counter()
    lags: list[float] = []
    acked_batches = duplicate_batches = window_batches = window_events = seq = 0
    encode_seconds = 0.0
    encoded = 0
    first_error: str | None = None
    cpu0 = time.process_time()
    ready.wait(timeout=120)
    go.wait(timeout=120)
    measure_from, deadline = window[0], window[1]
    try:
        while time.time() < deadline:
            t0 = time.perf_counter()
            ts = time.time()
            stamp(events, ts, f"{engine_id}-{seq}-")
            body = encode_body(fmt, events, engine_id=engine_id, seq=seq, sent_at=ts, run_id=run_id)
            encode_seconds += time.perf_counter() - t0
            encoded += 1
            while True:  # like the engine's client: the same batch (same seq) until it is taken
                try:
                    resp = client.post(url, content=body, headers={"Content-Type": media_type(body)})
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
                    raise RuntimeError(f"{engine_id} seq {seq}: {first_error}")
                if time.time() >= deadline + 30:
                    raise RuntimeError(f"{engine_id} seq {seq}: still refused 30 s after the deadline")
                time.sleep(0.01)
            if msgspec.json.decode(resp.content).get("status") == "duplicate":
                duplicate_batches += 1
            else:
                acked_batches += 1
                if measure_from <= ack <= deadline:
                    window_batches += 1
                    window_events += len(events)
                    lags.append(ack - ts)
            seq += 1
    except Exception as exc:  # report it; the main process decides
        first_error = first_error or f"{type(exc).__name__}: {exc}"
    finally:
        client.close()
    results.put(
        {
            "acked_batches": acked_batches,
            "duplicate_batches": duplicate_batches,
            "window_batches": window_batches,
            "window_events": window_events,
            "events_per_batch": kind_counts(events),
            "statuses": dict(statuses),
            "lags": lags,
            "encode_us_per_batch": encode_seconds / max(encoded, 1) * 1e6,
            "cpu_seconds": time.process_time() - cpu0,
            "error": first_error,
        }
    )


# --- one format against a fresh agent ------------------------------------------------------------


def run_format(fmt: WireFormat, args: argparse.Namespace, where: Path) -> dict[str, Any]:
    """Senders against a fresh agent for ``args.seconds`` (after the warm-up), then the agent's
    stored counts, metrics and CPU; the figures of one format."""
    ctx = mp.get_context("spawn")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log(f"{fmt}: starting the agent on {base}")
    agent = start_agent(port, where / f"data-{fmt}", where / f"agent-{fmt}.log", args.agent_config)
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
        stages0 = metric_samples(base, "kvscope_ingest_stage_seconds_total")
        batches0 = ingest_batches_metric(base).get("stored", 0.0)
        go.set()
        log(f"{fmt}: {args.senders} senders for {args.warmup_seconds:g} s warm-up + {args.seconds:g} s")
        collected = [results.get(timeout=args.warmup_seconds + args.seconds + 180) for _ in procs]
        agent_cpu1 = process_cpu_seconds(agent.pid)
        for p in procs:
            p.join(timeout=30)
        acked = {"batches": sum(r["acked_batches"] for r in collected)}
        for table in TABLE_SPECS[CacheLookup].table, TABLE_SPECS[RequestEvent].table:
            acked[table] = sum(r["acked_batches"] * r["events_per_batch"].get(table, 0) for r in collected)
        acked["batch_rows"] = acked["cache_lookups"] + acked["requests"]
        poll_until = time.monotonic() + 30  # acknowledged should mean stored: poll in case it lags
        while True:
            stored = stored_counts(base)
            if stored == acked or time.monotonic() > poll_until:
                break
            time.sleep(0.2)
        metric = ingest_batches_metric(base)
        stages1 = metric_samples(base, "kvscope_ingest_stage_seconds_total")
        flushes = metric_samples(base, "kvscope_ingest_flush_batches_count").get("", 0.0)
    finally:
        agent_rc = stop_agent(agent)
    errors = [r["error"] for r in collected if r["error"]]
    if errors or agent_rc != 0:
        log(f"{fmt}: sender errors {errors}; agent log (tail):\n{(where / f'agent-{fmt}.log').read_text(errors='replace')[-4000:]}")
    window_events = sum(r["window_events"] for r in collected)
    lags = [lag for r in collected for lag in r["lags"]]
    statuses: Counter[str] = Counter()
    for r in collected:
        statuses.update(r["statuses"])
    batches = max(metric.get("stored", 0.0) - batches0, 1.0)
    split = {stage: (stages1.get(f'stage="{stage}"', 0.0) - stages0.get(f'stage="{stage}"', 0.0)) / batches * 1e3 for stage in STAGES}
    agent_cpu = None if agent_cpu0 is None or agent_cpu1 is None else agent_cpu1 - agent_cpu0
    sender_cpu = sum(r["cpu_seconds"] for r in collected)
    all_batches = acked["batches"] + sum(r["duplicate_batches"] for r in collected)
    return {
        "events_per_second_stored": window_events / args.seconds,
        "events_in_window": window_events,
        "batches_acked": sum(r["window_batches"] for r in collected),
        "batches_acked_total": acked["batches"],
        "duplicate_batches": sum(r["duplicate_batches"] for r in collected),
        "http_status_counts": dict(sorted(statuses.items())),
        "sender_errors": errors,
        "ingest_lag_p50_seconds": percentile(lags, 0.50),
        "ingest_lag_p99_seconds": percentile(lags, 0.99),
        "stored_counts": stored,
        "acked_counts": acked,
        "stored_matches_acked": stored == acked,
        "agent_exit_code": agent_rc,
        "kvscope_ingest_batches_total": metric,
        "agent_cpu_seconds": agent_cpu,
        "sender_cpu_seconds": sender_cpu,
        "agent_cpu_ms_per_batch": None if agent_cpu is None else agent_cpu / max(all_batches, 1) * 1e3,
        "sender_cpu_ms_per_batch": sender_cpu / max(all_batches, 1) * 1e3,
        "sender_encode_us_per_batch": sum(r["encode_us_per_batch"] for r in collected) / len(collected),
        "agent_ms_per_batch_by_stage": split,
        "batches_per_flush": metric.get("stored", 0.0) / max(flushes, 1.0),
    }


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window per format (default 30)")
    parser.add_argument("--senders", type=int, default=8, help="sender processes (default 8)")
    parser.add_argument("--agent-config", type=Path, default=None, help="the agent's YAML config (port and data_dir are set by the benchmark)")
    parser.add_argument(
        "--batch-events", type=int, default=DEFAULT_BATCH_EVENTS,
        help=f"events per batch (default {DEFAULT_BATCH_EVENTS}, the telemetry client's batch_max_events)",
    )  # fmt: skip
    parser.add_argument("--formats", default=",".join(FORMATS), help="body formats, one after the other (default arrow,msgpack,json)")
    parser.add_argument("--format", choices=FORMATS, default=None, help="one format only (instead of --formats)")
    parser.add_argument("--warmup-seconds", type=float, default=3.0, help="unmeasured seconds before each window (default 3)")
    parser.add_argument(
        "--direct-max-events", type=int, default=500_000,
        help="the direct insert uses the most events one format stored in its window, at most this many (default 500000)",
    )  # fmt: skip
    args = parser.parse_args()
    formats = [args.format] if args.format else [f.strip() for f in args.formats.split(",") if f.strip()]
    if args.seconds <= 0 or args.senders < 1 or not 1 <= args.batch_events <= 100_000 or args.warmup_seconds < 0:
        parser.error("need --seconds > 0, --senders >= 1, 1 <= --batch-events <= 100000, --warmup-seconds >= 0")
    if not formats or any(f not in FORMATS for f in formats):
        parser.error(f"--formats takes a comma-separated list of {', '.join(FORMATS)}")
    for fmt in formats:  # the batch must pass the agent's own checks, or every POST would be a 422
        probe = build_events("bench-engine-0", args.batch_events)
        stamp(probe, time.time(), "probe-")
        batch_dict(encode_body(fmt, probe, engine_id="bench-engine-0", seq=0, sent_at=time.time()))
    load_before = os.getloadavg()
    per_format: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvscope-ingest-load-") as tmp:
        where = Path(tmp)
        for fmt in formats:
            per_format[fmt] = run_format(fmt, args, where)
            log(f"{fmt}: {per_format[fmt]['events_per_second_stored']:,.0f} events/s stored")
        most = max(f["events_in_window"] for f in per_format.values())
        direct_events = max(args.batch_events, min(most, args.direct_max_events))
        log(f"direct Arrow insert of {direct_events} events")
        direct = direct_insert(direct_events, where)
    load_after = os.getloadavg()
    insert_only = direct_events / direct["insert_seconds"]
    build_and_insert = direct_events / (direct["build_seconds"] + direct["insert_seconds"])
    for figures in per_format.values():
        figures["ratio_to_direct_insert"] = figures["events_per_second_stored"] / insert_only
        figures["ratio_to_direct_build_and_insert"] = figures["events_per_second_stored"] / build_and_insert
    headline = per_format.get("arrow", next(iter(per_format.values())))
    doc = {
        "seconds": args.seconds,
        "warmup_seconds": args.warmup_seconds,
        "senders": args.senders,
        "batch_events": args.batch_events,
        "formats": per_format,
        "direct_events": direct_events,
        "direct_build_seconds": direct["build_seconds"],
        "direct_insert_seconds": direct["insert_seconds"],
        "direct_insert_only_events_per_second": insert_only,
        "direct_build_and_insert_events_per_second": build_and_insert,
        "ratio_basis": "ratio_to_direct_insert: stored events/s over the one-transaction INSERT of Arrow tables alone (DuckDB's own cost)",
        "target_events_per_second": TARGET_EVENTS_PER_SECOND,
        "meets_target": "arrow" in per_format and per_format["arrow"]["events_per_second_stored"] >= TARGET_EVENTS_PER_SECOND,
        "stored_matches_acked": all(f["stored_matches_acked"] for f in per_format.values()),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(doc))
    log(
        f"{headline['events_per_second_stored']:,.0f} events/s stored (target {TARGET_EVENTS_PER_SECOND:,}), "
        f"direct insert {insert_only:,.0f} events/s (ratio {headline['ratio_to_direct_insert']:.3f}), "
        f"load {load_before[0]:.2f} -> {load_after[0]:.2f}"
    )


if __name__ == "__main__":
    main()
