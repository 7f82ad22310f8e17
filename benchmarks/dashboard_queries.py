"""Dashboard query latency on a big store: every named query each dashboard page runs, against a
DuckDB store holding ``--lookups`` (default 10 million) ``cache_lookups`` rows, one request per
six lookups, the ``cache_minute`` rollup of them, engine stats and batches — spread over the last
``--hours`` hours, so the pages' default windows (15 minutes, 1 hour) cut through real volume.

Rows are generated as Arrow tables (numpy, seeded) and inserted the way the agent's flusher
does; the rollups are folded with the agent's own :func:`agent.rollups.fold_cache_minute` and
:func:`agent.rollups.fold_form_usable_minute` (their first fold and a ten-second one are timed). Each
query then runs ``--repeats`` times through the agent's read-only path
(:func:`agent.sql.run_read_query`, what ``GET /v1/query/{name}`` calls); reported per query:
median and max milliseconds, rows returned; per page: the slowest query's median and the sum of
the medians (a page runs its queries one after another); and whether every page's slowest query
is under ``target_ms`` (300). ``overview_24h`` is the Overview at the widest window offered. One JSON object on stdout; progress on stderr.

``python -m benchmarks.dashboard_queries [--lookups N] [--hours H] [--repeats R]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa

from agent import queries, sql
from agent.ingest import registered
from agent.rollups import fold_cache_minute, fold_form_usable_minute
from agent.store import Store, to_timestamp

PAGES: dict[str, list[tuple[str, dict[str, str]]]] = {
    "overview_24h": [  # the widest window the sidebar offers
        ("hit_rate_timeseries", {"since_seconds": "86400", "bucket_seconds": "900"}),
        ("form_usable_timeseries", {"since_seconds": "86400", "bucket_seconds": "900"}),
        ("form_timeseries", {"since_seconds": "86400", "bucket_seconds": "900"}),
        ("ingest_health", {"since_seconds": "86400", "bucket_seconds": "900"}),
        ("engines", {"since_seconds": "86400"}),
    ],
    "overview": [
        ("hit_rate_timeseries", {"since_seconds": "900", "bucket_seconds": "15"}),
        ("form_usable_timeseries", {"since_seconds": "900", "bucket_seconds": "15"}),
        ("form_timeseries", {"since_seconds": "900", "bucket_seconds": "60"}),
        ("ingest_health", {"since_seconds": "900", "bucket_seconds": "15"}),
        ("engines", {"since_seconds": "900"}),
    ],
    "forms": [
        ("form_timeseries", {"since_seconds": "3600", "bucket_seconds": "60", "form": "swa_window"}),
        ("limiting_forms", {"since_seconds": "3600", "bucket_seconds": "60"}),
    ],
    "requests": [
        ("recent_requests", {"limit": "500", "since_seconds": "900"}),
        ("recent_requests", {"limit": "500", "since_seconds": "900", "search": "r9", "limiting_form": "swa_window"}),
        ("request_lookups", {"request_id": "MIDDLE"}),  # a request halfway through the store
    ],
    "alerts": [("alerts_recent", {"limit": "500"})],
    "sql": [("schema", {})],
    "capacity": [
        ("capacity_timeseries", {"since_seconds": "900", "bucket_seconds": "15"}),
        ("capacity_latest", {"since_seconds": "900"}),
        ("gpu_timeseries", {"since_seconds": "900", "bucket_seconds": "15"}),
        ("form_ghosts", {"since_seconds": "900"}),
        ("capacity_whatif", {"since_seconds": "900", "extra_mib_swa_window": "32", "extra_mib_linear_state": "16"}),
        ("capacity_whatif", {"since_seconds": "900", "extra_mib_full_kv": "-64", "extra_mib_linear_state": "16"}),
    ],
    "capacity_1h": [
        ("form_ghosts", {"since_seconds": "3600"}),
        ("capacity_whatif", {"since_seconds": "3600", "extra_mib_swa_window": "32", "extra_mib_linear_state": "16"}),
    ],
}
FORMS = np.array(["full_kv", "swa_window", "compressed_kv", "uncompressed_tail", "indexer_state", "linear_state"])
TARGET_MS = 300.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def generate(store: Store, lookups: int, hours: float, seed: int) -> dict[str, float]:
    """Fill ``store`` with ``lookups`` lookups (6 per request, one per form), their requests,
    engine stats every 5 s per form, and one ingest batch per 1000 events; fold the rollups.
    Returns the seconds the rollup folds took: the first (everything) and a later one (the
    agent's usual case: ten seconds of traffic at the store's average rate, newly stored)."""
    rng = np.random.default_rng(seed)
    now = time.time()
    start = now - hours * 3600
    chunk = 1_000_000
    requests_total = lookups // 6
    ingested = to_timestamp(now)
    for first in range(0, requests_total, chunk // 6):
        n = min(chunk // 6, requests_total - first)
        requests, lookups_table = traffic(rng, first, np.sort(rng.uniform(start, now, n)), ingested)
        with store.transaction() as cur:
            insert(cur, "requests", requests)
            insert(cur, "cache_lookups", lookups_table)
        log(f"  {first * 6 + n * 6:,} lookups stored")
    steps = np.arange(start, now, 5.0)
    stats = pa.table(
        {
            "ts": pa.array(np.repeat((steps * 1e6).astype(np.int64), 6), pa.timestamp("us")), "engine_id": np.full(len(steps) * 6, "e1"),
            "model": np.full(len(steps) * 6, "m1"), "form": np.tile(FORMS, len(steps)), "tier": np.full(len(steps) * 6, "device"),
            "used_bytes": rng.integers(0, 1 << 30, len(steps) * 6), "used_blocks": rng.integers(0, 4096, len(steps) * 6),
            "cached_blocks": rng.integers(0, 4096, len(steps) * 6), "free_blocks": rng.integers(0, 4096, len(steps) * 6),
            "total_blocks": np.full(len(steps) * 6, 4096), "running_requests": np.zeros(len(steps) * 6, np.int64),
            "waiting_requests": np.zeros(len(steps) * 6, np.int64), "recoveries_in_flight": np.zeros(len(steps) * 6, np.int64),
            "ingested_at": pa.array([ingested] * (len(steps) * 6), pa.timestamp("us")),
        }
    )  # fmt: skip
    batches = pa.table(
        {
            "engine_id": np.full(lookups // 1000 + 1, "e1"), "seq": np.arange(lookups // 1000 + 1),
            "received_at": pa.array((np.linspace(start, now, lookups // 1000 + 1) * 1e6).astype(np.int64), pa.timestamp("us")),
            "rows": np.full(lookups // 1000 + 1, 1000), "status": np.full(lookups // 1000 + 1, "stored"),
        }
    )  # fmt: skip
    with store.transaction() as cur:
        insert(cur, "engine_stats", stats)
        insert(cur, "ingest_batches", batches)
    log("  folding the rollups ...")
    folds: dict[str, float] = {}

    def fold_both(label: str) -> None:
        for name, fold in (("cache_minute", fold_cache_minute), ("form_usable_minute", fold_form_usable_minute)):
            began = time.perf_counter()
            fold(store)
            folds[f"{name}_{label}_s"] = round(time.perf_counter() - began, 3)

    fold_both("first")
    n = max(1, round(requests_total / (hours * 360)))  # ten seconds of requests
    requests, lookups_table = traffic(rng, requests_total, np.sort(rng.uniform(now - 10, now, n)), to_timestamp(time.time()))
    with store.transaction() as cur:
        insert(cur, "requests", requests)
        insert(cur, "cache_lookups", lookups_table)
    fold_both("10s")
    store.checkpoint()
    return folds


def traffic(rng: np.random.Generator, first: int, ts: np.ndarray, ingested: datetime) -> tuple[pa.Table, pa.Table]:
    """Requests ``r{first}``, ... at ``ts`` (unix seconds) on four engines and their six
    lookups each (one per form), stamped ``ingested``."""
    n = len(ts)
    ids = np.arange(first, first + n)
    engine = np.array(["e1", "e2", "e3", "e4"])[ids % 4]
    prompt = rng.integers(256, 8192, n)
    hash_hit = (prompt * rng.uniform(0, 1, n)).astype(np.int64)
    usable = hash_hit[:, None] * rng.uniform(0.3, 1.0, (n, 6))
    usable = usable.astype(np.int64)
    resume = usable.min(axis=1)
    outcome = np.where(usable == hash_hit[:, None], "hit", np.where(rng.uniform(0, 1, (n, 6)) < 0.2, "recovered", "invalidated"))
    reason = np.where(outcome == "hit", "none", np.where(outcome == "recovered", "kv_evicted", "swa_evicted"))
    tier = np.where(outcome == "recovered", "host", "device")
    limiting = FORMS[usable.argmin(axis=1)]
    ts_us = pa.array((ts * 1e6).astype(np.int64), pa.timestamp("us"))
    requests = pa.table(
        {
            "ts": ts_us, "engine_id": engine, "request_id": np.char.add("r", ids.astype(str)), "model": np.full(n, "m1"),
            "prompt_tokens": prompt, "output_tokens": np.full(n, 16), "hash_hit_tokens": hash_hit, "resume_tokens": resume,
            "recoverable_tokens": resume, "replayed_tokens": np.zeros(n, np.int64), "recomputed_tokens": prompt - resume,
            "approximate": np.zeros(n, bool), "limiting_form": limiting, "limiting_reason": np.full(n, "swa_evicted"),
            "admission": np.full(n, "exact"), "ttft_seconds": rng.uniform(0.01, 2, n), "e2e_seconds": rng.uniform(0.1, 5, n),
            "predicted_seconds": rng.uniform(0, 1, n), "actual_seconds": rng.uniform(0, 1, n),
            "ingested_at": pa.array([ingested] * n, pa.timestamp("us")),
        }
    )  # fmt: skip
    m = n * 6
    ghosted = (outcome.reshape(-1) == "invalidated") & (rng.uniform(0, 1, m) < 0.5)
    lookups_table = pa.table(
        {
            "ts": pa.array(np.repeat((ts * 1e6).astype(np.int64), 6), pa.timestamp("us")),
            "engine_id": np.repeat(engine, 6), "request_id": np.repeat(requests.column("request_id").to_numpy(zero_copy_only=False), 6),
            "model": np.full(m, "m1"), "form": np.tile(FORMS, n), "tier": tier.reshape(-1), "outcome": outcome.reshape(-1),
            "reason": reason.reshape(-1), "hash_hit_tokens": np.repeat(hash_hit, 6), "usable_tokens": usable.reshape(-1),
            "recoverable_tokens": usable.reshape(-1), "replayed_tokens": np.zeros(m, np.int64), "approximate": np.zeros(m, bool),
            "recovery_seconds": np.where(outcome.reshape(-1) == "recovered", rng.exponential(0.05, m), 0.0),
            "bytes_moved": np.zeros(m, np.int64), "layer_group": np.zeros(m, np.int32), "tp_rank": np.zeros(m, np.int32),
            "epoch": np.zeros(m, np.int64), "ingested_at": pa.array([ingested] * m, pa.timestamp("us")),
            # half the invalidated lookups could have resumed at their hash hit with 1-64 MiB more
            "ghost_tokens": np.where(ghosted, np.repeat(hash_hit, 6), 0),
            "ghost_bytes": pa.array(np.where(ghosted, rng.integers(1, 64, m) << 20, 0), mask=~ghosted),
            # every lookup that resumed had 0-256 MiB to spare
            "spare_bytes": pa.array(rng.integers(0, 256, m) << 20, mask=usable.reshape(-1) == 0),
        }
    )  # fmt: skip
    return requests, lookups_table


def insert(cur: object, name: str, table: pa.Table) -> None:
    """One Arrow table into ``name`` by column name (as the agent's flusher inserts)."""
    columns = ", ".join(table.column_names)
    with registered(cur, "_bench_rows", table):  # type: ignore[arg-type]
        cur.execute(f"INSERT INTO {name} ({columns}) SELECT {columns} FROM _bench_rows")  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--lookups", type=int, default=10_000_000)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvscope-dashq-") as tmp:
        store = Store.open(Path(tmp) / "big.duckdb")
        try:
            log(f"generating {args.lookups:,} lookups over {args.hours:g} h ...")
            began = time.perf_counter()
            folds = generate(store, args.lookups, args.hours, args.seed)
            build_seconds = time.perf_counter() - began
            with store.cursor() as cur:
                counts = {t: cur.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("cache_lookups", "requests", "cache_minute", "form_usable_minute", "engine_stats")}  # type: ignore[index]
            timings: dict[str, dict[str, object]] = {}
            pages: dict[str, float] = {}
            totals: dict[str, float] = {}
            for page, calls in PAGES.items():
                slowest = 0.0
                total = 0.0
                for name, params in calls:
                    query = queries.get_query(name)
                    if params.get("request_id") == "MIDDLE":
                        params = {**params, "request_id": f"r{args.lookups // 12}"}
                    bound = query.bind(params, now=datetime.now(UTC).replace(tzinfo=None))
                    runs = []
                    rows = 0
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        result = sql.run_read_query(store, query.sql, bound, row_limit=10_000, timeout_seconds=60)
                        runs.append((time.perf_counter() - t0) * 1000)
                        rows = result.table.num_rows
                    median = statistics.median(runs)
                    key = f"{page}:{name}" if f"{page}:{name}" not in timings else f"{page}:{name}:2"
                    timings[key] = {"median_ms": round(median, 1), "max_ms": round(max(runs), 1), "rows": rows}
                    slowest = max(slowest, median)
                    total += median
                    log(f"  {page:9} {name:24} median {median:7.1f} ms  ({rows} rows)")
                pages[page] = round(slowest, 1)
                totals[page] = round(total, 1)
        finally:
            store.close()
    print(
        json.dumps(
            {
                "benchmark": "dashboard_queries",
                "rows": counts,
                "hours": args.hours,
                "repeats": args.repeats,
                "build_seconds": round(build_seconds, 1),
                "rollup_fold_seconds": folds,
                "queries": timings,
                "page_slowest_median_ms": pages,
                "page_total_median_ms": totals,
                "target_ms": TARGET_MS,
                "meets_target": all(v <= TARGET_MS for v in pages.values()),
            }
        )
    )


if __name__ == "__main__":
    main()
