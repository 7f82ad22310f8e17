"""Run ids (issue 24): an engine keeps its id across restarts and each run names itself on its
batches. The agent stores the run id beside every row (migration 11), answers where the engine's
seqs continue (``GET /v1/ingest/next-seq``), exports ``kvscope_engine_run_info`` for each
engine's latest run only, and puts the run id on no other series."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import pytest
from agent_testdata import batch, json_body, known_events, minute_start, request_event
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from agent.ingest import ingest_batch
from agent.migrations import MIGRATIONS, SCHEMA_VERSION
from agent.store import Store, _migrate, utc_now
from engine.events import EventError, decode_batch

JSON = {"content-type": "application/json"}
RUN_A = "0190a1b2c3d4aaaaaaaaaaaaaaaaaaaa"
RUN_B = "0190a1b2c3d5bbbbbbbbbbbbbbbbbbbb"


def post(client: TestClient, seq: int, events: list[dict[str, Any]], run_id: str | None, engine_id: str = "e1") -> dict[str, Any]:
    body = batch(seq, events, engine_id)
    if run_id is not None:
        body["run_id"] = run_id
    response = client.post("/v1/events", content=json_body(body), headers=JSON)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def sql(client: TestClient, query: str) -> list[list[Any]]:
    response = client.post("/v1/sql", json={"sql": query})
    assert response.status_code == 200, response.text
    rows: list[list[Any]] = response.json()["rows"]
    return rows


def run_info(client: TestClient) -> dict[str, str]:
    """engine → run_id of the ``kvscope_engine_run_info`` series (each must read 1)."""
    found: dict[str, str] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "kvscope_engine_run_info":
                assert sample.value == 1.0 and sample.labels["engine"] not in found
                found[sample.labels["engine"]] = sample.labels["run_id"]
    return found


def test_the_run_id_is_stored_on_every_row_and_the_info_metric_follows_the_latest_run(client: TestClient) -> None:
    base = minute_start()
    assert client.get("/v1/ingest/next-seq", params={"engine_id": "e1"}).json() == {"engine_id": "e1", "next_seq": 0}
    assert post(client, 0, known_events(base), RUN_A)["status"] == "stored"
    assert client.get("/v1/ingest/next-seq", params={"engine_id": "e1"}).json()["next_seq"] == 1
    assert run_info(client) == {"e1": RUN_A}
    # the next run continues at seq 1; a late re-send of run A's batch is a duplicate and does
    # not move the info metric back
    assert post(client, 1, [request_event(base + 1, "r-b")], RUN_B)["status"] == "stored"
    assert post(client, 0, known_events(base), RUN_A)["status"] == "duplicate"
    assert run_info(client) == {"e1": RUN_B}
    assert client.get("/v1/ingest/next-seq", params={"engine_id": "e1"}).json()["next_seq"] == 2
    for table in ("cache_lookups", "engine_stats", "block_events"):  # run B sent one request only
        assert sql(client, f"SELECT DISTINCT run_id FROM {table}") == [[RUN_A]], table
    assert sql(client, "SELECT run_id, count(*) FROM requests GROUP BY run_id ORDER BY run_id") == [[RUN_A, 2], [RUN_B, 1]]
    assert sql(client, "SELECT seq, status, run_id FROM ingest_batches ORDER BY received_at") == [
        [0, "stored", RUN_A],
        [1, "stored", RUN_B],
        [0, "duplicate", RUN_A],
    ]
    # the named queries the kvscope summary reads can keep one run
    totals = client.get("/v1/query/totals", params={"engine_id": "e1", "run_id": RUN_B}).json()
    assert totals["rows"][0][0] == 1
    assert client.get("/v1/query/totals", params={"engine_id": "e1"}).json()["rows"][0][0] == 3
    lost = client.get("/v1/query/tokens_lost", params={"run_id": RUN_A}).json()["rows"]
    assert sum(row[2] for row in lost) == 3800 - 3000  # the known batch's lost tokens alone
    outcomes = client.get("/v1/query/form_outcomes", params={"run_id": RUN_B}).json()["rows"]
    assert outcomes == []  # run B sent a request and no lookup
    # the run id labels this series only
    text = client.get("/metrics").text
    assert [ln for ln in text.splitlines() if "run_id=" in ln and not ln.startswith("kvscope_engine_run_info{")] == []


def test_a_batch_without_a_run_id_is_stored_with_null_and_a_bad_one_is_refused(client: TestClient) -> None:
    base = minute_start()
    assert post(client, 0, [request_event(base, "r-old")], None)["status"] == "stored"  # an older engine
    assert sql(client, "SELECT run_id FROM requests") == [[None]]
    assert run_info(client) == {}  # nothing to say about a run it did not name
    with pytest.raises(EventError) as error:
        decode_batch(json_body({**batch(1, []), "run_id": "no/slashes"}))
    assert error.value.path == "$.run_id"
    with pytest.raises(EventError):
        decode_batch(json_body({**batch(1, []), "run_id": "x" * 65}))


def test_next_seq_counts_rejected_batches_and_leaves_other_engines_alone(client: TestClient) -> None:
    base = minute_start()
    post(client, 4, [request_event(base, "r4")], RUN_A)  # 0..3 never arrived: a gap, still below
    bad = json_body({**batch(5, [request_event(base, "r5", prompt_tokens=1)]), "run_id": RUN_A})
    assert client.post("/v1/events", content=bad, headers=JSON).status_code == 422  # filed rejected
    assert client.get("/v1/ingest/next-seq", params={"engine_id": "e1"}).json()["next_seq"] == 6
    assert client.get("/v1/ingest/next-seq", params={"engine_id": "e2"}).json()["next_seq"] == 0


def test_a_version_10_database_gains_run_id_columns_reading_null(tmp_path: Path) -> None:
    path = tmp_path / "v10.duckdb"
    con = duckdb.connect(str(path))
    _migrate(con, MIGRATIONS[:10])
    con.execute("INSERT INTO ingest_batches VALUES ('e1', 0, now()::TIMESTAMP, 0, 'stored', NULL, 7)")
    con.close()
    with Store.open(path) as store:
        assert 11 in store.open_report.applied and store.schema_version == SCHEMA_VERSION
        body = {**batch(1, [request_event(minute_start() + 1, "r-new")]), "run_id": RUN_B}
        assert ingest_batch(store, decode_batch(json_body(body)), received_at=utc_now()).status == "stored"
        with store.cursor() as cur:
            assert cur.execute("SELECT seq, run_id FROM ingest_batches ORDER BY seq").fetchall() == [(0, None), (1, RUN_B)]
            assert cur.execute("SELECT request_id, run_id FROM requests").fetchall() == [("r-new", RUN_B)]
