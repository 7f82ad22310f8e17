"""The Overview page against a real agent (uvicorn in a thread on 127.0.0.1), and without one."""

from __future__ import annotations

import calendar
import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qsl

import httpx
import msgspec
import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from dashboard.client import AgentClient, AgentError, query_frame, resolve_agent_url
from dashboard.launch import APP_PATH, streamlit_command
from tests.dashboard.agent_fixture import running_agent

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")


def request(
    ts: float, request_id: str, prompt: int, recoverable: int, hash_hit: int
) -> dict[str, object]:
    return {
        "kind": "request",
        "ts": ts,
        "engine_id": "e1",
        "request_id": request_id,
        "model": "m1",
        "prompt_tokens": prompt,
        "output_tokens": 1,
        "hash_hit_tokens": hash_hit,
        "resume_tokens": recoverable,
        "recoverable_tokens": recoverable,
        "replayed_tokens": 0,
        "recomputed_tokens": prompt - recoverable,
        "admission": "exact",
        "ttft_seconds": 0.1,
        "e2e_seconds": 0.2,
    }


def lookup(ts: float, request_id: str, form: str, hash_hit: int, usable: int) -> dict[str, object]:
    outcome, reason = ("hit", "none") if usable == hash_hit else ("invalidated", "swa_evicted")
    return {
        "kind": "cache_lookup",
        "ts": ts,
        "engine_id": "e1",
        "request_id": request_id,
        "model": "m1",
        "form": form,
        "tier": "device",
        "outcome": outcome,
        "reason": reason,
        "hash_hit_tokens": hash_hit,
        "usable_tokens": usable,
        "recoverable_tokens": usable,
    }


@pytest.fixture
def agent_url(tmp_path: Path) -> Iterator[str]:
    """A real agent on a free 127.0.0.1 port with a known batch: in the latest minute bucket
    3000 of 4000 prompt tokens are recoverable (75.0%) and 3800 hash hits (95.0%); the bucket
    before it has 1000 of 2000 (50.0%)."""
    with running_agent(tmp_path) as agent:
        base = (int(time.time()) // 60 - 2) * 60
        events = [
            request(base - 30, "r0", 2000, 1000, 1000),
            lookup(base + 1, "r1", "full_kv", 800, 800),
            request(base + 2, "r1", 1000, 600, 800),
            lookup(base + 3, "r2", "full_kv", 3000, 3000),
            lookup(base + 3, "r2", "swa_window", 3000, 2400),
            request(base + 4, "r2", 3000, 2400, 3000),
        ]
        body = msgspec.json.encode(
            {"schema_version": 1, "engine_id": "e1", "seq": 1, "sent_at": base, "events": events}
        )
        response = httpx.post(
            f"{agent.url}/v1/events", content=body, headers={"content-type": "application/json"}
        )
        assert response.json() == {"status": "stored", "events": 6}
        yield agent.url


def chart_points(at: AppTest, index: int, series: str, value: str) -> dict[str, list[float]]:
    """The values one Vega-Lite chart of the page plots, per series, in bucket order."""
    proto = at.get("vega_lite_chart")[index].proto
    (dataset,) = proto.datasets
    frame = pa.ipc.open_stream(dataset.data.data).read_all().to_pandas().sort_values("bucket")
    return {name: [round(v, 6) for v in group[value]] for name, group in frame.groupby(series)}


def metrics_by_label(at: AppTest) -> dict[str, tuple[str, str | None]]:
    return {m.label: (m.value, m.delta or None) for m in at.metric}


def test_overview_shows_current_hit_rates(agent_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCOPE_AGENT_URL", agent_url)
    monkeypatch.delenv("KVSCOPE_TOKEN", raising=False)
    at = AppTest.from_file(APP, default_timeout=30).run()
    assert not at.exception, [e.message for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert at.title[0].value == "Overview"
    metrics = metrics_by_label(at)
    # the batch was received just now: unless a 15 s boundary passed since, its bucket is not finished
    events, _ = metrics.pop("Events/s (last full bucket)")
    lag, _ = metrics.pop("Ingest lag p95 (last full bucket)")
    assert (events, lag) == ("0.0", "n/a") or (events == "0.4" and lag.endswith(" s"))  # 6 events / 15 s
    # the headline: the trailing 5 minutes hold all three requests (sums, not the last bucket);
    # nothing in the 5 minutes before, so no change is shown
    assert metrics == {
        "Recoverable hit rate": ("66.7%", None),
        "Raw hit rate": ("80.0%", None),
        "Raw − recoverable": ("13.3%", None),
        "Prompt tokens (last 5 minutes)": ("6,000", None),
        "Batches rejected": ("0", None),
        "Seq gaps detected": ("1", None),  # the batch came with seq 1: seq 0 never arrived
    }
    assert [s.value for s in at.subheader] == [
        "Recoverable vs raw hit rate",
        "Prompt tokens: recoverable / replayed / recomputed",
        "Usable rate per form",
        "Tokens lost by limiting form and reason",
        "Ingest health",
    ]
    assert not at.error  # no rule scheduler in this agent: no banner, and no error either
    # buckets of 15 s: r0 alone, then r1 + r2 (token sums, not averages of ratios)
    assert chart_points(at, 0, "series", "rate") == {"recoverable": [0.5, 0.75], "raw": [0.5, 0.95]}
    # a form's usable rate over the prompt tokens of the requests that looked it up
    assert chart_points(at, 2, "form", "usable rate") == {"full_kv": [0.95], "swa_window": [0.8]}
    # time axes are UTC, as the tables and the agent (Vega-Lite would draw the browser's zone)
    for chart in at.get("vega_lite_chart")[:3]:
        x = json.loads(chart.proto.spec)["encoding"]["x"]
        assert (x["type"], x["scale"]["type"], x["title"]) == ("temporal", "utc", "UTC")
        # 24-hour tick labels ("19:48"), the date at midnight; never Vega's 12-hour default
        assert "'%H:%M'" in x["axis"]["labelExpr"] and "%I" not in x["axis"]["labelExpr"] and "%p" not in x["axis"]["labelExpr"]
    # the tokens split: stacked bars per bucket
    (tokens,) = at.get("vega_lite_chart")[1].proto.datasets
    split = pa.ipc.open_stream(tokens.data.data).read_all().to_pandas()
    assert split.groupby("part")["prompt tokens"].sum().to_dict() == {"recoverable": 4000, "replayed": 0, "recomputed": 2000}
    # no form limited r1 or r2: their 800 lost tokens are "(no form)", and no Forms link
    lost = pa.ipc.open_stream(at.get("vega_lite_chart")[3].proto.datasets[0].data.data).read_all().to_pydict()
    assert (lost["form"], lost["tokens"]) == (["(no form)"], [800])
    # the drill: the bucket with the widest raw − recoverable gap (r1 + r2's: 95 % raw, 75 %
    # recoverable; r0's has none) opens the Requests page on it
    (link,) = at.get("page_link")
    assert link.proto.page == "requests"
    (dataset,) = at.get("vega_lite_chart")[0].proto.datasets
    second = sorted(set(pa.ipc.open_stream(dataset.data.data).read_all().column("bucket").to_pylist()))[1]
    start = calendar.timegm(second.timetuple())  # r1 and r2's bucket (UTC: the chart marks it so), the chart's second
    assert dict(parse_qsl(link.proto.query_string)) == {"window": "15 minutes", "form": "(all)", "start": str(start), "end": str(start + 15)}
    assert link.proto.label.endswith(" UTC, 95.0% raw, 75.0% recoverable")


def test_a_headline_without_enough_traffic_says_so(agent_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the last minute the batch (two minutes old) left no prompt tokens: the headline says
    "not enough traffic" and how many it saw, never 0 %."""
    monkeypatch.setenv("KVSCOPE_AGENT_URL", agent_url)
    monkeypatch.delenv("KVSCOPE_TOKEN", raising=False)
    at = AppTest.from_file(APP, default_timeout=30).run()
    at.selectbox(key="overview_headline").set_value("1 minute").run()
    assert not at.exception, [e.message for e in at.exception]
    metrics = metrics_by_label(at)
    assert metrics["Recoverable hit rate"] == ("not enough traffic", None)
    assert metrics["Raw hit rate"] == ("not enough traffic", None)
    assert metrics["Prompt tokens (last 1 minute)"] == ("0", None)
    assert any(c.value == "0 prompt tokens in the last 1 minute; the headline needs 1,000." for c in at.caption)


def test_overview_with_agent_down_shows_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("KVSCOPE_AGENT_URL", dead)
    at = AppTest.from_file(APP, default_timeout=30).run()
    assert not at.exception, [e.message for e in at.exception]
    assert len(at.error) == 1
    assert at.error[0].value.startswith(f"agent unreachable at {dead}")
    assert not at.metric


def test_client_errors_are_readable(agent_url: str) -> None:
    client = AgentClient(base_url=agent_url + "/")
    assert client.base_url == agent_url
    assert client.ready()
    assert query_frame(client, "totals")["prompt_tokens"].tolist() == [6000]
    assert client.query("totals")[0]["prompt_tokens"] == 6000
    with pytest.raises(AgentError, match=r"refused query nope \(HTTP 404\): unknown query 'nope'"):
        client.query("nope")
    with pytest.raises(AgentError, match=r"\(HTTP 400\): parameter 'bucket_seconds': must be >= 1"):
        client.query("hit_rate_timeseries", bucket_seconds=0)
    with pytest.raises(ValueError, match="must start with http"):
        AgentClient(base_url="localhost:9400")


def test_agent_url_resolution() -> None:
    assert (
        resolve_agent_url(["--agent", "http://h:1"], {"KVSCOPE_AGENT_URL": "http://e:2"})
        == "http://h:1"
    )
    assert resolve_agent_url(["-q", "tests"], {"KVSCOPE_AGENT_URL": "http://e:2"}) == "http://e:2"
    assert resolve_agent_url([], {}) == "http://127.0.0.1:9400"


def test_streamlit_command() -> None:
    assert streamlit_command("http://127.0.0.1:9400", 8501) == [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP_PATH),
        "--server.headless",
        "true",
        "--server.port",
        "8501",
        "--server.address",
        "127.0.0.1",
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "minimal",
        "--",
        "--agent",
        "http://127.0.0.1:9400",
    ]
    assert APP_PATH.is_file()
    with pytest.raises(ValueError, match="port must be in"):
        streamlit_command("http://x", 0)


def test_overview_tokens_lost_banner_links_and_gaps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens lost by limiting form and reason (a tie under both forms, lighter), the link to the
    Forms page on the form that lost most, firing alerts linking to Forms on their form and
    reason, and a line broken across a bucket without data."""
    base = (int(time.time()) // 60 - 3) * 60
    tie = {"limiting_form": "swa_window", "limiting_reason": "swa_evicted", "limiting_forms": ["swa_window", "linear_state"]}
    events = [
        {**request(base + 1, "r1", 1000, 200, 800), "limiting_form": "swa_window", "limiting_reason": "swa_evicted"},
        {**request(base + 2, "r2", 1000, 600, 1000), **tie},
        {**lookup(base + 2, "r2", "linear_state", 1000, 600), "reason": "linear_checkpoint_missing"},
        request(base + 121, "r3", 1000, 999, 1000),  # two minutes later: the minute between has no data
    ]
    with running_agent(tmp_path) as agent:
        body = {"schema_version": 1, "engine_id": "e1", "seq": 0, "sent_at": base, "events": events}
        stored = httpx.post(f"{agent.url}/v1/events", json=body, timeout=10).json()
        assert stored.get("status") == "stored", stored
        agent.app.state.active_alerts = lambda: [
            {"alertname": "RecoverableHitRateDrop", "state": "firing", "labels": {"engine": "e1"}, "annotations": {}, "value": 0.2, "active_at": 1.0, "firing_since": 2.0},
            {"alertname": "FormInvalidationSpike", "state": "firing", "labels": {"engine": "e1", "form": "linear_state", "reason": "linear_checkpoint_missing"}, "annotations": {}, "value": 0.5, "active_at": 1.0, "firing_since": 2.0},
            {"alertname": "EngineSilent", "state": "pending", "labels": {}, "annotations": {}, "value": 1.0, "active_at": 1.0, "firing_since": None},
        ]  # fmt: skip
        monkeypatch.setenv("KVSCOPE_AGENT_URL", agent.url)
        monkeypatch.delenv("KVSCOPE_TOKEN", raising=False)
        at = AppTest.from_file(APP, default_timeout=30)
        at.query_params["window"] = "1 hour"  # minute buckets
        at.run()
    assert not at.exception
    assert [e.value for e in at.error] == ["2 alert(s) firing: FormInvalidationSpike, RecoverableHitRateDrop — see the Alerts page."]
    links = {link.proto.label: (link.proto.page, dict(parse_qsl(link.proto.query_string))) for link in at.get("page_link")}
    assert links["FormInvalidationSpike on e1: open Forms on linear_state — no recurrent checkpoint (linear_checkpoint_missing)"] == (
        "forms", {"window": "1 hour", "engine": "e1", "form": "linear_state", "reason": "linear_checkpoint_missing"}
    )
    assert links["RecoverableHitRateDrop on e1: open Forms on the form that lost most tokens"] == ("forms", {"window": "1 hour", "engine": "e1"})
    most = "Most tokens lost: swa_window — sliding window evicted (swa_evicted), 1,000 of 1,000 tokens"
    assert links[most] == ("forms", {"window": "1 hour", "form": "swa_window", "reason": "swa_evicted"})
    lost = at.get("vega_lite_chart")[-1]
    (data,) = [pa.ipc.open_stream(d.data.data).read_all().to_pydict() for d in lost.proto.datasets]
    parts = {(f, r, p): t for f, r, p, t in zip(data["form"], data["reason"], data["part"], data["tokens"], strict=True)}
    assert parts == {("swa_window", "swa_evicted", "alone"): 600, ("swa_window", "swa_evicted", "tied"): 400, ("linear_state", "linear_checkpoint_missing", "tied"): 400, ("(no form)", "none", "alone"): 1}
    rates = at.get("vega_lite_chart")[0]
    (data,) = [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in rates.proto.datasets]
    raw = data[data["series"] == "raw"].sort_values("bucket")
    assert raw["segment"].nunique() == 2  # broken across the empty minute
    spec = json.loads(rates.proto.spec)
    assert spec["encoding"]["detail"]["field"] == "segment"
    assert dict(zip(spec["encoding"]["color"]["scale"]["domain"], spec["encoding"]["color"]["scale"]["range"], strict=True)) == {"recoverable": "#2ca02c", "raw": "#1f77b4"}
