"""The ``kvscope`` argument parser (docs/design.md §10): every subcommand and its flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvscope.cli_args import (
    ENGINE_ID_HELP,
    add_cache_flags,
    add_replay_flags,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    squeeze,
)

DTYPES = ("float32", "bfloat16", "float16")
"""What ``--dtype`` takes (``engine.loader.DTYPE_NAMES``)."""
DESCRIPTION = "kvscope: a hybrid-attention engine with a per-form prefix cache, its telemetry agent, alerts and dashboard."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvscope", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    # -v also after the subcommand (kvscope agent -v); SUPPRESS keeps a -v given before it
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", parents=[verbose], help="agent + alerts + dashboard + the engine replaying a real trace")
    up.add_argument("--trace", type=Path, default=None, help="weka directory/.json or mooncake .jsonl (default: the bundled weka slice)")
    up.add_argument("--data-dir", type=Path, default=Path("kvscope-data"), help="DuckDB, logs (default: %(default)s)")
    up.add_argument("--agent-port", type=port, default=9400, help="the agent's TCP port on 127.0.0.1: API and /metrics (default: %(default)s)")
    up.add_argument("--dashboard-port", type=port, default=8501, help="the dashboard's TCP port on 127.0.0.1 (default: %(default)s)")
    up.add_argument("--no-dashboard", action="store_true", help="do not start the Streamlit dashboard")
    up.add_argument("--exit-when-done", action="store_true", help="stop agent and dashboard after the replay")
    up.add_argument("--alert-interval-seconds", type=positive_float, default=None, help="evaluate rule groups without their own interval every N s instead of every minute")
    up.add_argument("--alert-rules", type=Path, default=None, help="the agent's alert rule file (default: the shipped alerts/default_rules.yaml)")
    up.add_argument("--squeeze-window-pool", type=squeeze, default=None, metavar="START:DURATION", help="drill: from START s into the replay, for DURATION s, the swa_window pool keeps no cached pages, so the recoverable hit rate drops and the alerts fire, then resolve")
    up.add_argument(
        "--drill", action="store_true",
        help="the alert drill sized to this machine: measure the replay's rate, derive second-scale drop rules and a window-pool "
        "squeeze from it, report the seconds to page and to resolve, and end the replay once resolved (exit 1 if it never paged)",
    )  # fmt: skip
    up.add_argument("--alert-notify", type=Path, default=None, help="the agent's notification file: routes, receivers, Alertmanagers (default: the shipped alerts/default_notify.yaml)")
    add_replay_flags(up)

    agent = sub.add_parser("agent", parents=[verbose], help="the sidecar: ingest, DuckDB store, metrics, SQL, alerts")
    agent.add_argument("--config", type=Path, default=None, help="YAML file (flags override it)")
    agent.add_argument("--host", default=None, help="the address to listen on (overrides host; default: 127.0.0.1)")
    agent.add_argument("--port", type=port, default=None, help="the TCP port to listen on (overrides port; default: 9400)")
    agent.add_argument("--data-dir", type=Path, default=None, help="the DuckDB file, the alert log and the notifications (overrides data_dir; default: kvscope-data)")
    agent.add_argument("--token", default=None, help="bearer token (or KVSCOPE_TOKEN)")
    agent.add_argument("--alert-interval-seconds", type=positive_float, default=None, help=argparse.SUPPRESS)
    agent.add_argument("--alert-rules", type=Path, default=None, help="the alert rule file (overrides alert_rules_file; default: the shipped one)")
    agent.add_argument("--alert-notify", type=Path, default=None, help="the notification file (overrides alert_notify_file; default: the shipped one)")
    agent.add_argument("--dashboard-url", default=None, help="the dashboard's URL, for {{ $dashboardURL }} in alert annotations (the shipped runbook links; overrides dashboard_url)")
    agent.add_argument(
        "--vllm-kv-events", default=None, metavar="ADDRESS",
        help="also store a vLLM engine's KV events: its ZMQ publisher's address (tcp://127.0.0.1:5557; overrides vllm_kv_events)",
    )  # fmt: skip
    agent.add_argument("--vllm-kv-events-replay", default=None, metavar="ADDRESS", help="that vLLM's replay address, to fetch missed batches (overrides vllm_kv_events_replay)")
    agent.add_argument("--vllm-engine-id", default=None, help="the engine id vLLM's events are stored under (overrides vllm_engine_id; default: vllm)")
    agent.add_argument("--vllm-model", default=None, help="the model name vLLM's events are stored under (overrides vllm_model; default: vllm)")
    agent.add_argument("--exit-with-parent", action="store_true", help="shut down when the process that started the agent exits (kvscope up uses it)")

    dash = sub.add_parser("dashboard", parents=[verbose], help="the Streamlit dashboard")
    dash.add_argument("--agent", default=None, help="agent URL (default: KVSCOPE_AGENT_URL or http://127.0.0.1:9400)")
    dash.add_argument("--port", type=port, default=8501, help="the TCP port Streamlit listens on (default: %(default)s)")
    dash.add_argument("--host", default="127.0.0.1", help="the address Streamlit listens on (default: %(default)s)")

    rep = sub.add_parser("replay", parents=[verbose], help="replay a trace (weka, Mooncake; SWE-agent .traj chats with --server) through the engine")
    rep.add_argument("trace", type=Path, help="weka directory/.json, mooncake .jsonl, or SWE-agent .traj (with --server)")
    rep.add_argument("--agent", default=None, help="send events to this agent")
    rep.add_argument("--server", default=None, help="replay over HTTP against this kvscope serve URL, sessions concurrently (the server's engine and cache flags apply, not these)")
    rep.add_argument("--max-sessions", type=positive_int, default=None, help="with --server: requests out at once, first arrival first; None: --max-num-seqs (default: %(default)s)")
    add_replay_flags(rep)

    gen = sub.add_parser("generate", parents=[verbose], help="generate text")
    gen.add_argument("--model", default="kvscope_hybrid-small", help="preset name or model directory (default: %(default)s, trained)")
    gen.add_argument("--dtype", choices=DTYPES, default=None, help="weights and KV pools: float32, bfloat16 or float16 (default: the checkpoint's config dtype, else float32)")
    gen.add_argument("--device", default="auto", help="auto, cpu or cuda[:i] (default: %(default)s)")
    gen.add_argument("--cache-memory-mib", type=positive_int, default=None, help="one byte budget (MiB) for every pool of the prefix cache, sized by a memory plan (default: the pools' default block counts)")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")

    srv = sub.add_parser("serve", parents=[verbose], help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions)")
    srv.add_argument("--model", default="kvscope_hybrid-small", help="preset name or model directory (default: %(default)s, trained)")
    srv.add_argument("--engine-id", default=None, help=ENGINE_ID_HELP)
    srv.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    srv.add_argument("--port", type=port, default=8000, help="the TCP port to listen on (default: %(default)s)")
    srv.add_argument("--device", default="auto", help="auto, cpu or cuda[:i] (default: %(default)s)")
    srv.add_argument("--dtype", choices=DTYPES, default=None, help="weights and KV pools: float32, bfloat16 or float16 (default: the checkpoint's config dtype, else float32)")
    add_cache_flags(srv)
    srv.add_argument("--agent", default=None, help="send the cache's events to this agent URL (default: %(default)s: events discarded)")
    srv.add_argument(
        "--telemetry-spool-dir",
        type=Path,
        default=None,
        help="with --agent: keep every event batch in a spool file here until the agent has checkpointed it "
        "(survives an agent outage or a damaged agent WAL; spools earlier runs left here are sent first) (default: no spool)",
    )
    srv.add_argument("--max-num-seqs", type=positive_int, default=32, help="requests running at once (default: %(default)s)")
    srv.add_argument("--max-num-batched-tokens", type=positive_int, default=256, help="tokens computed per engine step (default: %(default)s)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    srv.add_argument("--enforce-eager", action="store_true", help="decode without CUDA graphs (default: captured on CUDA when the model allows)")
    srv.add_argument("--tensor-parallel-size", type=positive_int, default=1, help="ranks the model is sharded over, one process each (CPU: gloo) (default: %(default)s)")
    srv.add_argument("--check-invariants", action="store_true", help="check the prefix cache's invariants after every step on every rank (slow; for tests) (default: off)")
    srv.add_argument(
        "--no-access-log", "--disable-uvicorn-access-log", dest="access_log", action="store_false",
        help="no access log line per HTTP request (uvicorn's --no-access-log; vLLM's --disable-uvicorn-access-log) (default: logged)",
    )  # fmt: skip
    srv.add_argument("--stats-interval-seconds", type=non_negative_float, default=10.0, help="log the engine's stats line (throughput, requests, cache usage per form, prefix-cache hit rate) every N s; 0: never (default: %(default)s)")

    bench = sub.add_parser("bench", parents=[verbose], help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from kvscope.bench_ttft import add_arguments as ttft_arguments

    ttft_arguments(bench_sub.add_parser("ttft", parents=[verbose], help="time to first token: cold, exact resume, Tail-Replay"))

    sql = sub.add_parser("sql", parents=[verbose], help="ad-hoc read-only SQL over the cache logs")
    sql.add_argument("query", help="one SELECT statement (WITH, FROM t, DESCRIBE, SHOW ... too), run read-only")
    where = sql.add_mutually_exclusive_group()
    where.add_argument("--agent", default=None, help="through a running agent (default when --db is absent)")
    where.add_argument("--db", type=Path, default=None, help="a DuckDB file, opened read-only (no agent running)")
    sql.add_argument("--format", choices=("table", "csv", "json"), default="table", help="how the rows are printed (default: %(default)s)")

    alerts = sub.add_parser("alerts", parents=[verbose], help="alert rule tooling")
    alerts_sub = alerts.add_subparsers(dest="alerts_command", required=True)
    check = alerts_sub.add_parser("check", parents=[verbose], help="validate rule files and notification files (like promtool check rules, amtool check-config)")
    check.add_argument("files", type=Path, nargs="+", metavar="FILE", help="rule files and notification files (told apart by their keys)")
    export = alerts_sub.add_parser(
        "export-prometheus", parents=[verbose], help="write equivalent Prometheus alerting rules over the agent's metrics"
    )
    export.add_argument("file", type=Path, metavar="FILE", help="the rule file")
    export.add_argument("--dashboard-url", default=None, help="the kvscope dashboard's URL, for {{ $dashboardURL }} in the annotations (default: relative links)")
    export.add_argument("-o", "--output", type=Path, default=None, help="write here instead of stdout")
    golden = alerts_sub.add_parser(
        "test", parents=[verbose], help="run rules over a golden time series and print the notifications (like promtool test rules)"
    )
    golden.add_argument("file", type=Path, metavar="FILE", help="the rule file")
    golden.add_argument("--series", type=Path, required=True, metavar="FILE", help="the golden series (YAML; see alerts/golden.py)")
    golden.add_argument("--json", action="store_true", help="one JSON object per notification instead of a table")
    agent_flag = argparse.ArgumentParser(add_help=False)  # --agent before or after add/list/expire
    agent_flag.add_argument("--agent", default=argparse.SUPPRESS, help="agent URL (default: KVSCOPE_AGENT_URL or http://127.0.0.1:9400)")
    silence = alerts_sub.add_parser("silence", parents=[verbose], help="create, list and expire silences on a running agent")
    silence.add_argument("--agent", default=None, help="agent URL (default: KVSCOPE_AGENT_URL or http://127.0.0.1:9400)")
    silence_sub = silence.add_subparsers(dest="silence_command", required=True)
    add = silence_sub.add_parser("add", parents=[verbose, agent_flag], help="mute alerts matching every matcher, e.g. engine=\"e1\" alertname=~\"Recoverable.*\"")
    add.add_argument("matchers", nargs="+", metavar="MATCHER", help='label="value", label!="value", label=~"regex" or label!~"regex"')
    add.add_argument("--duration", default="1h", help="how long (Prometheus duration; default: %(default)s)")
    add.add_argument("--comment", required=True, help="why")
    add.add_argument("--author", default=None, help="who (default: $USER)")
    silence_sub.add_parser("list", parents=[verbose, agent_flag], help="the silences, with their state")
    expire = silence_sub.add_parser("expire", parents=[verbose, agent_flag], help="end silences now (give the full ids)")
    expire.add_argument("ids", nargs="+", metavar="ID", help="silence ids, as alerts silence list prints them")
    return parser
