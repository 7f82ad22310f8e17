"""POST /v1/sql: the read-only sandbox."""

from __future__ import annotations

import csv
import io
import threading

import pyarrow as pa
import pytest
from fastapi.testclient import TestClient

from agent.store import Store


def table_counts(store: Store) -> list[tuple[str, int]]:
    with store.cursor() as cur:
        return [
            (name, cur.execute(f"SELECT count(*) FROM {name}").fetchall()[0][0])
            for name in (
                "requests",
                "cache_lookups",
                "engine_stats",
                "block_events",
                "alerts",
                "ingest_batches",
            )
        ]


def test_select_json(loaded: TestClient) -> None:
    response = loaded.post(
        "/v1/sql",
        json={
            "sql": "SELECT request_id, prompt_tokens, ts, approximate FROM requests ORDER BY request_id"
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["columns"] == ["request_id", "prompt_tokens", "ts", "approximate"]
    assert body["types"] == ["VARCHAR", "BIGINT", "TIMESTAMP", "BOOLEAN"]
    assert body["row_count"] == 2
    assert body["truncated"] is False
    assert [row[:2] + row[3:] for row in body["rows"]] == [["r1", 1000, False], ["r2", 3000, True]]
    ts = body["rows"][0][2]
    assert isinstance(ts, str) and ts[10] == "T"  # ISO 8601


def test_select_csv_and_arrow(loaded: TestClient) -> None:
    sql = "SELECT request_id, recoverable_tokens FROM requests ORDER BY request_id"
    as_csv = loaded.post("/v1/sql", json={"sql": sql, "format": "csv"})
    assert as_csv.status_code == 200
    assert as_csv.headers["content-type"].startswith("text/csv")
    assert list(csv.reader(io.StringIO(as_csv.text))) == [
        ["request_id", "recoverable_tokens"],
        ["r1", "600"],
        ["r2", "2400"],
    ]
    as_arrow = loaded.post("/v1/sql", json={"sql": sql, "format": "arrow"})
    assert as_arrow.status_code == 200
    assert as_arrow.headers["content-type"] == "application/vnd.apache.arrow.stream"
    assert as_arrow.headers["x-kvscope-truncated"] == "false"
    table = pa.ipc.open_stream(as_arrow.content).read_all()
    assert table.to_pydict() == {"request_id": ["r1", "r2"], "recoverable_tokens": [600, 2400]}


def test_row_cap_sets_truncated(loaded: TestClient) -> None:
    response = loaded.post(
        "/v1/sql", json={"sql": "SELECT * FROM range(10) t(i) ORDER BY i", "limit": 3}
    )
    body = response.json()
    assert body["rows"] == [[0], [1], [2]]
    assert body["row_count"] == 3
    assert body["truncated"] is True
    exact = loaded.post("/v1/sql", json={"sql": "SELECT * FROM range(3) t(i)", "limit": 3}).json()
    assert exact["truncated"] is False
    csv_answer = loaded.post(
        "/v1/sql", json={"sql": "SELECT * FROM range(10)", "limit": 3, "format": "csv"}
    )
    assert csv_answer.headers["x-kvscope-truncated"] == "true"


REFUSED = [
    ("COPY requests TO '/tmp/kvscope-leak.csv'", 403, "are allowed, not COPY"),
    ("ATTACH '/tmp/other.duckdb' AS other", 403, "are allowed, not ATTACH"),
    ("SET threads = 1", 403, "are allowed, not SET"),
    ("INSERT INTO requests SELECT * FROM requests", 403, "are allowed, not INSERT"),
    ("DELETE FROM requests", 403, "are allowed, not DELETE"),
    ("UPDATE requests SET prompt_tokens = 0", 403, "are allowed, not UPDATE"),
    ("DROP TABLE requests", 403, "are allowed, not DROP"),
    ("PRAGMA database_size", 403, "are allowed, not PRAGMA"),
    ("EXPLAIN ANALYZE SELECT 1", 403, "are allowed, not EXPLAIN"),
    ("CALL checkpoint()", 403, "are allowed, not CALL"),
    ("SELECT 1; DELETE FROM requests", 403, "exactly one statement is allowed, got 2"),
    ("SELECT * FROM read_csv('/etc/passwd')", 400, "Permission Error"),
    ("SELECT * FROM glob('/etc/*')", 400, "file system operations are disabled"),
    ("SELECT * FROM query('DELETE FROM requests')", 403, "function query() is not allowed"),
    ("SELEC 1", 400, "Parser Error"),
    ("SELECT nope FROM requests", 400, "Binder Error"),
    ("", 400, "no SQL statement given"),
]


@pytest.mark.parametrize(
    ("statement", "status", "message"), REFUSED, ids=[r[0] or "empty" for r in REFUSED]
)
def test_refused_statements_leave_data_unchanged(
    loaded: TestClient, store: Store, statement: str, status: int, message: str
) -> None:
    before = table_counts(store)
    response = loaded.post("/v1/sql", json={"sql": statement})
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["reason"]
    assert table_counts(store) == before


def test_not_select_message_is_clear(loaded: TestClient) -> None:
    reason = loaded.post("/v1/sql", json={"sql": "DELETE FROM requests"}).json()["error"]["reason"]
    assert reason.startswith("only read statements (SELECT")


def test_bad_request_bodies(loaded: TestClient) -> None:
    assert (
        loaded.post(
            "/v1/sql", content=b"{", headers={"content-type": "application/json"}
        ).status_code
        == 400
    )
    unknown = loaded.post("/v1/sql", json={"sql": "SELECT 1", "fmt": "csv"})
    assert unknown.status_code == 400
    assert "unknown field `fmt`" in unknown.json()["error"]["reason"]
    bad_format = loaded.post("/v1/sql", json={"sql": "SELECT 1", "format": "xml"})
    assert bad_format.status_code == 400
    assert loaded.post("/v1/sql", json={"sql": "SELECT 1", "limit": 0}).status_code == 400


@pytest.mark.parametrize(
    "slow",
    [
        "SELECT count(*) FROM range(1000000000) a, range(1000000000) b",
        "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r",
    ],
    ids=["cross join", "recursive cte"],
)
def test_slow_query_is_interrupted_and_the_agent_keeps_serving(
    loaded: TestClient, slow: str
) -> None:
    finished = threading.Event()
    result: dict[str, object] = {}

    def run() -> None:
        response = loaded.post("/v1/sql", json={"sql": slow})
        result["status"] = response.status_code
        result["reason"] = response.json()["error"]["reason"]
        finished.set()

    worker = threading.Thread(target=run)
    worker.start()
    # The limit is 0.5 s; allow generous scheduling slack on a loaded machine.
    assert finished.wait(timeout=10.0), "the query was not interrupted"
    worker.join()
    assert result == {
        "status": 408,
        "reason": "query exceeded the time limit of 0.5 s and was interrupted",
    }
    after = loaded.post("/v1/sql", json={"sql": "SELECT count(*) FROM requests"})
    assert after.json()["rows"] == [[2]]
    assert loaded.get("/healthz").status_code == 200


def test_value_rendering_json_and_csv(client: TestClient) -> None:
    sql = (
        "SELECT 1.5::DECIMAL(10,2) AS d, [1, 2] AS l, {'a': 1} AS s, 'x'::BLOB AS b, "
        "INTERVAL '1 month 2 days 3.5 seconds' AS iv, TIMESTAMP '2024-01-01 00:00:01.5' AS t, "
        "NULL::VARCHAR AS n, true AS flag"
    )
    body = client.post("/v1/sql", json={"sql": sql}).json()
    assert body["types"] == [
        "DECIMAL(10,2)",
        "INTEGER[]",
        "STRUCT(a INTEGER)",
        "BLOB",
        "INTERVAL",
        "TIMESTAMP",
        "VARCHAR",
        "BOOLEAN",
    ]
    assert body["rows"] == [
        [1.5, [1, 2], {"a": 1}, "eA==", "P1M2DT3.5S", "2024-01-01T00:00:01.500000", None, True]
    ]
    as_csv = client.post("/v1/sql", json={"sql": sql, "format": "csv"}).text
    assert as_csv.splitlines()[1] == (
        '1.50,"[1,2]","{""a"":1}",eA==,P1M2DT3.5S,2024-01-01T00:00:01.500000,,true'
    )
