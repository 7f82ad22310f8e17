"""Hostile input: attempts to make the agent store a partial or double batch, lose a batch, fail
with a 500, or run a write through the read-only ``/v1/sql`` sandbox — each must be refused
cleanly with stored data unchanged."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from agent_testdata import batch, json_body, known_events, lookup_event, request_event
from fastapi.testclient import TestClient

from agent.app import create_app
from agent.config import AgentConfig
from agent.metrics import AgentMetrics
from agent.store import Store

JSON = {"content-type": "application/json"}
MSGPACK = {"content-type": "application/msgpack"}


@pytest.fixture
def raw(config: AgentConfig, store: Store, metrics: AgentMetrics) -> Iterator[TestClient]:
    """A client that answers 500s instead of raising them (we assert on status codes)."""
    app = create_app(config, store, metrics=metrics, environ={})
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def sql(client: TestClient, query: str, fmt: str = "json"):
    return client.post("/v1/sql", json={"sql": query, "format": fmt})


def scalar(client: TestClient, query: str):
    response = sql(client, query)
    assert response.status_code == 200, response.text
    return response.json()["rows"][0][0]


def stored_rows(client: TestClient) -> dict[str, int]:
    tables = ("cache_lookups", "requests", "engine_stats", "block_events", "ingest_batches")
    return {t: scalar(client, f"SELECT count(*) FROM {t}") for t in tables}


def metric(metrics: AgentMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# -- ingest: findings ----------------------------------------------------------------------------------
def test_seq_beyond_bigint_is_a_contract_error_not_a_500(raw: TestClient, base: int) -> None:
    """A seq beyond BIGINT is a contract error (422 naming ``$.seq``), not a 500 after a
    partial insert."""
    for seq in (2**63, 2**64 - 1):
        response = raw.post(
            "/v1/events", content=json_body(batch(seq, known_events(base))), headers=JSON
        )
        assert response.status_code == 422, (seq, response.status_code, response.text)
        assert response.json()["error"]["path"] == "$.seq"
    assert stored_rows(raw)["requests"] == 0


def test_token_sum_overflow_never_answers_500_after_commit(
    raw: TestClient, metrics: AgentMetrics, base: int
) -> None:
    """Token counts are bounded so a batch's sums cannot overflow 64 bits: huge values are a 422,
    never a 500 after the commit. A non-2xx answer means nothing was stored; the metrics match
    what was stored."""
    big = 2**62
    events = [
        lookup_event(
            base + 1, f"r{i}", hash_hit_tokens=big, usable_tokens=big, recoverable_tokens=0
        )
        for i in range(2)
    ] + [
        request_event(base + 2, f"q{i}", prompt_tokens=big, recomputed_tokens=big) for i in range(2)
    ]
    response = raw.post("/v1/events", content=json_body(batch(1, events)), headers=JSON)
    rows = stored_rows(raw)
    if response.status_code != 200:
        assert rows["cache_lookups"] == rows["requests"] == 0, (
            f"answered {response.status_code} but stored the batch: {rows}"
        )
        assert metric(metrics, "kvscope_ingest_events_total", kind="cache_lookup") == 0
    else:
        assert rows["cache_lookups"] == 2 and rows["requests"] == 2
        assert metric(metrics, "kvscope_ingest_batches_total", status="stored") == 1
        assert metric(metrics, "kvscope_requests_total", engine="e1", model="m1") == 2


# -- ingest: regressions -------------------------------------------------------------------------------
def test_concurrent_duplicates_store_once(raw: TestClient, base: int) -> None:
    body = json_body(batch(7, known_events(base)))
    statuses: list[str] = []

    def post() -> None:
        statuses.append(raw.post("/v1/events", content=body, headers=JSON).json()["status"])

    threads = [threading.Thread(target=post) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses) == ["duplicate"] * 7 + ["stored"]
    assert stored_rows(raw)["requests"] == 2
    assert (
        scalar(raw, "SELECT count(*) FROM ingest_batches WHERE seq = 7 AND status = 'stored'") == 1
    )


def test_bad_strings_and_numbers_store_nothing(raw: TestClient, base: int) -> None:
    good = json_body(batch(1, known_events(base)))
    lone_surrogate = good.replace(b'"r1"', b'"\\ud800"')
    assert raw.post("/v1/events", content=lone_surrogate, headers=JSON).status_code == 422
    packed = msgspec.msgpack.encode(batch(2, known_events(base)))
    assert (
        raw.post(
            "/v1/events", content=packed.replace(b"r1", b"\xff\xfe"), headers=MSGPACK
        ).status_code
        == 422
    )
    nan = known_events(base)
    nan[0]["recovery_seconds"] = float("nan")
    assert (
        raw.post(
            "/v1/events", content=msgspec.msgpack.encode(batch(3, nan)), headers=MSGPACK
        ).status_code
        == 422
    )
    past_9999 = known_events(base)
    past_9999[-1]["ts"] = 1e12
    assert (
        raw.post("/v1/events", content=json_body(batch(4, past_9999)), headers=JSON).status_code
        == 422
    )
    rows = stored_rows(raw)
    assert rows["requests"] == rows["cache_lookups"] == 0
    # a later valid batch with a previously rejected seq is stored once
    assert (
        raw.post(
            "/v1/events", content=json_body(batch(4, known_events(base))), headers=JSON
        ).json()["status"]
        == "stored"
    )
    assert stored_rows(raw)["requests"] == 2


def test_stored_batch_survives_close_and_reopen(
    config: AgentConfig, store: Store, raw: TestClient, base: int
) -> None:
    assert (
        raw.post(
            "/v1/events", content=json_body(batch(1, known_events(base))), headers=JSON
        ).status_code
        == 200
    )
    store.close()
    with Store.open(config.db_path) as reopened, reopened.cursor() as cur:
        assert cur.execute("SELECT count(*) FROM requests").fetchall() == [(2,)]
        assert cur.execute("SELECT status, rows FROM ingest_batches").fetchall() == [("stored", 8)]


# -- /v1/sql: findings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "query",
    [
        "SELECT 'infinity'::TIMESTAMP AS t",
        "SELECT '-infinity'::TIMESTAMPTZ AS t",
        "SELECT 'infinity'::DATE AS d",
        "SELECT '294247-01-10 04:00:54'::TIMESTAMP AS t",
        "SELECT * FROM test_all_types()",
    ],
)
@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_sql_values_outside_python_datetime_are_not_a_500(
    loaded: TestClient, query: str, fmt: str
) -> None:
    """Timestamps and dates outside Python's ``datetime`` range (DuckDB's ±infinity, years past
    9999) are rendered as text, not a 500 for a legal read query."""
    app = loaded.app
    with TestClient(app, raise_server_exceptions=False) as client:
        response = sql(client, query, fmt)
    assert response.status_code == 200, (response.status_code, response.text[:200])


def test_sql_uhugeint_is_not_silently_wrong(loaded: TestClient) -> None:
    """UHUGEINT has no Arrow type (DuckDB exports it as ``decimal128(38, 0)``, so the maximum
    read back as -1): it is returned exactly, as text."""
    value = 340282366920938463463374607431768211455
    response = sql(loaded, f"SELECT {value}::UHUGEINT AS x")
    if response.status_code == 200:
        assert response.json()["rows"][0][0] in (value, str(value))
    else:
        assert response.status_code == 400


def test_sql_checkpoint_table_function_is_refused(
    config: AgentConfig, loaded: TestClient
) -> None:
    """``SELECT * FROM checkpoint()`` is a SELECT by statement type but folds the WAL into the
    database file: side-effecting table functions are refused."""
    wal = Path(str(config.db_path) + ".wal")
    before = wal.stat().st_size if wal.exists() else None
    response = sql(loaded, "SELECT * FROM checkpoint()")
    after = wal.stat().st_size if wal.exists() else None
    assert response.status_code in (400, 403), response.text
    assert before == after


# -- /v1/sql: regressions ------------------------------------------------------------------------------
FORBIDDEN = [
    "INSERT INTO requests SELECT * FROM requests",
    "DELETE FROM requests",
    "UPDATE requests SET model = 'x'",
    "DROP TABLE requests",
    "CREATE TABLE t AS SELECT 1",
    "CREATE MACRO m() AS 1",
    "ALTER TABLE requests ADD COLUMN x INT",
    "SET threads = 1",
    "RESET threads",
    "PRAGMA enable_profiling",
    "CALL pragma_version()",
    "ATTACH ':memory:' AS other",
    "DETACH other",
    "COPY requests TO '/tmp/x.csv'",
    "EXPORT DATABASE '/tmp/x'",
    "INSTALL httpfs",
    "LOAD httpfs",
    "CHECKPOINT",
    "VACUUM",
    "BEGIN TRANSACTION",
    "COMMIT",
    "EXPLAIN ANALYZE SELECT 1",
    "SELECT 1; DELETE FROM requests",
    "WITH d AS (DELETE FROM requests RETURNING *) SELECT * FROM d",
    "SET VARIABLE x = 1",
    "CREATE SECRET (TYPE s3, KEY_ID 'a', SECRET 'b')",
    "USE memory",
]


@pytest.mark.parametrize("query", FORBIDDEN)
def test_sql_writes_and_settings_are_refused(loaded: TestClient, query: str) -> None:
    before = stored_rows(loaded)
    response = sql(loaded, query)
    assert response.status_code in (400, 403), (query, response.status_code, response.text)
    assert stored_rows(loaded) == before


@pytest.mark.parametrize(
    "query",
    [
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_text('/etc/hostname')",
        "SELECT * FROM glob('/*')",
        "SELECT * FROM sniff_csv('/etc/passwd')",
        "SELECT * FROM read_parquet('http://127.0.0.1:1/x.parquet')",
        "SELECT * FROM query('DELETE FROM requests')",
        "SELECT * FROM duckdb_secrets()",
    ],
)
def test_sql_table_functions_cannot_reach_files_or_write(
    loaded: TestClient, query: str
) -> None:
    before = stored_rows(loaded)
    response = sql(loaded, query)
    assert response.status_code in (400, 403), (query, response.status_code, response.text)
    assert stored_rows(loaded) == before


def test_sql_settings_stay_locked(loaded: TestClient) -> None:
    assert scalar(loaded, "SELECT current_setting('enable_external_access')") is False
    assert scalar(loaded, "SELECT current_setting('lock_configuration')") is True
    response = sql(loaded, "SELECT * FROM duckdb_settings() WHERE name = 'lock_configuration'")
    assert response.status_code == 200


def test_sql_row_cap_time_limit_and_odd_text(loaded: TestClient) -> None:
    response = sql(loaded, "SELECT * FROM range(1000000000)")
    assert response.status_code == 200
    body = response.json()
    assert body["truncated"] is True and body["row_count"] == 10_000
    assert sql(loaded, "SELECT count(*) FROM range(1000000000000)").status_code == 408
    deep = "SELECT " + "(" * 5000 + "1" + ")" * 5000
    assert sql(loaded, deep).status_code == 400
    long_list = "SELECT " + "+".join(["1"] * 5000)
    assert sql(loaded, long_list).status_code == 400
    text = "ünï©ødé 🚀 \u202e \x00"
    response = sql(loaded, "SELECT $$" + text.replace("\x00", "") + "$$ AS s")
    assert response.status_code == 200 and response.json()["rows"] == [[text.replace("\x00", "")]]
    assert sql(loaded, "  ").status_code == 400
    assert sql(loaded, "SELECT ?").status_code == 400
    # the agent still answers after all of it
    assert scalar(loaded, "SELECT count(*) FROM requests") == 2


@pytest.mark.parametrize(
    "query",
    ["FROM query('FROM checkpoint()')", "SELECT * FROM query_table('requests')"],
)
def test_sql_that_runs_hidden_sql_or_cannot_be_checked_is_refused(loaded: TestClient, query: str) -> None:
    response = sql(loaded, query)
    assert response.status_code == 403, response.text
    assert "is not allowed here" in response.text
