"""``/metrics`` under label cardinality: exposition size, scrape time, and ``/healthz`` latency
while a scrape is in flight (issue 19: 20,000 distinct models made ``/metrics`` 74 MB, a scrape
took 29–56 s on the event loop and ``/healthz`` 27 s).

Two real agent processes (``create_app`` on uvicorn, 127.0.0.1, a free port, temporary data
directory) in one run, side by side:

* ``capped``: the default label cap (``metric_label_max_values`` 100) after ``--models``
  distinct models (one request and one cache lookup each).
* ``uncapped``: a cap above ``--uncapped-models`` (so every model keeps its series, as before
  the cap), scraped both through ``GET /metrics`` (rendered in a worker thread) and through a
  benchmark-only route that renders on the event loop (the old handler) — the ratio of their
  ``/healthz`` latencies during a scrape is what moving the render off the loop buys.

``/healthz`` is polled back to back while one scrape runs (a thread); reported: the median idle
latency, the median and maximum latency during the scrape. Acceptance (reported, never asserted):
``capped.metrics_bytes`` < 1 MB and ``capped.healthz_during_scrape_max_seconds`` < 0.5 s.

``python -m benchmarks.metrics_scrape [--models 20000] [--uncapped-models 3000]`` (about 30 s
on 2 cores). Prints one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

from benchmarks.bench_agent import free_port, launch_agent, stop_agent

PER_BATCH = 5_000
AGENT_SCRIPT = """
import sys
from pathlib import Path
import uvicorn
from fastapi.responses import Response
from agent.app import create_app
from agent.config import AgentConfig
from agent.metrics import AgentMetrics
port, data_dir, cap = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
data_dir.mkdir(parents=True, exist_ok=True)
config = AgentConfig(data_dir=data_dir, port=port, decode_processes=0, max_body_bytes=64 << 20)
metrics = AgentMetrics(label_max_values=cap)
app = create_app(config, metrics=metrics, environ={})
@app.get("/bench/metrics-on-loop")
async def metrics_on_loop() -> Response:  # the handler before issue 19: rendered on the loop
    return Response(metrics.exposition())
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""


def log(message: str) -> None:
    print(f"[metrics_scrape] {message}", file=sys.stderr, flush=True)


def start_agent(port: int, data: Path, cap: int, log_path: Path) -> subprocess.Popen[bytes]:
    return launch_agent(AGENT_SCRIPT, [str(port), str(data), str(cap)], port, log_path)


def events(models: range, ts: float) -> list[dict[str, Any]]:
    """One request and one cache lookup per model (each model a distinct label value)."""
    out: list[dict[str, Any]] = []
    for i in models:
        common = {
            "ts": ts,
            "engine_id": "bench-engine",
            "request_id": f"r{i}",
            "model": f"model-{i:06d}",
        }
        out.append({
            **common, "kind": "cache_lookup", "form": "full_kv", "tier": "device", "outcome": "hit",
            "reason": "none", "hash_hit_tokens": 512, "usable_tokens": 512, "recoverable_tokens": 512,
        })  # fmt: skip
        out.append({
            **common, "kind": "request", "prompt_tokens": 1024, "output_tokens": 16, "hash_hit_tokens": 512,
            "resume_tokens": 512, "recoverable_tokens": 512, "replayed_tokens": 0, "recomputed_tokens": 512,
            "admission": "exact", "ttft_seconds": 0.05, "e2e_seconds": 0.5,
        })  # fmt: skip
    return out


def ingest(client: httpx.Client, n_models: int) -> None:
    ts = time.time() - 30
    for seq, start in enumerate(range(0, n_models, PER_BATCH)):
        batch = {
            "schema_version": 1, "engine_id": "bench-engine", "seq": seq, "sent_at": time.time(),
            "events": events(range(start, min(start + PER_BATCH, n_models)), ts),
        }  # fmt: skip
        response = client.post(
            "/v1/events",
            content=msgspec.msgpack.encode(batch),
            headers={"content-type": "application/msgpack"},
        )
        response.raise_for_status()


def healthz_seconds(client: httpx.Client) -> float:
    start = time.perf_counter()
    client.get("/healthz").raise_for_status()
    return time.perf_counter() - start


def scrape_with_probe(base: str, path: str) -> dict[str, float]:
    """One scrape of ``path`` in a thread while ``/healthz`` is polled back to back."""
    with httpx.Client(base_url=base, timeout=120) as probe:
        idle = statistics.median(healthz_seconds(probe) for _ in range(20))
        result: dict[str, float] = {}

        def scrape() -> None:
            with httpx.Client(base_url=base, timeout=120) as scraper:
                start = time.perf_counter()
                response = scraper.get(path)
                response.raise_for_status()
                result["scrape_seconds"] = time.perf_counter() - start
                result["metrics_bytes"] = float(len(response.content))

        thread = threading.Thread(target=scrape)
        thread.start()
        during: list[float] = []
        while thread.is_alive() or not during:
            during.append(healthz_seconds(probe))
        thread.join()
    return {
        **result,
        "healthz_idle_median_seconds": idle,
        "healthz_during_scrape_median_seconds": statistics.median(during),
        "healthz_during_scrape_max_seconds": max(during),
        "healthz_probes_during_scrape": float(len(during)),
    }


def run_agent(
    n_models: int, cap: int, paths: list[str], workdir: Path
) -> dict[str, dict[str, float]]:
    port = free_port()
    process = start_agent(port, workdir / f"data-{cap}", cap, workdir / f"agent-{cap}.log")
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=120) as client:
            log(f"cap {cap}: ingesting {n_models} distinct models")
            ingest(client, n_models)
        out = {}
        for path in paths:
            log(f"cap {cap}: scraping {path}")
            out[path] = scrape_with_probe(base, path)
        return out
    finally:
        stop_agent(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=20_000)
    parser.add_argument("--uncapped-models", type=int, default=3_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvscope-metrics-scrape-") as tmp:
        workdir = Path(tmp)
        capped = run_agent(args.models, 100, ["/metrics"], workdir)["/metrics"]
        uncapped = run_agent(
            args.uncapped_models,
            args.uncapped_models + 1,
            ["/metrics", "/bench/metrics-on-loop"],
            workdir,
        )
    threaded, on_loop = uncapped["/metrics"], uncapped["/bench/metrics-on-loop"]
    report = {
        "models": args.models,
        "label_max_values": 100,
        "capped": capped,
        "uncapped_models": args.uncapped_models,
        "uncapped_threaded": threaded,
        "uncapped_on_loop": on_loop,
        "healthz_max_ratio_on_loop_vs_threaded": on_loop["healthz_during_scrape_max_seconds"]
        / threaded["healthz_during_scrape_max_seconds"],
        "meets_target": capped["metrics_bytes"] < 1_000_000
        and capped["healthz_during_scrape_max_seconds"] < 0.5,
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
