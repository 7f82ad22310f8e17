"""What ``kvscope serve`` tells its operator, as vLLM's server does: the start-up banner, one
access-log line per request, the periodic stats line, and ``/metrics`` (a ``model_name`` label
on every series, TTFT / inter-token / end-to-end histograms, token counters, cache usage per form,
prefix-cache counters, no ``_created`` series) — on the tiny model served on loopback with a
cache flag of ``kvscope serve`` (``--cache-memory-mib``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.events import Form, RequestEvent
from engine.llm import LLM
from engine.runtime import Runtime, SchedulerConfig
from engine.runtime.engine_loop import EngineLoop
from engine.runtime.engine_snapshot import EngineSnapshot, FormUsage
from engine.runtime.server import create_app, serve_in_thread
from engine.runtime.server_log import LOG, StatsLine, banner
from engine.runtime.server_metrics import ServerTotals
from engine.telemetry import ListSink
from kvscope.cli_args import UserError, cache_config, replay_config
from kvscope.cli_parser import build_parser
from kvscope.commands_engine import cmd_serve
from tests.helpers import free_port

MODEL = "kvscope_hybrid-tiny"
SERVED = "tiny-served"
PROMPT = "The prefix cache keeps every form of state explicit. " * 3
OTHER = "Block tables map a sequence's logical blocks to the pool's pages. " * 2
CACHE_FLAGS = ("--unit-tokens", "--full-kv-blocks", "--swa-blocks", "--linear-checkpoints", "--compressed-blocks", "--tail-slots",
               "--tail-replay", "--host-tier-mib", "--disk-tier-mib", "--disk-tier-dir", "--cache-memory-mib")  # fmt: skip


class Records(logging.Handler):
    """Every record of the logger it is attached to, from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, name: str) -> list[str]:
        return [r.getMessage() for r in self.records if r.name == name]


@dataclass
class Workload:
    url: str
    app: Any
    llm: LLM
    runtime: Runtime
    engine: EngineLoop
    sink: ListSink
    usages: list[dict[str, Any]]
    log: Records


@pytest.fixture(scope="module")
def workload() -> Iterator[Workload]:
    """The server started as ``kvscope serve --cache-memory-mib 8`` would size its cache, and
    three completions: a prompt, the same prompt again (a prefix-cache hit), a streamed one."""
    args = build_parser().parse_args(["serve", "--model", MODEL, "--cache-memory-mib", "8", "--stats-interval-seconds", "0"])
    sink = ListSink()
    llm = LLM(MODEL, device="cpu", cache=cache_config(args), telemetry=sink)
    runtime = Runtime(llm, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8))
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    engine = EngineLoop(runtime)
    app = create_app(engine, SERVED, url=url, access_log=args.access_log, stats_interval_seconds=args.stats_interval_seconds)
    records = Records()
    LOG.addHandler(records)
    previous_level = LOG.level
    LOG.setLevel(logging.INFO)
    try:
        with serve_in_thread(app, port) as base, httpx.Client(base_url=base, timeout=60) as http:
            usages = []
            for prompt in (PROMPT, PROMPT):
                body = {"model": SERVED, "prompt": prompt, "max_tokens": 6, "temperature": 0}
                usages.append(http.post("/v1/completions", json=body).raise_for_status().json()["usage"])
            body = {"model": SERVED, "prompt": OTHER, "max_tokens": 5, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/completions", json=body) as response:
                chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
            usages.append(next(c["usage"] for c in chunks if c.get("usage")))
            yield Workload(base, app, llm, runtime, engine, sink, usages, records)
    finally:
        LOG.removeHandler(records)
        LOG.setLevel(previous_level)
        llm.close()


def scrape(url: str) -> tuple[str, dict[str, Any]]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    hits = [s.value for s in families[family].samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (sample, labels, hits)
    return float(hits[0])


def test_metrics_after_three_completions(workload: Workload) -> None:
    text, families = scrape(workload.url)
    assert "_created" not in text
    for family in families.values():
        for s in family.samples:
            assert s.labels.get("model_name") == SERVED, s
    n = len(workload.usages)
    generated = sum(u["completion_tokens"] for u in workload.usages)
    prompt = sum(u["prompt_tokens"] for u in workload.usages)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in workload.usages]
    assert generated >= n and cached[1] > 0  # the repeated prompt resumed from the cache
    assert value(families, "kvscope_time_to_first_token_seconds", "kvscope_time_to_first_token_seconds_count") == n
    assert value(families, "kvscope_server_time_to_first_token_seconds", "kvscope_server_time_to_first_token_seconds_count") == n
    assert value(families, "kvscope_e2e_request_latency_seconds", "kvscope_e2e_request_latency_seconds_count") == n
    assert value(families, "kvscope_inter_token_latency_seconds", "kvscope_inter_token_latency_seconds_count") == generated - n
    assert sum(s.value for s in families["kvscope_server_requests"].samples) == n
    assert value(families, "kvscope_server_generation_tokens", "kvscope_server_generation_tokens_total") == generated
    assert value(families, "kvscope_server_prompt_tokens", "kvscope_server_prompt_tokens_total") == prompt
    assert value(families, "kvscope_server_cached_prompt_tokens", "kvscope_server_cached_prompt_tokens_total") == sum(cached)
    assert value(families, "kvscope_server_requests_running", "kvscope_server_requests_running") == 0
    assert value(families, "kvscope_server_requests_waiting", "kvscope_server_requests_waiting") == 0
    ended = [e for e in workload.sink.events if isinstance(e, RequestEvent)]
    assert len(ended) == n
    queries = value(families, "kvscope_prefix_cache_queries", "kvscope_prefix_cache_queries_total")
    hits = value(families, "kvscope_prefix_cache_hits", "kvscope_prefix_cache_hits_total")
    recoverable = value(families, "kvscope_prefix_cache_recoverable_tokens", "kvscope_prefix_cache_recoverable_tokens_total")
    assert queries == prompt == sum(e.prompt_tokens for e in ended)
    assert hits == sum(e.hash_hit_tokens for e in ended) and hits >= cached[1]
    assert recoverable == sum(cached) == sum(e.recoverable_tokens for e in ended)
    forms = {str(f.form) for f in workload.llm.cache.forms}
    usable = {s.labels["form"]: s.value for s in families["kvscope_prefix_cache_usable_tokens"].samples if s.name.endswith("_total")}
    assert set(usable) == forms and all(recoverable <= v <= hits for v in usable.values())
    for family in ("kvscope_cache_usage_ratio", "kvscope_cache_occupancy_ratio"):
        ratios = {s.labels["form"]: s.value for s in families[family].samples}
        assert set(ratios) == forms and all(0.0 <= r <= 1.0 for r in ratios.values()), (family, ratios)
    assert value(families, "kvscope_cache_usage_ratio", "kvscope_cache_usage_ratio", form=Form.FULL_KV) == 0.0  # idle: nothing leased
    assert value(families, "kvscope_cache_occupancy_ratio", "kvscope_cache_occupancy_ratio", form=Form.FULL_KV) > 0.0  # the prompts stay cached


def test_access_log_has_one_line_per_request(workload: Workload) -> None:
    lines = workload.log.messages("engine.runtime.server_log.access")
    completions = [ln for ln in lines if '"POST /v1/completions HTTP/1.1" 200 OK' in ln]
    assert len(completions) == 3
    assert all(re.fullmatch(r'127\.0\.0\.1:\d+ - "POST /v1/completions HTTP/1\.1" 200 OK \d+\.\d ms', ln) for ln in completions)
    httpx.get(f"{workload.url}/v1/nowhere?x=1", timeout=10)
    last = workload.log.messages("engine.runtime.server_log.access")[-1]
    assert re.fullmatch(r'127\.0\.0\.1:\d+ - "GET /v1/nowhere\?x=1 HTTP/1\.1" 404 Not Found \d+\.\d ms', last), last


def test_banner_names_model_device_plan_and_url(workload: Workload) -> None:
    logged = workload.log.messages("engine.runtime.server_log")
    text = banner(workload.runtime, SERVED, f"{workload.url}/v1")
    assert logged[0] == text
    assert f"model {MODEL} served as '{SERVED}'" in text
    assert "device cpu, dtype float32" in text and "tensor-parallel size 1" in text
    assert workload.llm.cache.memory_plan().render().splitlines()[0] in text
    assert "of a 8.0 MiB budget" in text  # --cache-memory-mib 8
    assert text.endswith(f"listening on {workload.url}/v1 (OpenAI API; /metrics, /health beside /v1)")


def test_stats_line_logged_on_demand(workload: Workload) -> None:
    line = asyncio.run(workload.app.state.log_stats())
    assert line is not None and workload.log.messages("engine.runtime.server_log")[-1] == line
    forms = ", ".join(rf"{f.form} \d+\.\d%" for f in workload.llm.cache.forms)
    pattern = (
        r"Avg prompt throughput: \d+\.\d tokens/s, Avg generation throughput: \d+\.\d tokens/s, Running: 0 reqs, "
        rf"Waiting: 0 reqs, Cache usage: {forms}, Prefix cache hit rate: \d+\.\d% \(recoverable \d+\.\d%\)"
    )
    assert re.fullmatch(pattern, line), line
    assert asyncio.run(workload.app.state.log_stats()) is not None  # the first idle interval is logged
    assert asyncio.run(workload.app.state.log_stats()) is None  # then an idle server is quiet


def test_stats_line_values() -> None:
    forms = (FormUsage(form=Form.FULL_KV, leased_blocks=1, used_blocks=3, total_blocks=4), FormUsage(form=Form.LINEAR_STATE, leased_blocks=0, used_blocks=0, total_blocks=8))
    snapshot = EngineSnapshot(running=2, waiting=1, preemptions=0, forms=forms)
    totals = ServerTotals()
    stats = StatsLine(totals, start_seconds=100.0)
    totals.prompt_tokens, totals.generation_tokens = 500, 40
    totals.prefix_queries_tokens, totals.prefix_hits_tokens, totals.prefix_recoverable_tokens = 500, 200, 128
    assert stats.line(totals, snapshot, 110.0) == (
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 4.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, "
        "Cache usage: full_kv 25.0%, linear_state 0.0%, Prefix cache hit rate: 40.0% (recoverable 25.6%)"
    )
    idle = EngineSnapshot(running=0, waiting=0, preemptions=0, forms=forms)
    assert stats.line(totals, idle, 120.0) is not None and stats.line(totals, idle, 130.0) is None
    totals.generation_tokens += 20
    assert "Avg generation throughput: 2.0 tokens/s" in (stats.line(totals, idle, 140.0) or "")
    assert "Prefix cache hit rate: n/a" in (stats.line(totals, snapshot, 150.0) or "")
    with pytest.raises(ValueError, match="5 leased"):
        FormUsage(form=Form.FULL_KV, leased_blocks=5, used_blocks=5, total_blocks=4)


def test_inspect_runs_on_the_engine_thread_and_survives_errors(workload: Workload) -> None:
    engine = workload.engine
    assert asyncio.run(engine.inspect(lambda _: threading.current_thread().name)) == "kvscope-engine"
    with pytest.raises(ZeroDivisionError):
        asyncio.run(engine.inspect(lambda rt: rt.num_steps // 0))
    assert engine.alive and httpx.get(f"{workload.url}/health", timeout=10).status_code == 200
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(EngineLoop(workload.runtime).inspect(lambda rt: rt.num_steps))  # never started


def test_serve_takes_the_cache_flags_of_up() -> None:
    parser = build_parser()
    serve = parser.parse_args(["serve", "--unit-tokens", "32", "--cache-memory-mib", "8", "--tail-replay", "on", "--host-tier-mib", "2"])
    cfg = cache_config(serve)
    assert (cfg.unit_tokens, cfg.checkpoint_interval_tokens, cfg.max_prefill_chunk_tokens) == (32, 256, 1024)
    assert (cfg.memory_bytes, cfg.tail_replay, cfg.host_tier_bytes) == (8 * 2**20, "on", 2 * 2**20)
    replay = parser.parse_args(["replay", "trace.jsonl", "--unit-tokens", "32", "--cache-memory-mib", "8", "--tail-replay", "on", "--host-tier-mib", "2"])
    assert replay_config(replay)[1] == cfg  # one helper for up, replay and serve
    assert cache_config(parser.parse_args(["serve"])) == cache_config(parser.parse_args(["up"]))
    with pytest.raises(UserError, match="--tail-slots must be at least 2"):
        cache_config(parser.parse_args(["serve", "--tail-slots", "1"]))
    with pytest.raises(UserError, match="--disk-tier-mib > 0 needs --disk-tier-dir"):  # raised while the engine starts
        cmd_serve(parser.parse_args(["serve", "--model", MODEL, "--device", "cpu", "--disk-tier-mib", "1"]))
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {flag: action.help or "" for action in commands.choices["serve"]._actions for flag in action.option_strings}
    for flag in (*CACHE_FLAGS, "--no-access-log", "--disable-uvicorn-access-log", "--stats-interval-seconds", "--host", "--port"):
        assert "(default: " in helps[flag], flag
    assert serve.access_log is True and serve.stats_interval_seconds == 10.0
    quiet = parser.parse_args(["serve", "--disable-uvicorn-access-log", "--stats-interval-seconds", "0"])
    assert quiet.access_log is False and quiet.stats_interval_seconds == 0.0
