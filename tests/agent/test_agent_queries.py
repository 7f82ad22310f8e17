"""GET /v1/query/{name}: exact numbers for the known batch, parameter errors, unknown names."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa
import pytest
from agent_testdata import batch, json_body, lookup_event, request_event
from fastapi.testclient import TestClient

from agent.queries import NAMED_QUERIES
from agent.rollups import fold_form_usable_minute
from agent.store import Store

JSON = {"content-type": "application/json"}


def rows(client: TestClient, name: str, **params: object) -> list[dict[str, object]]:
    response = client.get(f"/v1/query/{name}", params=params)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["columns"] == list(NAMED_QUERIES[name].columns)
    return [dict(zip(body["columns"], row, strict=True)) for row in body["rows"]]


def iso(unix_seconds: int) -> str:
    return datetime.fromtimestamp(unix_seconds, UTC).replace(tzinfo=None).isoformat()


def test_totals(loaded: TestClient) -> None:
    expected = {
        "requests": 2,
        "prompt_tokens": 4000,
        "hash_hit_tokens": 3800,
        "recoverable_tokens": 3000,
        "replayed_tokens": 200,
        "recomputed_tokens": 800,
    }
    assert rows(loaded, "totals") == [expected]
    assert rows(loaded, "totals", engine_id="e1") == [expected]
    assert rows(loaded, "totals", engine_id="nope") == [dict.fromkeys(expected, 0)]


def test_totals_empty_store_is_zero_not_null(client: TestClient) -> None:
    assert rows(client, "totals") == [
        {
            "requests": 0,
            "prompt_tokens": 0,
            "hash_hit_tokens": 0,
            "recoverable_tokens": 0,
            "replayed_tokens": 0,
            "recomputed_tokens": 0,
        }
    ]


def test_form_outcomes(loaded: TestClient) -> None:
    assert rows(loaded, "form_outcomes") == [
        {"form": "full_kv", "outcome": "hit", "reason": "none", "lookups": 1, "usable_tokens": 800, "recoverable_tokens": 600},
        {"form": "full_kv", "outcome": "recovered", "reason": "kv_evicted", "lookups": 1, "usable_tokens": 3000, "recoverable_tokens": 2400},
        {"form": "linear_state", "outcome": "replayed", "reason": "linear_checkpoint_missing", "lookups": 1, "usable_tokens": 2400, "recoverable_tokens": 2400},
        {"form": "swa_window", "outcome": "invalidated", "reason": "swa_evicted", "lookups": 1, "usable_tokens": 600, "recoverable_tokens": 600},
    ]  # fmt: skip
    assert rows(loaded, "form_outcomes", engine_id="e2") == []


def test_hit_rate_timeseries(loaded: TestClient, base: int) -> None:
    # A request from two hours ago is outside the default one-hour window.
    old = json_body(
        batch(2, [request_event(base - 7200, "old", prompt_tokens=500, recomputed_tokens=500)])
    )
    assert loaded.post("/v1/events", content=old, headers=JSON).status_code == 200
    assert rows(loaded, "hit_rate_timeseries") == [
        {
            "bucket": iso(base),
            "requests": 2,
            "prompt_tokens": 4000,
            "hash_hit_tokens": 3800,
            "recoverable_tokens": 3000,
            "replayed_tokens": 200,
            "recomputed_tokens": 800,
            "raw_hit_rate": 0.95,
            "recoverable_hit_rate": 0.75,
        }
    ]
    # 2-second buckets split the two requests (ts base+2 and base+4).
    split = rows(loaded, "hit_rate_timeseries", bucket_seconds=2, since_seconds=3600)
    assert [(r["bucket"], r["prompt_tokens"], r["recoverable_hit_rate"]) for r in split] == [
        (iso(base + 2), 1000, 0.6),
        (iso(base + 4), 3000, 0.8),
    ]
    with_old = rows(loaded, "hit_rate_timeseries", since_seconds=3 * 3600, bucket_seconds=3600)
    assert [r["prompt_tokens"] for r in with_old] == [500, 4000]
    assert with_old[0]["recoverable_hit_rate"] == 0.0
    assert rows(loaded, "hit_rate_timeseries", model="other") == []


def test_form_usable_timeseries_raw_and_rolled_up_agree(loaded: TestClient, store: Store, base: int) -> None:
    expected = [
        {"bucket": iso(base), "form": "full_kv", "usable_tokens": 3800, "prompt_tokens": 4000, "usable_rate": 0.95},
        {"bucket": iso(base), "form": "linear_state", "usable_tokens": 2400, "prompt_tokens": 3000, "usable_rate": 0.8},
        {"bucket": iso(base), "form": "swa_window", "usable_tokens": 600, "prompt_tokens": 1000, "usable_rate": 0.6},
    ]  # fmt: skip
    # 30 s buckets: from the raw tables at once (both requests are in the minute's first 30 s)
    assert rows(loaded, "form_usable_timeseries", engine_id="e1", model="m1", bucket_seconds=30) == expected
    # whole minutes: from the rollup, once folded
    assert rows(loaded, "form_usable_timeseries", engine_id="e1", model="m1") == []
    assert fold_form_usable_minute(store) == 6  # 2 requests, 4 lookups
    assert rows(loaded, "form_usable_timeseries", engine_id="e1", model="m1") == expected
    assert fold_form_usable_minute(store) == 0  # nothing new: nothing counted twice
    two_minutes = [{**r, "bucket": iso(base - base % 120)} for r in expected]
    assert rows(loaded, "form_usable_timeseries", bucket_seconds=120) == two_minutes
    assert rows(loaded, "form_usable_timeseries", model="other") == []

    late = [
        # a late lookup of r1 lowers its swa_window minimum (600 -> 100)
        lookup_event(base + 1, "r1", form="swa_window", outcome="invalidated", reason="swa_evicted", hash_hit_tokens=800, usable_tokens=100, layer_group=2),
        # r1's first linear_state lookup arrives after r1 was folded: r1 now counts for that form
        lookup_event(base + 1, "r1", form="linear_state", hash_hit_tokens=800, usable_tokens=500),
        # r3's lookups in this batch, its request event in the next one
        lookup_event(base + 70, "r3", hash_hit_tokens=40, usable_tokens=40),
        lookup_event(base + 70, "r3", hash_hit_tokens=40, usable_tokens=30, tp_rank=1),
    ]  # fmt: skip
    post(loaded, batch(3, late))
    assert fold_form_usable_minute(store) == 4
    post(loaded, batch(4, [request_event(base + 71, "r3", prompt_tokens=100, recomputed_tokens=100)]))
    assert fold_form_usable_minute(store) == 1
    expected = [
        {"bucket": iso(base), "form": "full_kv", "usable_tokens": 3800, "prompt_tokens": 4000, "usable_rate": 0.95},
        {"bucket": iso(base), "form": "linear_state", "usable_tokens": 2900, "prompt_tokens": 4000, "usable_rate": 0.725},
        {"bucket": iso(base), "form": "swa_window", "usable_tokens": 100, "prompt_tokens": 1000, "usable_rate": 0.1},
        {"bucket": iso(base + 60), "form": "full_kv", "usable_tokens": 30, "prompt_tokens": 100, "usable_rate": 0.3},
    ]  # fmt: skip
    assert rows(loaded, "form_usable_timeseries", since_seconds=7200) == expected
    raw = rows(loaded, "form_usable_timeseries", since_seconds=7200, bucket_seconds=30)
    assert [{**r, "bucket": iso(base + 60 * (r["bucket"] > iso(base + 59)))} for r in raw] == expected


def post(client: TestClient, body: dict[str, object]) -> None:
    response = client.post("/v1/events", content=json_body(body), headers=JSON)
    assert response.status_code == 200, response.text


def test_recent_requests_and_arrow_format(loaded: TestClient) -> None:
    latest = rows(loaded, "recent_requests", limit=1)
    assert [(r["request_id"], r["admission"], r["limiting_form"]) for r in latest] == [
        ("r2", "tail_replay", "linear_state")
    ]
    response = loaded.get("/v1/query/recent_requests", params={"format": "arrow"})
    table = pa.ipc.open_stream(response.content).read_all()
    assert table.column("request_id").to_pylist() == ["r2", "r1"]
    assert table.schema.field("ts").type == pa.timestamp("us")


def test_alerts_recent_empty(loaded: TestClient) -> None:
    assert rows(loaded, "alerts_recent") == []


def test_request_lookups_takes_each_forms_minimum(loaded: TestClient) -> None:
    forms = rows(loaded, "request_lookups", request_id="r2")
    assert [(f["form"], f["outcome"], f["tier"], f["usable_tokens"], f["replayed_tokens"], f["approximate"], f["recovery_seconds"]) for f in forms] == [
        ("linear_state", "replayed", "device", 2400, 200, True, 0.0),  # the shortest first: it set L*
        ("full_kv", "recovered", "host", 3000, 0, False, 0.25),
    ]
    assert rows(loaded, "request_lookups", request_id="r2", engine_id="other") == []
    assert rows(loaded, "request_lookups", request_id="nope") == []


def test_form_timeseries_and_limiting_forms(loaded: TestClient, store: Store) -> None:
    from agent.rollups import fold_cache_minute

    fold_cache_minute(store)
    rows_ = rows(loaded, "form_timeseries", since_seconds=366 * 86400, bucket_seconds=86400, form="full_kv")
    assert [(r["tier"], r["outcome"], r["lookups"], r["recovery_le_0_25"], r["recovery_le_0_1"]) for r in rows_] == [
        ("device", "hit", 1, 0, 0),
        ("host", "recovered", 1, 1, 0),  # r2's swap-in took 0.25 s
    ]
    limiting = rows(loaded, "limiting_forms", since_seconds=366 * 86400, bucket_seconds=86400)
    assert sorted((r["limiting_form"], r["requests"]) for r in limiting) == [("linear_state", 1), ("swa_window", 1)]


def test_ingest_health(loaded: TestClient) -> None:
    health = rows(loaded, "ingest_health", since_seconds=366 * 86400, bucket_seconds=86400)
    assert [(r["stored_batches"], r["rejected_batches"], r["events"], r["missing_batches"]) for r in health] == [(1, 0, 8, 1)]
    assert health[0]["lag_p95_seconds"] is not None and health[0]["lag_p95_seconds"] > 0


def test_engines(loaded: TestClient) -> None:
    seen = rows(loaded, "engines", since_seconds=366 * 86400)
    assert [(r["engine_id"], r["model"], r["requests"]) for r in seen] == [("e1", "m1", 2)]  # r1, r2
    assert rows(loaded, "engines", since_seconds=1) == []  # nothing in the last second


@pytest.mark.parametrize(
    ("params", "param", "reason"),
    [
        ({"since_seconds": "abc"}, "since_seconds", "must be int, got 'abc'"),
        ({"bucket_seconds": "0"}, "bucket_seconds", "must be >= 1, got 0"),
        ({"bucket_seconds": "1.5"}, "bucket_seconds", "must be int"),
        ({"colour": "red"}, "colour", "unknown parameter of query hit_rate_timeseries"),
        ({"format": "xml"}, "format", "format must be one of json, csv, arrow"),
    ],
)
def test_bad_params_are_400_naming_the_param(
    loaded: TestClient, params: dict[str, str], param: str, reason: str
) -> None:
    response = loaded.get("/v1/query/hit_rate_timeseries", params=params)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert reason in error["reason"]


def test_unknown_query_is_404_listing_known(loaded: TestClient) -> None:
    response = loaded.get("/v1/query/everything")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["known"] == sorted(NAMED_QUERIES)
    assert error["reason"].startswith("unknown query 'everything'; known queries: alerts_recent, ")


def test_headline_sums_the_trailing_window_and_the_one_before(client: TestClient) -> None:
    import time

    now = time.time()
    events = [
        request_event(now - 30, "a", prompt_tokens=1000, hash_hit_tokens=900, recoverable_tokens=600, recomputed_tokens=400),
        request_event(now - 200, "b", prompt_tokens=3000, hash_hit_tokens=3000, recoverable_tokens=3000, recomputed_tokens=0),
        request_event(now - 400, "c", prompt_tokens=2000, hash_hit_tokens=2000, recoverable_tokens=500, recomputed_tokens=1500),
        request_event(now - 700, "d", prompt_tokens=5000, hash_hit_tokens=5000, recoverable_tokens=5000, recomputed_tokens=0),  # before both
    ]
    assert client.post("/v1/events", content=json_body(batch(1, events)), headers=JSON).json()["status"] == "stored"
    assert rows(client, "headline", window_seconds=300) == [{
        "requests": 2, "prompt_tokens": 4000, "hash_hit_tokens": 3900, "recoverable_tokens": 3600,
        "previous_requests": 1, "previous_prompt_tokens": 2000, "previous_hash_hit_tokens": 2000, "previous_recoverable_tokens": 500,
    }]  # fmt: skip
    assert rows(client, "headline", window_seconds=60)[0]["prompt_tokens"] == 1000
