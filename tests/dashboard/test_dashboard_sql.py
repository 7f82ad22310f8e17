"""The SQL page (issue 8, item 5) against a real agent: the schema beside the editor, a query's
result as a table, a chart and a CSV download, an example filling the editor, and a refused
query's reason shown on the page."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from streamlit.testing.v1 import AppTest

from tests.dashboard.agent_fixture import RunningAgent, running_agent

PAGE = "from dashboard import sql_page\nsql_page.render()\n"


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[RunningAgent]:
    now = time.time()
    with running_agent(tmp_path) as running:
        events = [request(now - 60 + i, i) for i in range(1, 5)]
        body = {"schema_version": 1, "engine_id": "e1", "seq": 0, "sent_at": now, "events": events}
        assert httpx.post(f"{running.url}/v1/events", json=body, timeout=10).json()["status"] == "stored"
        yield running


def request(ts: float, i: int) -> dict[str, object]:
    return {
                "kind": "request", "ts": ts, "engine_id": "e1", "request_id": f"r{i}", "model": "m1",
                "prompt_tokens": 1000, "output_tokens": 1, "hash_hit_tokens": 800, "resume_tokens": 100 * i,
                "recoverable_tokens": 100 * i, "replayed_tokens": 0, "recomputed_tokens": 1000 - 100 * i,
                "admission": "exact", "ttft_seconds": 0.1, "e2e_seconds": 0.2,
    }  # fmt: skip


def page(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> AppTest:
    monkeypatch.setenv("KVSCOPE_AGENT_URL", agent.url)
    monkeypatch.delenv("KVSCOPE_TOKEN", raising=False)
    return AppTest.from_string(PAGE, default_timeout=30).run()


def test_schema_query_table_chart_and_csv(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = page(agent, monkeypatch)
    assert not at.exception and not at.error
    tables = [e.label for e in at.expander]
    assert {"requests", "cache_lookups", "alerts", "alert_silences", "cache_minute"} <= set(tables)
    at.text_area(key="sql_text").set_value(
        "SELECT request_id, recoverable_tokens, recoverable_tokens / prompt_tokens AS rate FROM requests ORDER BY request_id"
    )
    at.button[0].click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    result = at.dataframe[0].value
    assert result.values.tolist() == [["r1", 100, 0.1], ["r2", 200, 0.2], ["r3", 300, 0.3], ["r4", 400, 0.4]]
    assert at.caption[-1].value == "4 rows"
    assert at.selectbox(key="sql_chart_x").value == "request_id"
    assert at.selectbox(key="sql_chart_y").options == ["recoverable_tokens", "rate"]
    (chart,) = at.get("vega_lite_chart")  # request_id is not numeric: a bar per request
    spec = chart.proto.spec
    assert '"bar"' in spec and "recoverable_tokens" in spec
    (download,) = at.get("download_button")
    assert download.proto.label == "Download CSV"


def test_examples_fill_the_editor_and_run(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    from dashboard.sql_page import EXAMPLES

    at = page(agent, monkeypatch)
    name = "Which form limited the resume point"
    at.selectbox(key="sql_example").set_value(name).run()
    assert at.text_area(key="sql_text").value == EXAMPLES[name]
    at.button[0].click().run()
    assert at.dataframe[0].value.values.tolist() == [["none", "none", 4]]
    # every saved example runs against the sandbox; the last-hour one sees the requests of a minute ago
    for sql in EXAMPLES.values():
        assert httpx.post(f"{agent.url}/v1/sql", json={"sql": sql}, timeout=10).status_code == 200, sql
    last_hour = httpx.post(f"{agent.url}/v1/sql", json={"sql": EXAMPLES["Recoverable hit rate per engine, last hour"]}, timeout=10).json()
    assert [[*row[:2], row[4]] for row in last_hour["rows"]] == [["e1", "m1", 4]]


def test_repeated_column_names_are_shown(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    at = page(agent, monkeypatch)
    at.text_area(key="sql_text").set_value("SELECT a.request_id, b.request_id FROM requests a JOIN requests b USING (request_id) ORDER BY 1 LIMIT 2")
    at.button[0].click().run()
    assert not at.exception and not at.error
    assert list(at.dataframe[0].value.columns) == ["request_id", "request_id_1"]


@pytest.mark.parametrize(
    ("sql", "reason"),
    [
        ("DELETE FROM requests", "only read statements"),
        ("SELECT * FROM read_csv('/etc/passwd')", "HTTP 400"),
        ("SELEC 1", "syntax error"),
    ],
)
def test_a_refused_query_shows_the_reason(agent: RunningAgent, monkeypatch: pytest.MonkeyPatch, sql: str, reason: str) -> None:
    at = page(agent, monkeypatch)
    at.text_area(key="sql_text").set_value(sql)
    at.button[0].click().run()
    assert not at.exception
    assert at.error[0].value.startswith("The query failed:") and reason in at.error[0].value
    assert httpx.post(f"{agent.url}/v1/sql", json={"sql": "SELECT count(*) AS n FROM requests"}, timeout=10).json()["rows"] == [[4]]
