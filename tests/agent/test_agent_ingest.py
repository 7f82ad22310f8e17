"""POST /v1/events: exact rows stored, idempotence, and every malformed input refused."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from agent_testdata import batch, json_body, known_events, lookup_event, request_event
from fastapi.testclient import TestClient

from agent.store import Store

JSON = {"content-type": "application/json"}
MSGPACK = {"content-type": "application/msgpack"}


def naive_utc(unix_seconds: float) -> datetime:
    return datetime.fromtimestamp(unix_seconds, UTC).replace(tzinfo=None)


def snapshot(store: Store) -> dict[str, list[tuple[Any, ...]]]:
    """Every event table's rows (without ingested_at), sorted: to prove nothing changed."""
    tables = ["cache_lookups", "requests", "engine_stats", "block_events", "ingest_batches"]
    out = {}
    with store.cursor() as cur:
        for table in tables:
            columns = (
                "engine_id, seq, rows, status"
                if table == "ingest_batches"
                else "* EXCLUDE (ingested_at)"
            )
            out[table] = sorted(cur.execute(f"SELECT {columns} FROM {table}").fetchall(), key=repr)
    return out


def test_json_batch_stores_exact_rows(loaded: TestClient, store: Store, base: int) -> None:
    with store.cursor() as cur:
        requests = cur.execute(
            "SELECT * EXCLUDE (ingested_at, run_id) FROM requests ORDER BY request_id"
        ).fetchall()
        lookups = cur.execute(
            "SELECT ts, request_id, form, tier, outcome, reason, hash_hit_tokens, usable_tokens, "
            "recoverable_tokens, replayed_tokens, approximate, recovery_seconds, bytes_moved, "
            "layer_group, tp_rank, epoch FROM cache_lookups ORDER BY request_id, form"
        ).fetchall()
        stats = cur.execute("SELECT * EXCLUDE (ingested_at, run_id) FROM engine_stats").fetchall()
        blocks = cur.execute("SELECT * EXCLUDE (ingested_at, run_id) FROM block_events").fetchall()
        batches = cur.execute(
            "SELECT engine_id, seq, rows, status, error FROM ingest_batches"
        ).fetchall()
        ingested = cur.execute(
            "SELECT count(DISTINCT ingested_at) FROM "
            "(SELECT ingested_at FROM requests UNION ALL SELECT ingested_at FROM cache_lookups)"
        ).fetchone()
    assert requests == [
        (naive_utc(base + 2), "e1", "r1", "m1", 1000, 10, 800, 600, 600, 0, 400, False,
         "swa_window", "swa_evicted", "exact", 0.125, 1.5, 0.0, 0.0, []),
        (naive_utc(base + 4), "e1", "r2", "m1", 3000, 10, 3000, 2600, 2400, 200, 400, True,
         "linear_state", "linear_checkpoint_missing", "tail_replay", 0.1, 0.5, 0.0, 0.0, []),
    ]  # fmt: skip
    assert lookups == [
        (naive_utc(base + 1), "r1", "full_kv", "device", "hit", "none", 800, 800, 600, 0, False, 0.0, 0, 0, 0, 0),
        (naive_utc(base + 1), "r1", "swa_window", "device", "invalidated", "swa_evicted", 800, 600, 600, 0, False, 0.0, 0, 0, 0, 0),
        (naive_utc(base + 3), "r2", "full_kv", "host", "recovered", "kv_evicted", 3000, 3000, 2400, 0, False, 0.25, 1_048_576, 0, 0, 7),
        (naive_utc(base + 3), "r2", "linear_state", "device", "replayed", "linear_checkpoint_missing", 3000, 2400, 2400, 200, True, 0.0, 0, 1, 0, 0),
    ]  # fmt: skip
    assert stats == [
        (naive_utc(base + 5), "e1", "m1", "full_kv", "device", 4096, 2, 1, 5, 8, 1, 0, 0)
    ]
    assert blocks == [
        (naive_utc(base + 6), "e1", "m1", "full_kv", "device", "stored", "ab12", 3, 16)
    ]
    assert batches == [("e1", 1, 8, "stored", None)]
    assert ingested == (1,)


def test_ts_keeps_microseconds(client: TestClient, store: Store) -> None:
    ts = 1_700_000_000.123456
    response = client.post(
        "/v1/events", content=json_body(batch(1, [request_event(ts, "r9")])), headers=JSON
    )
    assert response.status_code == 200
    with store.cursor() as cur:
        row = cur.execute("SELECT ts FROM requests").fetchone()
    assert row == (datetime(2023, 11, 14, 22, 13, 20, 123456),)


def test_msgpack_batch_stores_exact_rows(client: TestClient, store: Store, base: int) -> None:
    body = msgspec.msgpack.encode(batch(5, known_events(base)))
    for media_type in ("application/msgpack", "application/x-msgpack"):
        response = client.post("/v1/events", content=body, headers={"content-type": media_type})
        assert response.status_code == 200
    assert response.json() == {"status": "duplicate", "events": 8}
    with store.cursor() as cur:
        assert cur.execute(
            "SELECT request_id, prompt_tokens, recoverable_tokens FROM requests ORDER BY 1"
        ).fetchall() == [("r1", 1000, 600), ("r2", 3000, 2400)]
        assert cur.execute("SELECT count(*) FROM cache_lookups").fetchone() == (4,)


def test_duplicate_seq_is_acknowledged_and_not_stored_twice(
    client: TestClient, store: Store, base: int
) -> None:
    body = json_body(batch(1, known_events(base)))
    first = client.post("/v1/events", content=body, headers=JSON)
    second = client.post("/v1/events", content=body, headers=JSON)
    assert first.json() == {"status": "stored", "events": 8}
    assert second.status_code == 200
    assert second.json() == {"status": "duplicate", "events": 8}
    other_engine = client.post(
        "/v1/events",
        content=json_body(batch(1, [request_event(base, "x1", engine_id="e2")], engine_id="e2")),
        headers=JSON,
    )
    assert other_engine.json() == {"status": "stored", "events": 1}
    with store.cursor() as cur:
        assert cur.execute("SELECT count(*) FROM requests").fetchone() == (3,)
        assert cur.execute(
            "SELECT engine_id, seq, rows, status FROM ingest_batches ORDER BY received_at, engine_id"
        ).fetchall() == [("e1", 1, 8, "stored"), ("e1", 1, 0, "duplicate"), ("e2", 1, 1, "stored")]


def _with(events: list[dict[str, Any]], index: int, **changes: Any) -> list[dict[str, Any]]:
    changed = [dict(e) for e in events]
    changed[index].update(changes)
    return changed


def _without(events: list[dict[str, Any]], index: int, key: str) -> list[dict[str, Any]]:
    changed = [dict(e) for e in events]
    del changed[index][key]
    return changed


TIE = ["full_kv", "swa_window"]
"""Two forms tied as limiting the resume point (``limiting_forms``), in ``Form`` order."""
ONE = ["linear_state"]
TWICE = ["linear_state", "full_kv", "linear_state"]

MALFORMED: list[tuple[str, Any, str, str]] = [
    # (case, body builder(base) -> bytes, expected path, substring of the reason)
    (
        "wrong type",
        lambda b: json_body(batch(2, _with(known_events(b), 2, prompt_tokens="many"))),
        "$.events[2].prompt_tokens",
        "Expected `int`",
    ),
    (
        "missing field",
        lambda b: json_body(batch(2, _without(known_events(b), 0, "form"))),
        "$.events[0]",
        "missing required field `form`",
    ),
    (
        "unknown event kind",
        lambda b: json_body(batch(2, _with(known_events(b), 6, kind="gpu_stats"))),
        "$.events[6].kind",
        "Invalid value 'gpu_stats'",
    ),
    (
        "unknown enum value",
        lambda b: json_body(batch(2, _with(known_events(b), 0, form="on_disk_prefix"))),
        "$.events[0].form",
        "Invalid enum value 'on_disk_prefix'",
    ),
    (
        "ghost memory without a ghost resume point",
        lambda b: json_body(batch(2, _with(known_events(b), 1, ghost_bytes=4096))),
        "$.events[1].ghost_bytes",
        "ghost_bytes and a non-zero ghost_tokens go together",
    ),
    (
        "ghost resume point past the hash hit",
        lambda b: json_body(batch(2, _with(known_events(b), 1, ghost_tokens=801, ghost_bytes=4096))),
        "$.events[1].ghost_tokens",
        "exceeds hash_hit_tokens",
    ),
    (
        "ghost point needing no memory",
        lambda b: json_body(batch(2, _with(known_events(b), 1, ghost_tokens=800, ghost_bytes=0))),
        "$.events[1].ghost_bytes",
        "must be > 0",
    ),
    (
        "ghost point not past the usable tokens",
        lambda b: json_body(batch(2, _with(known_events(b), 1, ghost_tokens=600, ghost_bytes=4096))),
        "$.events[1].ghost_tokens",
        "must exceed usable_tokens",
    ),
    (
        "spare memory without usable tokens",
        lambda b: json_body(batch(2, _with(known_events(b), 0, usable_tokens=0, recoverable_tokens=0, spare_bytes=4096))),
        "$.events[0].spare_bytes",
        "only a lookup with usable tokens has spare memory",
    ),
    (
        "engine_id mismatch",
        lambda b: json_body(batch(2, _with(known_events(b), 3, engine_id="e9"))),
        "$.events[3].engine_id",
        "differs from the batch's engine_id",
    ),
    (
        "token split does not add up",
        lambda b: json_body(batch(2, _with(known_events(b), 5, recomputed_tokens=401))),
        "$.events[5].prompt_tokens",
        "recoverable + replayed + recomputed = 3001 != prompt_tokens 3000",
    ),
    (
        "limiting_forms without the limiting_form",
        lambda b: json_body(batch(2, _with(known_events(b), 5, limiting_forms=TIE))),
        "$.events[5].limiting_forms",
        "does not contain limiting_form linear_state",
    ),
    (
        "limiting_forms but no limiting_form",
        lambda b: json_body(
            batch(2, _with(known_events(b), 5, limiting_form=None, limiting_forms=ONE))
        ),
        "$.events[5].limiting_forms",
        "does not contain limiting_form None",
    ),
    (
        "limiting_forms names a form twice",
        lambda b: json_body(batch(2, _with(known_events(b), 5, limiting_forms=TWICE))),
        "$.events[5].limiting_forms",
        "names a form twice",
    ),
    (
        "integer past its column",
        lambda b: json_body(batch(2, _with(known_events(b), 4, layer_group=2**31))),
        "$.events[4].layer_group",
        "<= 2147483647",
    ),
    (
        "bad json",
        lambda b: b'{"schema_version": 1, "engine_id": "e1", ',
        "$",
        "malformed json body",
    ),
    (
        "wrong schema version",
        lambda b: json_body({**batch(2, known_events(b)), "schema_version": 2}),
        "$.schema_version",
        "unsupported schema_version 2",
    ),
]


@pytest.mark.parametrize(
    ("case", "build", "path", "reason"), MALFORMED, ids=[m[0] for m in MALFORMED]
)
def test_malformed_json_is_rejected_and_changes_nothing(
    loaded: TestClient, store: Store, base: int, case: str, build: Any, path: str, reason: str
) -> None:
    before = snapshot(store)
    response = loaded.post("/v1/events", content=build(base), headers=JSON)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["path"] == path
    assert reason in error["reason"]
    after = snapshot(store)
    rejected = [row for row in after["ingest_batches"] if row[3] == "rejected"]
    # The rejected batch is filed (engine_id and seq were readable) unless the body was garbage.
    assert rejected == ([] if case == "bad json" else [("e1", 2, 0, "rejected")])
    after["ingest_batches"] = [row for row in after["ingest_batches"] if row[3] != "rejected"]
    assert after == before


def test_bad_msgpack_is_rejected(loaded: TestClient, store: Store) -> None:
    before = snapshot(store)
    response = loaded.post("/v1/events", content=b"\xc1\xff\x00", headers=MSGPACK)
    assert response.status_code == 422
    assert response.json()["error"]["path"] == "$"
    assert "malformed msgpack body" in response.json()["error"]["reason"]
    assert snapshot(store) == before


def test_rejected_batch_then_corrected_batch_with_same_seq_is_stored(
    client: TestClient, store: Store, base: int
) -> None:
    bad = _with(known_events(base), 5, recomputed_tokens=401)
    assert (
        client.post("/v1/events", content=json_body(batch(3, bad)), headers=JSON).status_code == 422
    )
    good = client.post("/v1/events", content=json_body(batch(3, known_events(base))), headers=JSON)
    assert good.json() == {"status": "stored", "events": 8}
    with store.cursor() as cur:
        assert cur.execute(
            "SELECT status, rows FROM ingest_batches ORDER BY received_at"
        ).fetchall() == [("rejected", 0), ("stored", 8)]
        error = cur.execute("SELECT error FROM ingest_batches WHERE status = 'rejected'").fetchone()
    assert error is not None
    assert error[0].startswith("$.events[5].prompt_tokens: recoverable + replayed")


def test_wrong_content_type_is_415(loaded: TestClient, store: Store, base: int) -> None:
    before = snapshot(store)
    response = loaded.post(
        "/v1/events",
        content=json_body(batch(2, known_events(base))),
        headers={"content-type": "text/plain"},
    )
    assert response.status_code == 415
    assert "unsupported content type 'text/plain'" in response.json()["error"]["reason"]
    assert snapshot(store) == before


def test_body_too_large_is_413(loaded: TestClient, store: Store, base: int) -> None:
    before = snapshot(store)
    events = [lookup_event(base, f"r{i}", hash_hit_tokens=1) for i in range(1000)]
    body = json_body(batch(2, events))
    assert len(body) > 64 * 1024
    response = loaded.post("/v1/events", content=body, headers=JSON)
    assert response.status_code == 413
    assert "exceeds the limit of 65536 bytes" in response.json()["error"]["reason"]

    def chunks() -> Any:  # no content-length: the limit applies while streaming
        yield body[: len(body) // 2]
        yield body[len(body) // 2 :]

    streamed = loaded.post("/v1/events", content=chunks(), headers=JSON)
    assert streamed.status_code == 413
    assert snapshot(store) == before


def test_every_event_field_has_its_column(store: Store) -> None:
    """The event structs (engine/events.py), the Arrow tables built from them and the migrated
    tables agree column for column, so a new event field cannot be silently dropped."""
    from agent.ingest import TABLE_SPECS

    duck = {
        "int64": "BIGINT", "int32": "INTEGER", "string": "VARCHAR", "bool": "BOOLEAN", "double": "DOUBLE",
        "timestamp[us]": "TIMESTAMP", "list<item: string>": "VARCHAR[]",
        "dictionary<values=string, indices=int8, ordered=0>": "VARCHAR",  # an enum
    }  # fmt: skip
    with store.cursor() as cur:
        for spec in TABLE_SPECS.values():
            described = [(name, kind) for name, kind, *_ in cur.execute(f"DESCRIBE {spec.table}").fetchall()]
            expected = [(name, duck[str(dtype)]) for name, dtype in spec.columns]
            # DuckDB appends a later migration's column, wherever its field sits in the struct (rows
            # are inserted by column name): same names and types, each once
            assert len(described) == len(expected) and dict(described) == dict(expected), spec.table
            assert ("ingested_at", "TIMESTAMP") in described, spec.table


def test_limiting_forms_round_trip_through_the_api(
    client: TestClient, store: Store, base: int
) -> None:
    """A tie (full_kv and swa_window both at L*) is stored as a list, in the event's order, and
    read back by ``recent_requests``; a request without ties reads []. JSON and msgpack alike."""
    tied = request_event(
        base + 2,
        "r-tie",
        hash_hit_tokens=800,
        resume_tokens=512,
        recoverable_tokens=512,
        recomputed_tokens=488,
        limiting_form="swa_window",
        limiting_reason="swa_evicted",
        limiting_forms=["full_kv", "swa_window"],
    )
    first = client.post("/v1/events", content=json_body(batch(1, [tied])), headers=JSON)
    assert first.json()["status"] == "stored"
    mp = [{**tied, "request_id": "r-tie-mp"}, request_event(base + 3, "r-none")]
    second = client.post("/v1/events", content=msgspec.msgpack.encode(batch(2, mp)), headers=MSGPACK)  # fmt: skip
    assert second.json()["status"] == "stored"
    expected = {"r-none": [], "r-tie": TIE, "r-tie-mp": TIE}
    with store.cursor() as cur:
        stored = cur.execute("SELECT request_id, limiting_forms FROM requests").fetchall()
    assert dict(stored) == expected and len(stored) == 3
    response = client.get("/v1/query/recent_requests", params={"since_seconds": 366 * 86400})
    assert response.status_code == 200, response.text
    answer = response.json()
    at = answer["columns"].index("request_id"), answer["columns"].index("limiting_forms")
    assert {row[at[0]]: row[at[1]] for row in answer["rows"]} == expected
