"""Arrow IPC bodies through the agent (``POST /v1/events`` with
``application/vnd.apache.arrow.stream``): stored once, refused whole with the column and row,
idempotent on (engine_id, seq) with the digest of the events; a flush mixing formats; group
commit; and an engine upgraded with msgpack records still in its spool."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import msgspec
import pyarrow as pa
import pytest
from agent_testdata import (
    arrow_body,
    arrow_tables,
    batch,
    known_events,
    lookup_event,
    request_event,
)
from fastapi.testclient import TestClient

from agent.decode import decode_for_ingest
from agent.ingest import write_flush
from agent.metrics import AgentMetrics
from agent.pipeline import Ingestor
from agent.seq_tracker import SeqTracker
from agent.store import Store, utc_now
from engine.events import EngineStats, EventBatch, Form, Tier, encode_batch
from engine.events_arrow import ARROW_MEDIA_TYPE
from engine.events_arrow_encode import encode_tables
from engine.spool import Spool
from engine.telemetry import TelemetryClient
from tests.agent_process import start_agent
from tests.helpers import free_port

ARROW = {"content-type": ARROW_MEDIA_TYPE}
MSGPACK = {"content-type": "application/msgpack"}


def count(client: TestClient, table: str) -> int:
    response = client.post("/v1/sql", json={"sql": f"SELECT count(*) FROM {table}"})
    assert response.status_code == 200, response.text
    return int(response.json()["rows"][0][0])


def test_an_arrow_batch_is_stored_once_and_read_back_like_json(client: TestClient, base: int) -> None:
    value = batch(11, known_events(base))
    answer = client.post("/v1/events", content=arrow_body(value), headers=ARROW)
    assert answer.status_code == 200 and answer.json()["status"] == "stored", answer.text
    assert (count(client, "cache_lookups"), count(client, "requests"), count(client, "engine_stats"), count(client, "block_events")) == (4, 2, 1, 1)
    rows = client.post("/v1/sql", json={"sql": "SELECT form, reason FROM cache_lookups ORDER BY ts, form"}).json()["rows"]
    assert rows[0] == ["full_kv", "none"] and ["swa_window", "swa_evicted"] in rows
    resent = client.post("/v1/events", content=arrow_body({**value, "sent_at": time.time() + 5}), headers=ARROW)
    assert resent.json()["status"] == "duplicate"  # the digest covers the events, not sent_at
    other = [*known_events(base)[:-1], {**known_events(base)[-1], "num_tokens": 99}]
    conflict = client.post("/v1/events", content=arrow_body({**value, "events": other}), headers=ARROW)
    assert conflict.status_code == 409 and conflict.json()["error"]["path"] == "$.seq"
    assert count(client, "block_events") == 1
    metrics = client.get("/metrics").text
    assert 'kvscope_ingest_events_total{kind="cache_lookup"} 4.0' in metrics
    assert 'kvscope_cache_lookups_total{engine="e1",form="full_kv",model="m1",outcome="hit",tier="device"} 1.0' in metrics


def test_a_refused_arrow_batch_names_column_and_row_and_stores_nothing(client: TestClient, base: int) -> None:
    events = [lookup_event(base + 1, "a"), lookup_event(base + 1, "b", hash_hit_tokens=5, usable_tokens=9)]
    answer = client.post("/v1/events", content=arrow_body(batch(3, events)), headers=ARROW)
    assert answer.status_code == 422
    assert answer.json()["error"] == {
        "reason": "exceeds hash_hit_tokens",
        "path": "$.cache_lookup[1].usable_tokens",
        "column": "usable_tokens",
        "row": 1,
    }
    assert count(client, "cache_lookups") == 0
    filed = client.post("/v1/sql", json={"sql": "SELECT engine_id, seq, status FROM ingest_batches"}).json()["rows"]
    assert filed == [["e1", 3, "rejected"]]  # the audit row, read off the stream's header
    truncated = arrow_body(batch(4, known_events(base)))[:100]
    assert client.post("/v1/events", content=truncated, headers=ARROW).status_code == 422
    assert count(client, "cache_lookups") == 0


def test_the_unsupported_media_type_answer_lists_arrow(client: TestClient) -> None:
    answer = client.post("/v1/events", content=b"x", headers={"content-type": "text/csv"})
    assert answer.status_code == 415 and ARROW_MEDIA_TYPE in answer.json()["error"]["reason"]


def test_one_flush_takes_arrow_and_msgpack_batches_together(store: Store, base: int) -> None:
    tracker = SeqTracker.load(store)
    arrow = decode_for_ingest(arrow_body(batch(0, known_events(base))), "arrow")
    packed = decode_for_ingest(msgspec.msgpack.encode(batch(1, known_events(base))), "msgpack")
    flush = write_flush(store, tracker, [arrow.batch, packed.batch], ingested_at=utc_now())  # type: ignore[union-attr]
    assert [o.status for o in flush.outcomes] == ["stored", "stored"]
    assert flush.tables["cache_lookups"].num_rows == 8
    with store.cursor() as cur:
        forms = cur.execute("SELECT form, count(*) FROM cache_lookups GROUP BY form ORDER BY form").fetchall()
    assert forms == [("full_kv", 4), ("linear_state", 2), ("swa_window", 2)]


def test_a_flush_waits_for_a_batch_being_decoded_and_not_when_none_is(store: Store, base: int) -> None:
    metrics = AgentMetrics()
    ingestor = Ingestor(store, metrics, flush_wait_seconds=2.0)
    try:
        first = decode_for_ingest(arrow_body(batch(0, known_events(base))), "arrow").batch  # type: ignore[union-attr]
        second = decode_for_ingest(arrow_body(batch(1, known_events(base))), "arrow").batch  # type: ignore[union-attr]
        with ingestor.incoming():  # another request is decoding its batch
            future = ingestor.submit(first)
            time.sleep(0.3)
            assert not future.done()  # the flush waits for it ...
            later = ingestor.submit(second)
        assert future.result(timeout=10).status == later.result(timeout=10).status == "stored"
        assert metrics.registry.get_sample_value("kvscope_ingest_flush_batches_count") == 1.0  # ... and takes both
        started = time.monotonic()
        third = decode_for_ingest(arrow_body(batch(2, known_events(base))), "arrow").batch  # type: ignore[union-attr]
        assert ingestor.submit(third).result(timeout=10).status == "stored"
        assert time.monotonic() - started < 1.5  # nothing on its way: no wait
    finally:
        ingestor.close()


def stats(engine: str, i: int) -> EngineStats:
    return EngineStats(
        ts=1_700_000_000.0 + i, engine_id=engine, model="m", form=Form.FULL_KV, tier=Tier.DEVICE,
        used_bytes=i, used_blocks=0, cached_blocks=0, free_blocks=0, total_blocks=1,
    )  # fmt: skip


def test_msgpack_records_left_in_a_spool_by_an_older_engine_are_sent_after_the_upgrade(tmp_path: Path) -> None:
    engine, spool_path = "e-upgrade", tmp_path / "e.spool"
    old = Spool(spool_path, 1 << 20)  # what an older engine left: two msgpack batches, seqs 0 and 1
    for seq in (0, 1):
        events = [stats(engine, seq * 10 + i) for i in range(10)]
        old.append(encode_batch(EventBatch(schema_version=1, engine_id=engine, seq=seq, sent_at=1.0, events=list(events)), "msgpack"), 10)
    old.save_next_seq(2)
    old.close()
    port = free_port()
    agent = start_agent(port, tmp_path / "data")
    try:
        client = TelemetryClient(f"http://127.0.0.1:{port}", engine, batch_max_seconds=0.05, spool_path=spool_path)
        assert client.wire_format == "arrow"
        for i in range(20, 30):
            client.emit(stats(engine, i))
        assert client.flush(timeout_seconds=30)
        client.close(timeout_seconds=30)
        with httpx_client(port) as http:
            rows = http.post("/v1/sql", json={"sql": "SELECT used_bytes FROM engine_stats ORDER BY used_bytes"}).json()["rows"]
            seqs = http.post("/v1/sql", json={"sql": "SELECT seq FROM ingest_batches WHERE status = 'stored' ORDER BY seq"}).json()["rows"]
        assert [r[0] for r in rows] == list(range(30))  # the old records and the new batch, each once
        assert [s[0] for s in seqs] == [0, 1, 2]
    finally:
        agent.terminate()
        agent.wait(timeout=30)


def httpx_client(port: int):  # type: ignore[no-untyped-def]
    import httpx

    return httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)


def test_concurrent_arrow_resends_store_once(client: TestClient, base: int) -> None:
    body = arrow_body(batch(21, known_events(base)))
    statuses: list[str] = []

    def post() -> None:
        statuses.append(client.post("/v1/events", content=body, headers=ARROW).json()["status"])

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses) == ["duplicate", "duplicate", "duplicate", "stored"]
    assert count(client, "cache_lookups") == 4


@pytest.mark.parametrize(
    ("kind", "table", "nulls_sql", "nulls"),
    [
        ("cache_lookup", "cache_lookups", "ghost_bytes IS NULL AND spare_bytes IS NULL", 4),
        ("request", "requests", "limiting_form IS NULL", 1),
    ],
)
def test_an_arrow_batch_of_one_kind_keeps_its_nulls(client: TestClient, base: int, kind: str, table: str, nulls_sql: str, nulls: int) -> None:
    events = [e for e in known_events(base) if e["kind"] == kind]
    if kind == "request":  # and one request that names no limiting form
        events.append(request_event(base + 9, "r-none"))
    body = encode_tables(arrow_tables(events), engine_id="e1", seq=31, sent_at=time.time())
    assert client.post("/v1/events", content=body, headers=ARROW).json()["status"] == "stored"
    assert count(client, table) == len(events)
    answer = client.post("/v1/sql", json={"sql": f"SELECT count(*) FROM {table} WHERE {nulls_sql}"}).json()
    assert answer["rows"][0][0] == nulls


def test_a_flush_summary_equals_the_sum_of_its_batches_summaries(base: int) -> None:
    """One grouped aggregation over a whole flush gives what summing per-batch summaries gave."""
    from agent.batch_summary import summarize_tables
    from tests.engine.test_events_arrow import rich_events

    first = decode_for_ingest(arrow_body(batch(0, known_events(base))), "arrow").batch  # type: ignore[union-attr]
    second = decode_for_ingest(msgspec.msgpack.encode(batch(1, rich_events())), "msgpack").batch  # type: ignore[union-attr]
    both = {name: pa.concat_tables([t for t in (first.tables.get(name), second.tables.get(name)) if t is not None]) for name in second.tables}
    whole, parts = summarize_tables(both), [summarize_tables(first.tables), summarize_tables(second.tables)]

    def folded(rows: list, width: int) -> dict:  # type: ignore[type-arg]
        out: dict = {}  # type: ignore[type-arg]
        for labels, *values in rows:
            flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
            acc = out.setdefault(labels, [0.0] * len(flat))
            out[labels] = [round(a + v, 9) for a, v in zip(acc, flat, strict=True)]
        return out

    for name in ("lookups", "invalidations", "disagreements", "recovery", "requests", "ttft", "sync_delay_tokens", "sync_delay_seconds"):
        combined = [row for part in parts for row in getattr(part, name)]
        assert folded(getattr(whole, name), 0) == folded(combined, 0), name
    assert sorted(whole.ts_micros.tolist()) == sorted(parts[0].ts_micros.tolist() + parts[1].ts_micros.tolist())
    assert whole.lookups and whole.recovery and whole.sync_delay_tokens  # the rich events reach every family


def test_a_flush_of_mixed_formats_counts_every_event_in_the_metrics(store: Store, base: int) -> None:
    metrics = AgentMetrics()
    ingestor = Ingestor(store, metrics, flush_wait_seconds=2.0)
    try:
        arrow = decode_for_ingest(arrow_body(batch(0, known_events(base))), "arrow").batch  # type: ignore[union-attr]
        packed = decode_for_ingest(msgspec.msgpack.encode(batch(1, known_events(base))), "msgpack").batch  # type: ignore[union-attr]
        with ingestor.incoming():
            futures = [ingestor.submit(arrow), ingestor.submit(packed)]
        assert [f.result(timeout=10).status for f in futures] == ["stored", "stored"]
        assert metrics.registry.get_sample_value("kvscope_ingest_flush_batches_count") == 1.0  # one flush
        labels = {"engine": "e1", "model": "m1", "form": "full_kv", "tier": "device", "outcome": "hit"}
        assert metrics.registry.get_sample_value("kvscope_cache_lookups_total", labels) == 2.0
        assert metrics.registry.get_sample_value("kvscope_requests_total", {"engine": "e1", "model": "m1"}) == 4.0
    finally:
        ingestor.close()
