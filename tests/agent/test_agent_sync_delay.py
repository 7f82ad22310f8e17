"""The indexer sync delay in the event contract and the agent (issue 23, item 4): bad field values
are refused with their path; migration 10 adds the columns, rows stored before read 0; the named
queries answer per bucket and layer group, and the alert's series only above its threshold."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from agent_testdata import batch, json_body, lookup_event, minute_start

from agent.ingest import ingest_batch
from agent.migrations import MIGRATIONS, SCHEMA_VERSION
from agent.queries import get_query
from agent.store import Store, utc_now
from engine.events import EventError, decode_batch


def indexer_lookup(ts: float, request_id: str, **fields: Any) -> dict[str, Any]:
    """An ``indexer_state`` lookup of a 64-token hash hit, invalidated as stale."""
    event = {"form": "indexer_state", "outcome": "invalidated", "reason": "indexer_stale", "hash_hit_tokens": 64}
    return lookup_event(ts, request_id, **{**event, **fields})


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    # (case, fields of the lookup, expected path, substring of the reason)
    ("negative tokens", {"indexer_sync_delay_tokens": -16}, "indexer_sync_delay_tokens", "Expected `int` >= 0"),
    ("fractional tokens", {"indexer_sync_delay_tokens": 16.5}, "indexer_sync_delay_tokens", "Expected `int`, got `float`"),
    ("tokens as a flag", {"indexer_sync_delay_tokens": True}, "indexer_sync_delay_tokens", "Expected `int`, got `bool`"),
    ("seconds as text", {"indexer_sync_delay_tokens": 16, "indexer_sync_delay_seconds": "1s"}, "indexer_sync_delay_seconds", "Expected `float`, got `str`"),
    ("negative seconds", {"indexer_sync_delay_tokens": 16, "indexer_sync_delay_seconds": -1.0}, "indexer_sync_delay_seconds", "Expected `float` >= 0.0"),
    ("seconds while in sync", {"indexer_sync_delay_seconds": 2.5}, "indexer_sync_delay_seconds", "must be 0 while indexer_sync_delay_tokens is 0"),
    ("past the hash hit", {"indexer_sync_delay_tokens": 80}, "indexer_sync_delay_tokens", "exceeds hash_hit_tokens"),
    ("another form", {"form": "compressed_kv", "reason": "compressed_evicted", "indexer_sync_delay_tokens": 16}, "indexer_sync_delay_tokens", "only an indexer_state lookup"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "fields", "field", "reason"), BAD, ids=[b[0] for b in BAD])
def test_bad_sync_delay_values_are_refused_with_their_path(case: str, fields: dict[str, Any], field: str, reason: str) -> None:
    body = json_body(batch(1, [lookup_event(1.0, "r0"), indexer_lookup(2.0, "r1", **fields)]))
    with pytest.raises(EventError) as error:
        decode_batch(body)
    assert error.value.path == f"$.events[1].{field}"
    assert reason in error.value.reason


def test_a_trailing_indexer_lookup_is_accepted() -> None:
    (_, lookup) = decode_batch(json_body(batch(1, [lookup_event(1.0, "r0"), indexer_lookup(2.0, "r1", indexer_sync_delay_tokens=16, indexer_sync_delay_seconds=2.5)]))).events
    assert (lookup.indexer_sync_delay_tokens, lookup.indexer_sync_delay_seconds) == (16, 2.5)  # type: ignore[union-attr]


def test_a_version_9_database_gains_the_sync_delay_columns_reading_0(tmp_path: Path) -> None:
    import duckdb

    from agent.store import _migrate

    path = tmp_path / "v9.duckdb"
    con = duckdb.connect(str(path))
    _migrate(con, MIGRATIONS[:9])
    con.execute(
        "INSERT INTO cache_lookups VALUES (now()::TIMESTAMP, 'e1', 'r-old', 'm1', 'indexer_state', 'device', 'hit', "
        "'none', 64, 64, 64, 0, false, 0.0, 0, 0, 0, 0, now()::TIMESTAMP, 0, NULL, NULL)"
    )
    con.close()
    with Store.open(path) as store:
        assert store.open_report.applied == (10, 11) and store.schema_version == SCHEMA_VERSION == 11
        new = indexer_lookup(minute_start() + 1, "r-new", indexer_sync_delay_tokens=16, indexer_sync_delay_seconds=3.0)
        assert ingest_batch(store, decode_batch(json_body(batch(1, [new]))), received_at=utc_now()).status == "stored"
        with store.cursor() as cur:
            rows = cur.execute(
                "SELECT request_id, indexer_sync_delay_tokens, indexer_sync_delay_seconds FROM cache_lookups ORDER BY request_id"
            ).fetchall()
    assert rows == [("r-new", 16, 3.0), ("r-old", 0, 0.0)]


def run(store: Store, name: str, **params: str) -> list[dict[str, Any]]:
    query = get_query(name)
    with store.cursor() as cur:
        result = cur.execute(query.sql, query.bind(params, now=datetime.now(UTC).replace(tzinfo=None)))
        columns = [d[0] for d in result.description]
        assert columns == list(query.columns)
        return [dict(zip(columns, row, strict=True)) for row in result.fetchall()]


def test_the_named_queries_per_bucket_and_layer_group(tmp_path: Path) -> None:
    m0 = minute_start(-3)
    events = [
        *(indexer_lookup(m0 + 1, f"h{i}", outcome="hit", reason="none") for i in range(8)),
        indexer_lookup(m0 + 2, "t1", indexer_sync_delay_tokens=16, indexer_sync_delay_seconds=4.0),
        indexer_lookup(m0 + 3, "t2", indexer_sync_delay_tokens=32, indexer_sync_delay_seconds=8.0, layer_group=1),
        indexer_lookup(m0 + 61, "h9", outcome="hit", reason="none"),
        lookup_event(m0 + 1, "f1", hash_hit_tokens=64, usable_tokens=64, recoverable_tokens=64),  # another form: not counted
    ]
    with Store.open(tmp_path / "q.duckdb") as store:
        assert ingest_batch(store, decode_batch(json_body(batch(1, events))), received_at=utc_now()).status == "stored"
        rows = run(store, "indexer_sync_delay", since_seconds="3600", bucket_seconds="60", engine_id="e1")
        series = run(store, "indexer_sync_delay_series", since_seconds="3600", threshold_tokens="16")
        everything = run(store, "indexer_sync_delay_series", since_seconds="3600")
    minute = datetime.fromtimestamp(m0, UTC).replace(tzinfo=None)
    first = {(r["bucket"], r["layer_group"]): r for r in rows}
    assert len(rows) == 3 and first[(minute, 0)]["lookups"] == 9 and first[(minute, 0)]["trailing_lookups"] == 1
    assert (first[(minute, 0)]["max_delay_tokens"], first[(minute, 0)]["max_delay_seconds"]) == (16, 4.0)
    assert first[(minute, 0)]["p95_delay_tokens"] == pytest.approx(0.6 * 16)  # 8 zeros and one 16: linear at rank 7.6
    assert (first[(minute, 1)]["max_delay_tokens"], first[(minute, 1)]["p95_delay_seconds"]) == (32, 8.0)
    assert [r["max_delay_tokens"] for r in rows if r["bucket"] != minute] == [0]
    assert series == [{"engine": "e1", "model": "m1", "layer_group": "1", "value": 32}]  # above 16 tokens only
    assert [(r["layer_group"], r["value"]) for r in everything] == [("0", 16), ("1", 32)]
