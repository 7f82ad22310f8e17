"""The Grafana dashboard (``dashboards/grafana/kvscope.json``, issue 23): the committed file loads
back through grafana-foundation-sdk's types and equals the generator's output, and every panel's
PromQL, run by a real Prometheus (Debian's ``prometheus``) scraping a real agent fed by a real
replay, returns the figures the agent's SQL gives over the same window — a panel without data
fails.

The feed, in two phases with the same series: the bundled trace's first requests replayed
through the engine (engine ``grafana-replay``, CPU), plus a batch from a second engine
(``tp-fixture``) with what a one-rank CPU replay never produces — swap-ins from host and disk,
Tail-Replay, tensor-parallel disagreements (which fire the test's alert rule) — stamped
:data:`SUPPLEMENT_AGE_SECONDS` back. Phase 2 repeats phase 1 (the replay again on a fresh
engine, its seqs continuing through a spool; the batch again), so every series exists before the
window: Prometheus's first sample of a series is its baseline, and ``increase`` would not count
a series born inside the window from 0.

Exactness: the window runs from a scrape after phase 1 was counted to a scrape after phase 2
was, and every query is evaluated at the second scrape with ``$__range`` / ``$__rate_interval``
set to the distance between the two. Prometheus 2.x selects the closed range [t − W, t], so both
ends are samples and ``increase``/``rate`` extrapolate nothing: counters compare exactly (up to
float rounding, rel 1e-9) with the SQL snapshots' difference, quantiles with Prometheus's own
bucket interpolation over the SQL bucket counts. The one figure the tables cannot give to the
millisecond is the ingest lag (the histogram measures from the commit, ``ingested_at`` is stamped
just before); the supplement's events sit 100 s back, in the (60 s, 300 s] bucket far from any
bound, and the test checks they hold the 95th percentile, so that figure is exact too.

Run it as ``make test`` does (``python -m pytest``): it imports the shared test helpers.
"""

from __future__ import annotations

import math
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from grafana_foundation_sdk.models import dashboard as sdk_dashboard
from grafana_foundation_sdk.models import prometheus as sdk_prometheus
from prometheus_client.parser import text_string_to_metric_families

from kvscope.grafana_dashboard import DASHBOARD_PATH, build_dashboard, load_dashboard, main, to_json
from tests.agent.agent_testdata import lookup_event, request_event
from tests.agent_process import ROOT, agent_command, agent_env
from tests.e2e.grafana_figures import (
    EXPECTED,
    VARIABLE_VALUES_SQL,
    Figures,
    Result,
    sql_rows,
    sql_snapshot,
    window_delta,
)
from tests.e2e.procs import start, stop, wait_for
from tests.helpers import free_port

PROMETHEUS = shutil.which("prometheus") or ""
MISSING = "install Debian's `prometheus` package (`apt-get install prometheus`; `make test` does it as root)"
TRACE = ROOT / "kvscope" / "data" / "weka_slice" / "traces" / "trace_0002.json"
REPLAY_ENGINE, SUPPLEMENT_ENGINE, MODEL = "grafana-replay", "tp-fixture", "kvscope_hybrid-small"
REPLAY_REQUESTS = 8
SUPPLEMENT_AGE_SECONDS = 100.0
PROMETHEUS_YML = """\
global: {{scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: kvscope-agent
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
"""
RULES_YAML = """\
groups:
  - name: grafana-test
    interval: 1s
    rules:
      - alert: TensorParallelRankDisagreement
        kind: tp_rank_disagreement
        window: 10m
        min_disagreements: 1
        for: 0s
        labels: {severity: ticket}
        annotations:
          summary: "rank {{ $labels.tp_rank }} held {{ $labels.form }} back"
"""
REPLAY_SCRIPT = """
import sys
from pathlib import Path
from rich.console import Console
from engine.trace.formats import load_trace
from kvscope.cli import build_parser
from kvscope.cli_args import replay_config
from kvscope.replaying import run_replay
trace, agent, engine_id, spool, n = sys.argv[1:6]
args = build_parser().parse_args(["replay", trace, "--agent", agent, "--max-requests", n, "--speed", "1000", "--max-output-tokens", "2"])
replay_cfg, cache_cfg = replay_config(args)
requests = load_trace(Path(trace))
for phase in (1, 2):
    if phase == 2 and sys.stdin.readline().strip() != "go":
        sys.exit("no go")
    run = run_replay(model=args.model, cache=cache_cfg, config=replay_cfg, requests=requests, agent_url=agent,
                     engine_id=engine_id, console=Console(stderr=True), spool_dir=Path(spool))
    print(f"phase {phase} lost {run.lost_events}", flush=True)
"""
"""Both phases in one process (one torch start-up); the spool carries the engine's next seq from
the first engine to the second, so the agent sees one engine's batches in order."""


def targets(model: sdk_dashboard.Dashboard) -> Iterator[tuple[str, sdk_prometheus.Dataquery]]:
    """(panel title, target) of every panel, rows included."""
    for panel in model.panels or []:
        inner = panel.panels if isinstance(panel, sdk_dashboard.RowPanel) else [panel]
        for p in inner:
            for target in p.targets or []:
                assert isinstance(target, sdk_prometheus.Dataquery), f"{p.title}: {type(target).__name__}"
                yield p.title or "", target


def test_the_committed_dashboard_loads_through_the_sdk_and_equals_the_generator() -> None:
    loaded = load_dashboard(DASHBOARD_PATH)
    assert to_json(loaded) == DASHBOARD_PATH.read_text() == to_json(build_dashboard()), "run `make grafana`"
    panels = [p for p in loaded.panels or [] if isinstance(p, sdk_dashboard.Panel)]
    assert panels and all(p.options is not None and not isinstance(p.options, dict) for p in panels)  # typed options
    found = list(targets(loaded))
    assert sorted((title, t.ref_id) for title, t in found) == sorted(EXPECTED), "every target needs its SQL twin"
    for title, target in found:
        assert target.datasource == {"type": "prometheus", "uid": "${datasource}"}, title
        assert not re.search(r"\bor\s+vector\s*\(", target.expr), f"{title}: {target.expr}"
    doc = (ROOT / "docs" / "grafana.md").read_text()
    stale = [title for title, target in found if f"`{target.expr}`" not in doc]
    assert not stale, f"docs/grafana.md's panel table lacks the PromQL of {stale}"
    names = [v.name for v in loaded.templating.list_val or []]
    assert names == ["datasource", "engine", "model", "form"]


def test_check_flags_a_stale_file(tmp_path: Path) -> None:
    out = tmp_path / "kvscope.json"
    assert main(["--check", "--out", str(out)]) == 1
    assert main(["--out", str(out)]) == 0 and main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text().replace('"kvscope"', '"edited"', 1))
    assert main(["--check", "--out", str(out)]) == 1


def supplement(seq: int) -> dict[str, Any]:
    """The second engine's batch ``seq`` (0 or 1; the same series each time)."""
    ts = time.time() - SUPPLEMENT_AGE_SECONDS
    who = {"engine_id": SUPPLEMENT_ENGINE, "model": MODEL}
    rid = [f"tp-{seq}-{i}" for i in range(3)]
    evicted = {"outcome": "recovered", "reason": "kv_evicted"}
    disagree = {"outcome": "invalidated", "reason": "tp_disagree", "tp_rank": 1}
    events = [
        request_event(ts, rid[0], prompt_tokens=1000, hash_hit_tokens=800, resume_tokens=600, recoverable_tokens=600,
                      replayed_tokens=200, recomputed_tokens=200, approximate=True, admission="tail_replay", ttft_seconds=0.3, **who),
        lookup_event(ts, rid[0], tier="host", hash_hit_tokens=800, usable_tokens=800, recoverable_tokens=600, recovery_seconds=0.03, **evicted, **who),
        lookup_event(ts, rid[0], form="linear_state", outcome="replayed", reason="linear_checkpoint_missing", hash_hit_tokens=800,
                     usable_tokens=600, recoverable_tokens=600, replayed_tokens=200, approximate=True, recovery_seconds=0.07, **who),
        request_event(ts + 1, rid[1], prompt_tokens=2000, hash_hit_tokens=1024, resume_tokens=256, recoverable_tokens=256,
                      recomputed_tokens=1744, admission="lower_resume", ttft_seconds=0.6, **who),
        lookup_event(ts + 1, rid[1], hash_hit_tokens=1024, usable_tokens=512, recoverable_tokens=256, **disagree, **who),
        lookup_event(ts + 1, rid[1], form="linear_state", hash_hit_tokens=1024, usable_tokens=256, recoverable_tokens=256, **disagree, **who),
        request_event(ts + 2, rid[2], prompt_tokens=1500, hash_hit_tokens=1200, resume_tokens=1024, recoverable_tokens=1024,
                      recomputed_tokens=476, admission="swap_in", ttft_seconds=0.2, **who),
        lookup_event(ts + 2, rid[2], tier="disk", hash_hit_tokens=1200, usable_tokens=1200, recoverable_tokens=1024, recovery_seconds=0.2, **evicted, **who),
        lookup_event(ts + 2, rid[2], form="swa_window", outcome="invalidated", reason="swa_evicted", hash_hit_tokens=1200,
                     usable_tokens=1024, recoverable_tokens=1024, **who),
    ]  # fmt: skip
    return {"schema_version": 1, "engine_id": SUPPLEMENT_ENGINE, "seq": seq, "sent_at": time.time(), "events": events}


def post_batch(agent_url: str, body: dict[str, Any]) -> None:
    response = httpx.post(f"{agent_url}/v1/events", content=msgspec.json.encode(body), headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 200 and response.json()["status"] == "stored", response.text


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The next line ``proc`` prints, within ``timeout`` seconds."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the replay exited with {proc.returncode}"
        left = deadline - time.monotonic()
        assert left > 0, f"the replay printed nothing within {timeout} s"
        if select.select([proc.stdout], [], [], min(left, 1.0))[0]:
            return proc.stdout.readline().decode().strip()


def agent_counted_everything(agent_url: str) -> bool:
    """Whether the agent's /metrics count every event its tables hold (the event counter first
    and the lag histogram last of each batch's metric updates)."""
    (stored,) = sql_rows(
        agent_url,
        "SELECT (SELECT count(*) FROM cache_lookups) + (SELECT count(*) FROM requests) "
        "+ (SELECT count(*) FROM engine_stats) + (SELECT count(*) FROM block_events)",
    )[0]
    totals = {"kvscope_ingest_events_total": 0.0, "kvscope_ingest_lag_seconds_count": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{agent_url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return set(totals.values()) == {float(stored)}


def prom_get(prom_url: str, path: str, **params: Any) -> Any:
    response = httpx.get(f"{prom_url}{path}", params=params, timeout=10)
    assert response.status_code == 200, f"{path} {params}: {response.text}"
    return response.json()["data"]


def scrape_after(prom_url: str, since_ms: int) -> int | None:
    """The timestamp (ms) of the first successful scrape of the agent that started after
    ``since_ms`` and is queryable, else None."""
    data = prom_get(prom_url, "/api/v1/query", query='up{job="kvscope-agent"}[1m]')
    stamps = [round(float(t) * 1000) for series in data["result"] for t, v in series["values"] if v == "1"]
    later = [t for t in stamps if t > since_ms]
    return min(later) if later else None


def settle(agent_url: str, prom_url: str, prometheus: subprocess.Popen[bytes]) -> int:
    """Wait until the agent counted everything it stored, then for a scrape after that: its ms."""
    wait_for("the agent's counters", prometheus, 30, lambda: agent_counted_everything(agent_url))
    since = round(time.time() * 1000) + 10  # past Prometheus's 2 ms timestamp alignment
    stamp: int = wait_for("a scrape after the phase", prometheus, 30, lambda: scrape_after(prom_url, since))
    return stamp


def substitute(expr: str, window_ms: int) -> str:
    """``expr`` as Grafana sends it with every template variable "All" and the window."""
    values = {"engine": ".*", "model": ".*", "form": ".*", "__range": f"{window_ms}ms", "__rate_interval": f"{window_ms}ms"}
    return re.sub(r"\$(\w+)", lambda m: values[m.group(1)], expr)


def prom_instant(prom_url: str, expr: str, at_ms: int) -> Result:
    data = prom_get(prom_url, "/api/v1/query", query=expr, time=f"{at_ms / 1000:.3f}")
    assert data["resultType"] == "vector", data
    return {tuple(sorted(s["metric"].items())): float(s["value"][1]) for s in data["result"]}


def compare(what: str, got: Result, want: Result) -> list[str]:
    if not got:
        return [f"{what}: no data"]
    problems = [f"{what}: {k} = {v} (not a finite figure)" for k, v in got.items() if not math.isfinite(v)]
    if got.keys() != want.keys():
        return [*problems, f"{what}: series {sorted(got)} != SQL's {sorted(want)}"]
    return problems + [
        f"{what}: {k} = {got[k]!r}, SQL {want[k]!r}" for k in got if got[k] != pytest.approx(want[k], rel=1e-9, abs=1e-12)
    ]


@pytest.mark.e2e
@pytest.mark.skipif(not PROMETHEUS, reason=f"prometheus not found: {MISSING}")
def test_every_panel_returns_the_agents_sql_figures(tmp_path: Path) -> None:
    agent_port, prom_port = free_port(), free_port()
    agent_url, prom_url = f"http://127.0.0.1:{agent_port}", f"http://127.0.0.1:{prom_port}"
    rules, config = tmp_path / "rules.yaml", tmp_path / "prometheus.yml"
    rules.write_text(RULES_YAML)
    config.write_text(PROMETHEUS_YML.format(port=agent_port))
    agent = prometheus = replay = None
    passed = False
    try:
        agent = start(agent_command(agent_port, tmp_path / "data", rules=rules), tmp_path / "agent.log", cwd=ROOT, env=agent_env())
        prometheus = start(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
            tmp_path / "prometheus.log",
        )
        with (tmp_path / "replay.log").open("wb") as log:
            replay = subprocess.Popen(
                [sys.executable, "-c", REPLAY_SCRIPT, str(TRACE), agent_url, REPLAY_ENGINE, str(tmp_path / "spool"), str(REPLAY_REQUESTS)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=ROOT, env=agent_env(), start_new_session=True,
            )  # fmt: skip
        wait_for("agent /readyz", agent, 60, lambda: httpx.get(f"{agent_url}/readyz", timeout=1).status_code == 200)

        post_batch(agent_url, supplement(0))
        assert read_line(replay, 180) == "phase 1 lost 0"
        wait_for("the alert firing", agent, 30, lambda: sql_rows(agent_url, "SELECT count(*) FROM alert_state WHERE status = 'firing'")[0][0] > 0)
        first = settle(agent_url, prom_url, prometheus)
        before = sql_snapshot(agent_url)

        assert replay.stdin is not None
        replay.stdin.write(b"go\n")
        replay.stdin.flush()
        post_batch(agent_url, supplement(1))
        assert read_line(replay, 180) == "phase 2 lost 0"
        last = settle(agent_url, prom_url, prometheus)
        figures = Figures(window_delta(before, sql_snapshot(agent_url)), (last - first) / 1000)
        lag = figures.delta.histograms["kvscope_ingest_lag_seconds"][()]
        assert sum(lag[:-2]) < 0.95 * sum(lag) <= sum(lag[:-1]), f"the 95th percentile of the lag is not the supplement's bucket: {lag}"

        problems: list[str] = []
        loaded = load_dashboard(DASHBOARD_PATH)
        for title, target in targets(loaded):
            expr = substitute(target.expr, last - first)
            got = prom_instant(prom_url, expr, last)
            problems += compare(f"{title} [{target.ref_id}] {expr}", got, EXPECTED[(title, target.ref_id)](figures))
        for variable in loaded.templating.list_val or []:
            if variable.name not in VARIABLE_VALUES_SQL:
                continue
            found = re.fullmatch(r"label_values\((.+), (\w+)\)", str(variable.query))
            assert found is not None, variable.query
            listed = prom_get(prom_url, f"/api/v1/label/{found.group(2)}/values", **{"match[]": substitute(found.group(1), 0)})
            want = sorted(row[0] for row in sql_rows(agent_url, VARIABLE_VALUES_SQL[variable.name]))
            if sorted(listed) != want:
                problems.append(f"variable {variable.name}: {sorted(listed)} != SQL's {want}")
        assert not problems, "\n".join(problems)
        passed = True
    finally:
        for proc in (replay, prometheus, agent):
            stop(proc)
        if not passed:  # pytest shows this with the failure
            for log_file in sorted(tmp_path.glob("*.log")):
                print(f"--- {log_file.name} (tail) ---\n{log_file.read_text(errors='replace')[-4000:]}")
