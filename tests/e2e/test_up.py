"""Whole system: ``kvscope up`` in a subprocess — agent, dashboard and the engine replaying the
bundled real trace — checked through the agent's /metrics and /v1/sql and ``kvscope sql``."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from alerts.rulefile import DEFAULT_RULES_PATH
from tests.agent_process import agent_env
from tests.helpers import free_port

pytestmark = pytest.mark.e2e

KVSCOPE = [sys.executable, "-m", "kvscope"]
FORMS = {"full_kv", "swa_window", "compressed_kv", "uncompressed_tail", "indexer_state", "linear_state"}


def read_json_line(proc: subprocess.Popen[str], timeout: float) -> dict:
    """The first stdout line (the --json summary), waiting at most ``timeout`` seconds."""
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"no summary line within {timeout} s") from None
    assert line, f"kvscope up exited with {proc.wait(10)} before printing a summary"
    return json.loads(line)


def kvscope_sql(db: Path, query: str) -> dict:
    out = subprocess.run([*KVSCOPE, "sql", "--db", str(db), "--format", "json", query], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_up_serves_metrics_sql_and_dashboard(tmp_path: Path) -> None:
    agent_port, dash_port = free_port(), free_port()
    data = tmp_path / "data"
    cmd = [
        *KVSCOPE, "up", "--data-dir", str(data), "--agent-port", str(agent_port),
        "--dashboard-port", str(dash_port), "--max-requests", "6", "--speed", "1000",
        "--max-output-tokens", "2", "--json",
    ]  # fmt: skip
    stderr = (tmp_path / "up.stderr").open("w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        summary = read_json_line(proc, timeout=240)
        assert summary["requests"] == 6
        assert set(summary["forms"]) == FORMS

        agent = f"http://127.0.0.1:{agent_port}"
        metrics = httpx.get(agent + "/metrics", timeout=10).text
        requests_total = [ln for ln in metrics.splitlines() if ln.startswith("kvscope_requests_total{")]
        assert len(requests_total) == 1 and requests_total[0].endswith(" 6.0")
        lookups = [ln for ln in metrics.splitlines() if ln.startswith("kvscope_cache_lookups_total{")]
        assert sum(float(ln.rsplit(" ", 1)[1]) for ln in lookups) == 6.0 * len(FORMS)
        assert {f'form="{f}"' in metrics for f in FORMS} == {True}

        body = httpx.post(agent + "/v1/sql", json={"sql": "SELECT count(*) AS n, sum(recoverable_tokens) AS r FROM requests"}, timeout=10).json()
        assert body["rows"] == [[6, summary["recoverable_tokens"]]]
        refused = httpx.post(agent + "/v1/sql", json={"sql": "DELETE FROM requests"}, timeout=10)
        assert refused.status_code in (400, 403) and "DELETE" in refused.text

        locked = subprocess.run([*KVSCOPE, "sql", "--db", str(data / "kvscope.duckdb"), "SELECT 1"], capture_output=True, text=True, timeout=60)
        assert locked.returncode == 2 and "open in a running agent" in locked.stderr and "--agent" in locked.stderr

        second = subprocess.run(
            [*KVSCOPE, "up", "--data-dir", str(data), "--agent-port", str(free_port()), "--no-dashboard", "--max-requests", "1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2 and "is open in another process" in second.stderr and "--data-dir" in second.stderr

        deadline = time.monotonic() + 90
        while True:  # Streamlit takes a few seconds to come up
            try:
                health = httpx.get(f"http://127.0.0.1:{dash_port}/_stcore/health", timeout=5)
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "dashboard never answered /_stcore/health"
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    stderr.close()
    assert code == 0, (tmp_path / "up.stderr").read_text()
    with pytest.raises(httpx.HTTPError):  # the agent was stopped with it
        httpx.get(f"http://127.0.0.1:{agent_port}/healthz", timeout=2)
    stored = kvscope_sql(data / "kvscope.duckdb", "SELECT count(*) FROM requests")
    assert stored["rows"] == [[6]]  # nothing lost on shutdown


def test_up_exit_when_done_then_sql_on_the_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    cmd = [
        *KVSCOPE, "up", "--data-dir", str(data), "--agent-port", str(free_port()), "--no-dashboard",
        "--max-requests", "12", "--speed", "1000", "--max-output-tokens", "2", "--exit-when-done", "--json",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    db = data / "kvscope.duckdb"
    rows = kvscope_sql(db, "SELECT form, outcome, count(*) FROM cache_lookups GROUP BY ALL ORDER BY ALL")["rows"]
    per_form: dict[str, int] = {}
    for form, outcome, n in rows:
        per_form[form] = per_form.get(form, 0) + n
        assert summary["forms"][form][outcome] == n
    assert per_form == dict.fromkeys(FORMS, 12)
    total = kvscope_sql(db, "SELECT sum(recoverable_tokens), sum(prompt_tokens) FROM requests")["rows"][0]
    assert total == [summary["recoverable_tokens"], summary["prompt_tokens"]]
    # the summary ranks tokens lost by limiting form and reason; per form (ties under each) they
    # add up to the stored requests' hash-hit tokens that were not recoverable
    lost = summary["losses"]
    assert lost and [r["tokens_lost"] for r in lost] == sorted((r["tokens_lost"] for r in lost), reverse=True)
    per_form_lost: dict[str | None, int] = {}
    for r in lost:
        per_form_lost[r["form"]] = per_form_lost.get(r["form"], 0) + r["tokens_lost"]
    by_sql = kvscope_sql(
        db,
        "SELECT f, sum(hash_hit_tokens - recoverable_tokens)::BIGINT FROM (SELECT unnest(CASE WHEN len(limiting_forms) > 0 "
        "THEN limiting_forms ELSE [limiting_form] END) AS f, * FROM requests WHERE hash_hit_tokens > recoverable_tokens) GROUP BY f",
    )["rows"]
    assert per_form_lost == {f: n for f, n in by_sql}
    # the agent ran the shipped rule file
    assert f"alert rules {DEFAULT_RULES_PATH}" in (data / "agent.log").read_text()


def test_a_killed_up_does_not_leave_its_agent_holding_the_store(tmp_path: Path) -> None:
    """SIGKILL to ``up`` alone (its handlers never run): the agent it started notices it was
    re-parented, shuts down as on SIGTERM (what was ingested is kept) and frees port and lock."""
    from kvscope.up import database_holder

    agent_port, data = free_port(), tmp_path / "data"
    cmd = [
        *KVSCOPE, "up", "--data-dir", str(data), "--agent-port", str(agent_port), "--no-dashboard",
        "--max-requests", "400", "--max-output-tokens", "2",
    ]  # fmt: skip
    log = (tmp_path / "up.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**agent_env(), "OMP_NUM_THREADS": "1"})
    agent = f"http://127.0.0.1:{agent_port}"
    try:
        deadline = time.monotonic() + 180
        while True:  # bounded: until the replay has stored a request
            assert proc.poll() is None, (tmp_path / "up.log").read_text()
            try:
                stored = httpx.post(agent + "/v1/sql", json={"sql": "SELECT count(*) FROM requests"}, timeout=5).json()["rows"][0][0]
            except httpx.HTTPError:
                stored = 0
            if stored:
                break
            assert time.monotonic() < deadline, "no request stored within 180 s"
            time.sleep(0.5)
        proc.kill()  # up only: the agent is in its own process group
        proc.wait(10)
        deadline = time.monotonic() + 60
        while database_holder(data / "kvscope.duckdb") is not None:
            assert time.monotonic() < deadline, "the agent still holds the store 60 s after up was killed"
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    with pytest.raises(httpx.HTTPError):
        httpx.get(agent + "/healthz", timeout=2)
    assert "parent process" in (data / "agent.log").read_text()
    assert kvscope_sql(data / "kvscope.duckdb", "SELECT count(*) > 0 FROM requests")["rows"] == [[True]]


def test_up_rejects_a_malformed_trace_before_starting(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    out = subprocess.run(
        [*KVSCOPE, "up", "--trace", str(bad), "--data-dir", str(tmp_path / "d"), "--agent-port", str(free_port()), "--exit-when-done"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert f"{bad}:2: malformed JSON" in out.stderr
    assert not (tmp_path / "d").exists()  # nothing was started


def test_sql_on_a_locked_or_missing_file_says_what_to_do(tmp_path: Path) -> None:
    out = subprocess.run([*KVSCOPE, "sql", "--db", str(tmp_path / "none.duckdb"), "SELECT 1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no such DuckDB file" in out.stderr


def test_replay_sends_its_events_to_an_agent(tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "agent.log").open("w")
    agent = subprocess.Popen(
        [*KVSCOPE, "agent", "--data-dir", str(tmp_path / "data"), "--port", str(port)], stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and agent.poll() is None, "the agent did not start"
            time.sleep(0.2)
        from kvscope.data import bundled_trace

        runs = []
        for max_requests in (4, 3):  # the same engine id twice: the second run reads back its own events
            out = subprocess.run(
                [*KVSCOPE, "replay", str(bundled_trace()), "--agent", url, "--max-requests", str(max_requests), "--speed", "1000",
                 "--max-output-tokens", "2", "--json", "--engine-id", "replay-test"],
                capture_output=True, text=True, timeout=240,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            assert "replay " in out.stderr and "requests (100 %)" in out.stderr  # a progress line, stderr not a terminal
            runs.append(json.loads(out.stdout))
        first, second = runs
        assert first["engine_id"] == second["engine_id"] == "replay-test" and first["run_id"] != second["run_id"]
        assert (first["requests"], second["requests"]) == (4, 3)
        for summary in runs:
            body = httpx.post(
                url + "/v1/sql",
                json={"sql": f"SELECT count(*), sum(recoverable_tokens) FROM requests WHERE run_id = '{summary['run_id']}'"},
                timeout=10,
            ).json()
            assert body["rows"] == [[summary["requests"], summary["recoverable_tokens"]]]
    finally:
        agent.terminate()
        agent.wait(30)
        log.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--agent-port", "70000"], "is not a TCP port"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--data-dir", "FILE"], "is a file, not a directory"),
        (["--squeeze-window-pool", "soon"], "is not START:DURATION in seconds"),
        (["--squeeze-window-pool", "0:inf"], "START and DURATION must be finite seconds"),
        (["--squeeze-window-pool", "5:0"], "DURATION > 0"),
        (["--drill", "--squeeze-window-pool", "5:10"], "--drill sizes its own squeeze and rules"),
        (["--alert-rules", "FILE"], "FILE: expected a mapping"),
        (["--alert-notify", "FILE"], "missing field 'route'"),
    ],
)
def test_up_rejects_bad_options_before_starting_anything(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "FILE").write_text("")
    args = [str(tmp_path / a) if a == "FILE" else a for a in args]
    out = subprocess.run(
        [*KVSCOPE, "up", "--no-dashboard", "--exit-when-done", *(["--data-dir", str(tmp_path / "d")] if "--data-dir" not in args else []), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "d").exists()
