"""Issue 6, the store side: group-commit pipeline (full policy), seq gaps and seq reuse,
``cache_minute`` rollups (exact merges, late events, restarts), hourly Parquet export and
retention, the maintenance jobs."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import duckdb
import msgspec
import pyarrow.parquet as pq
import pytest
from agent_testdata import batch, json_body, known_events, lookup_event, minute_start
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from agent.config import AgentConfig
from agent.ingest import ingest_batch, prepare_batch
from agent.maintenance import MaintenanceScheduler, apply_retention, export_parquet
from agent.metrics import AgentMetrics
from agent.migrations import bucket_column
from agent.pipeline import Ingestor, QueueFull
from agent.rollups import fold_cache_minute, fold_form_usable_minute
from agent.seq_tracker import SeqRanges, SeqTracker
from agent.store import Store, to_timestamp, utc_now
from engine.events import decode_batch

JSON = {"content-type": "application/json"}


def gauge(client: TestClient, name: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return sample.value
    raise AssertionError(f"{name} not exported")


def sql(client: TestClient, query: str) -> list[list[Any]]:
    response = client.post("/v1/sql", json={"sql": query})
    assert response.status_code == 200, response.text
    rows: list[list[Any]] = response.json()["rows"]
    return rows


def store_batch(store: Store, seq: int, events: list[dict[str, Any]], engine_id: str = "e1") -> str:
    return ingest_batch(store, decode_batch(json_body(batch(seq, events, engine_id))), received_at=utc_now()).status


# -- seqs -----------------------------------------------------------------------------------------
def test_seq_ranges_count_members_and_holes() -> None:
    ranges = SeqRanges()
    for seq in (0, 1, 2, 5, 4, 9):
        ranges.add(seq)
    assert (ranges.max, ranges.count, ranges.missing) == (9, 6, 4)  # 3, 6, 7, 8 never came
    assert 4 in ranges and 3 not in ranges
    ranges.add(3)
    ranges.add(3)
    assert (ranges.count, ranges.missing) == (7, 3)
    with pytest.raises(ValueError, match="not above"):
        ranges.add_range(8, 12)


def test_gaps_are_recorded_exported_and_filled(client: TestClient, base: int) -> None:
    events = known_events(base)
    assert client.post("/v1/events", content=json_body(batch(0, events)), headers=JSON).status_code == 200
    assert client.post("/v1/events", content=json_body(batch(3, events)), headers=JSON).status_code == 200
    assert sql(client, "SELECT engine_id, first_missing, last_missing FROM ingest_gaps") == [["e1", 1, 2]]
    assert gauge(client, "kvscope_ingest_missing_batches") == 2.0
    assert gauge(client, "kvscope_ingest_seq_gaps_total") == 1.0
    gaps = client.get("/v1/query/ingest_seq_gaps").json()["rows"]
    assert gaps == [["e1", 3, 2, 2]]
    # seq 1 arrives late (a spool replay); seq 2 was rejected: received, so not missing
    assert client.post("/v1/events", content=json_body(batch(1, events)), headers=JSON).status_code == 200
    bad = batch(2, [lookup_event(base, "r9", usable_tokens=5)])  # usable > hash_hit
    assert client.post("/v1/events", content=json_body(bad), headers=JSON).status_code == 422
    assert gauge(client, "kvscope_ingest_missing_batches") == 0.0
    assert client.get("/v1/query/ingest_seq_gaps").json()["rows"] == [["e1", 3, 4, 0]]
    assert gauge(client, "kvscope_ingest_seq_gaps_total") == 1.0  # a late fill is not a new gap


def test_seq_reused_with_other_events_is_409_and_stores_nothing(client: TestClient, base: int) -> None:
    first = json_body(batch(0, known_events(base)))
    assert client.post("/v1/events", content=first, headers=JSON).json()["status"] == "stored"
    other = json_body(batch(0, [lookup_event(base, "other")]))
    response = client.post("/v1/events", content=other, headers=JSON)
    assert response.status_code == 409, response.text
    assert response.json()["error"]["path"] == "$.seq"
    assert "already stored with other events" in response.json()["error"]["reason"]
    assert sql(client, "SELECT count(*) FROM cache_lookups") == [[4]]
    assert sql(client, "SELECT status, rows FROM ingest_batches ORDER BY received_at") == [
        ["stored", 8],
        ["rejected", 0],
    ]
    # the same events re-sent (new sent_at, JSON key order irrelevant) are a duplicate
    again = json_body(batch(0, known_events(base)))
    assert client.post("/v1/events", content=again, headers=JSON).json()["status"] == "duplicate"
    counts = {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(client.get("/metrics").text)
        for s in f.samples
        if s.name == "kvscope_ingest_rejected_batches_total"
    }
    assert counts == {"seq_conflict": 1.0}


def test_tracker_reloads_from_the_store(store: Store, base: int) -> None:
    for seq in (0, 1, 2, 6):
        assert store_batch(store, seq, known_events(base)) == "stored"
    tracker = SeqTracker.load(store)
    assert tracker.missing() == {"e1": 3}
    assert tracker.is_stored("e1", 6) and not tracker.is_stored("e1", 3)
    assert store_batch(store, 6, known_events(base)) == "duplicate"


# -- the pipeline's full policy -------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["reject", "block"])
def test_full_queue_refuses_then_drains(store: Store, base: int, policy: str) -> None:
    ingestor = Ingestor(
        store,
        AgentMetrics(),
        max_queue_events=10,
        full_policy=policy,  # type: ignore[arg-type]
        block_timeout_seconds=0.3,
    )
    prepared = [prepare_batch(decode_batch(json_body(batch(seq, known_events(base))))) for seq in range(3)]
    try:
        with store.transaction():  # the flusher blocks on the writer lock meanwhile
            first = ingestor.submit(prepared[0])
            deadline = time.monotonic() + 10
            while ingestor.depth_events != 8 or ingestor._queue:
                assert time.monotonic() < deadline, "the flusher did not take the first batch"
                time.sleep(0.01)
            second = ingestor.submit(prepared[1])  # 8 queued events fit under 10
            started = time.monotonic()
            with pytest.raises(QueueFull, match="ingest queue full"):
                ingestor.submit(prepared[2])  # 8 + 8 > 10
            waited = time.monotonic() - started
            assert ingestor.depth_events == 16
            assert (waited >= 0.3) if policy == "block" else (waited < 0.3)
        assert first.result(10).status == "stored" and second.result(10).status == "stored"
        assert ingestor.submit(prepared[2]).result(10).status == "stored"
    finally:
        ingestor.close()
    with store.cursor() as cur:
        assert cur.execute("SELECT count(*) FROM requests").fetchall() == [(6,)]


def test_a_failing_batch_does_not_fail_its_group(store: Store, base: int) -> None:
    """One flush holds several batches; when the group's transaction fails, each batch is retried
    alone, so only the batch that cannot be written fails."""
    ingestor = Ingestor(store, AgentMetrics())
    good = prepare_batch(decode_batch(json_body(batch(0, known_events(base)))))
    bad = prepare_batch(decode_batch(json_body(batch(1, known_events(base)))))
    object.__setattr__(bad, "tables", {**bad.tables, "requests": bad.tables["requests"].drop_columns(["model"])})
    try:
        with store.transaction():
            futures = [ingestor.submit(good), ingestor.submit(bad)]
        assert futures[0].result(10).status == "stored"
        with pytest.raises(duckdb.Error, match="model"):
            futures[1].result(10)
        assert store_batch(store, 2, known_events(base)) == "stored"
    finally:
        ingestor.close()


# -- cache_minute ---------------------------------------------------------------------------------
def raw_minutes(store: Store) -> list[tuple[Any, ...]]:
    with store.cursor() as cur:
        return cur.execute(
            """
            SELECT date_trunc('minute', ts), engine_id, model, form, tier, outcome, reason,
                   count(*), count(*) FILTER (WHERE approximate), sum(hash_hit_tokens),
                   sum(usable_tokens), sum(recoverable_tokens), sum(replayed_tokens),
                   sum(bytes_moved), sum(recovery_seconds),
                   count(*) FILTER (WHERE outcome IN ('recovered', 'replayed') AND recovery_seconds <= 0.1),
                   count(*) FILTER (WHERE outcome IN ('recovered', 'replayed') AND recovery_seconds <= 0.25)
            FROM cache_lookups GROUP BY ALL ORDER BY ALL
            """
        ).fetchall()


def rolled_minutes(store: Store) -> list[tuple[Any, ...]]:
    with store.cursor() as cur:
        return cur.execute(
            f"""
            SELECT minute, engine_id, model, form, tier, outcome, reason, lookups,
                   approximate_lookups, hash_hit_tokens, usable_tokens, recoverable_tokens,
                   replayed_tokens, bytes_moved, recovery_seconds_sum,
                   {bucket_column(0.1)}, {bucket_column(0.25)}
            FROM cache_minute ORDER BY ALL
            """
        ).fetchall()


def test_cache_minute_equals_raw_rows_with_late_events_and_restarts(tmp_path: Path, base: int) -> None:
    path = tmp_path / "kvscope.duckdb"
    with Store.open(path) as store:
        assert fold_cache_minute(store) == 0
        store_batch(store, 0, known_events(base))
        assert fold_cache_minute(store) == 4
        assert rolled_minutes(store) == raw_minutes(store)
        # the host swap-in took 0.25 s: in le 0.25, not in le 0.1
        host = [r for r in rolled_minutes(store) if r[4] == "host"]
        assert [(r[7], r[15], r[16]) for r in host] == [(1, 0, 1)]
        # a second batch with the same minute and a late one ten minutes back
        late = [lookup_event(base - 600, "late", tier="host", recovery_seconds=0.05, outcome="recovered", reason="kv_evicted", hash_hit_tokens=64, usable_tokens=64, recoverable_tokens=64)]
        store_batch(store, 1, known_events(base) + late)
        assert fold_cache_minute(store) == 5
        assert fold_cache_minute(store) == 0  # folded exactly once
    with Store.open(path) as store:  # the watermark survives a restart
        assert fold_cache_minute(store) == 0
        rolled = rolled_minutes(store)
        assert rolled == raw_minutes(store)
        assert sum(r[7] for r in rolled) == 9
        assert [r[0] for r in rolled if r[3] == "full_kv" and r[4] == "host" and r[15] == 1] == [to_timestamp(base - 600)]


def test_rollup_windows_merge_exactly_through_the_named_query(loaded: TestClient, store: Store, base: int) -> None:
    fold_cache_minute(store)
    rows = loaded.get("/v1/query/form_window?since_seconds=86400").json()["rows"]
    # only lookups that recovered or replayed state count as recoveries (the host swap-in took
    # 0.25 s; the replayed linear state 0 s), as in kvscope_recovery_seconds
    assert rows == [
        ["full_kv", "device", 1, 800, 600, 0.75, 0],
        ["full_kv", "host", 1, 3000, 2400, 0.8, 0],
        ["linear_state", "device", 1, 3000, 2400, 0.8, 1],
        ["swa_window", "device", 1, 800, 600, 0.75, 0],
    ]


# -- export and retention --------------------------------------------------------------------------
def archived(export_dir: Path, table: str = "cache_lookups") -> list[tuple[Any, ...]]:
    """(form, request_id) of every archived row, through DuckDB's Hive-partitioned reader."""
    glob = str(export_dir / table / "**" / "*.parquet")
    return duckdb.connect().execute(
        f"SELECT form, request_id FROM read_parquet('{glob}', hive_partitioning = true) ORDER BY ALL"
    ).fetchall()


def test_hourly_parquet_export_by_date_and_form_late_parts_and_retention(store: Store, tmp_path: Path) -> None:
    hour = (int(time.time()) // 3600 - 3) * 3600  # three hours ago, on the hour
    store_batch(store, 0, known_events(hour + 10) + known_events(hour + 3600 + 10))
    export_dir = tmp_path / "export"
    now = hour + 2 * 3600 + 120  # both hours finished more than a minute ago
    done = export_parquet(store, export_dir, now=now, lag_seconds=60)
    assert sorted((d.table, d.hour, d.part, d.rows) for d in done) == sorted(
        (table, to_timestamp(h), 0, n)
        for h in (hour, hour + 3600)
        for table, n in (("cache_lookups", 4), ("requests", 2), ("engine_stats", 1), ("block_events", 1))
    )
    stamp = to_timestamp(hour)
    folder = export_dir / "cache_lookups" / f"date={stamp:%Y-%m-%d}"
    name = f"cache_lookups-{stamp:%Y%m%dT%H}-0.parquet"
    forms = sorted(p.name for p in folder.iterdir() if (p / name).exists())
    assert forms == ["form=full_kv", "form=linear_state", "form=swa_window"]
    full_kv = pq.read_table(folder / "form=full_kv" / name)
    assert full_kv.num_rows == 2 and "form" not in full_kv.column_names
    assert (export_dir / "requests" / f"date={stamp:%Y-%m-%d}" / f"requests-{stamp:%Y%m%dT%H}-0.parquet").exists()
    assert [row[0] for row in archived(export_dir)] == ["full_kv"] * 4 + ["linear_state"] * 2 + ["swa_window"] * 2
    # nothing new: nothing written; a late event adds a part to its hour, never rewrites one
    assert export_parquet(store, export_dir, now=now, lag_seconds=60) == []
    store_batch(store, 1, [lookup_event(hour + 20, "late", form="linear_state", outcome="miss", reason="no_prefix_match")])
    again = export_parquet(store, export_dir, now=now, lag_seconds=60)
    assert [(d.table, d.hour, d.part, d.rows) for d in again] == [("cache_lookups", stamp, 1, 1)]
    assert (folder / "form=linear_state" / f"cache_lookups-{stamp:%Y%m%dT%H}-1.parquet").exists()
    assert len(archived(export_dir)) == 9
    # the unfinished current hour is never exported
    assert all(d.hour < to_timestamp(now - 60) for d in done + again)
    # retention keeps an hour at now (cutoff aligned down to the hour): the first hour goes —
    # but its lookups only once both rollups folded them, its requests once form_usable_minute did
    deleted = apply_retention(store, now=now, raw_retention_hours=1.0, rollup_retention_days=None)
    assert deleted == {"cache_lookups": 0, "requests": 0, "engine_stats": 1, "block_events": 1, "gpu_stats": 0}
    assert fold_cache_minute(store) == 9
    deleted = apply_retention(store, now=now, raw_retention_hours=1.0, rollup_retention_days=None)
    assert (deleted["cache_lookups"], deleted["requests"]) == (0, 0)
    assert fold_form_usable_minute(store) == 13  # every lookup (11) and request (2) stored so far
    deleted = apply_retention(store, now=now, raw_retention_hours=1.0, rollup_retention_days=None)
    assert (deleted["cache_lookups"], deleted["requests"]) == (5, 2)
    with store.cursor() as cur:
        assert cur.execute("SELECT count(*) FROM cache_lookups").fetchall() == [(4,)]
        assert cur.execute("SELECT sum(lookups) FROM cache_minute").fetchall() == [(9,)]
    # a late event for the deleted hour: a new part; the archived rows stay (review finding)
    store_batch(store, 2, [lookup_event(hour + 30, "later", outcome="miss", reason="no_prefix_match")])
    third = export_parquet(store, export_dir, now=now, lag_seconds=60)
    assert [(d.table, d.part, d.rows) for d in third] == [("cache_lookups", 2, 1)]
    assert len(archived(export_dir)) == 10 and ("full_kv", "later") in archived(export_dir)


def test_retention_deletes_only_exported_rows(store: Store, tmp_path: Path) -> None:
    """Rows stored after the export read (or never exported: retention shorter than the export
    lag) stay until an export took them (review findings 2 and 3)."""
    hour = (int(time.time()) // 3600 - 3) * 3600
    store_batch(store, 0, known_events(hour + 10))
    export_dir = tmp_path / "export"
    now = hour + 3 * 3600
    # retention before any export: nothing exported, nothing deleted
    fold_cache_minute(store)
    fold_form_usable_minute(store)
    assert sum(apply_retention(store, now=now, raw_retention_hours=1.0, rollup_retention_days=None).values()) == 0
    export_parquet(store, export_dir, now=now, lag_seconds=60)
    store_batch(store, 1, [lookup_event(hour + 40, "after-export", outcome="miss", reason="no_prefix_match")])
    fold_cache_minute(store)
    fold_form_usable_minute(store)
    deleted = apply_retention(store, now=now, raw_retention_hours=1.0, rollup_retention_days=None)
    assert deleted["cache_lookups"] == 4
    with store.cursor() as cur:
        assert cur.execute("SELECT request_id FROM cache_lookups").fetchall() == [("after-export",)]
    export_parquet(store, export_dir, now=now, lag_seconds=60)
    assert apply_retention(store, now=now, raw_retention_hours=1.0, rollup_retention_days=None)["cache_lookups"] == 1
    assert ("full_kv", "after-export") in archived(export_dir)
    # with export disabled, retention does not wait for it
    store_batch(store, 2, known_events(hour + 50))
    fold_cache_minute(store)
    fold_form_usable_minute(store)
    deleted = apply_retention(store, now=now, raw_retention_hours=1.0, rollup_retention_days=None, exported_only=False)
    assert deleted["requests"] == 2


def test_export_failure_skips_retention_and_is_counted(store: Store, tmp_path: Path) -> None:
    hour = (int(time.time()) // 3600 - 3) * 3600
    store_batch(store, 0, known_events(hour + 10))
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    config = AgentConfig(data_dir=tmp_path, export_dir=blocker, raw_retention_hours=1.0, gpu_sample_seconds=None)
    metrics = AgentMetrics()
    jobs = MaintenanceScheduler(store, config, metrics, clock=lambda: hour + 3 * 3600)
    jobs.rollup()  # folded: only the failed export keeps the rows
    jobs._counted("export", jobs.export_and_retain)()
    with store.cursor() as cur:
        assert cur.execute("SELECT count(*) FROM requests").fetchall() == [(2,)]  # not deleted
    samples = {
        (s.labels["job"], s.labels["status"]): s.value
        for f in text_string_to_metric_families(metrics.exposition().decode())
        for s in f.samples
        if s.name == "kvscope_maintenance_runs_total"
    }
    assert samples == {("export", "error"): 1.0}
    # with a writable directory the same job exports, then deletes
    ok = MaintenanceScheduler(store, AgentConfig(data_dir=tmp_path, raw_retention_hours=1.0, gpu_sample_seconds=None), AgentMetrics(), clock=lambda: hour + 3 * 3600)
    exported, deleted = ok.export_and_retain()
    assert {d.table for d in exported} == {"cache_lookups", "requests", "engine_stats", "block_events"}
    assert deleted["requests"] == 2


def test_scheduler_runs_rollup_and_checkpoint_jobs(tmp_path: Path, base: int) -> None:
    config = AgentConfig(
        data_dir=tmp_path,
        rollup_interval_seconds=0.2,
        checkpoint_interval_seconds=0.2,
        maintenance_interval_seconds=0.2,
        gpu_sample_seconds=None,
    )
    with Store.open(config.db_path) as store:
        store_batch(store, 0, known_events(base))
        jobs = MaintenanceScheduler(store, config, AgentMetrics())
        jobs.start()
        try:
            deadline = time.monotonic() + 20
            while True:
                with store.cursor() as cur:
                    rolled = cur.execute("SELECT sum(lookups) FROM cache_minute").fetchall()[0][0]
                done = {k for k, v in _runs(jobs).items() if v >= 1}
                if rolled == 4 and {("rollup", "ok"), ("checkpoint", "ok"), ("export", "ok")} <= done:
                    break
                assert time.monotonic() < deadline, (rolled, done)
                time.sleep(0.05)
        finally:
            jobs.shutdown()
        assert ("rollup", "error") not in _runs(jobs)


def _runs(jobs: MaintenanceScheduler) -> dict[tuple[str, str], float]:
    return {
        (labels[0], labels[1]): metric._value.get()
        for labels, metric in jobs.runs._metrics.items()
    }


def test_concurrent_posts_are_grouped_and_all_stored(client: TestClient) -> None:
    base = minute_start(-2)
    errors: list[str] = []

    def sender(engine: str) -> None:
        for seq in range(5):
            events = [dict(e, engine_id=engine) for e in known_events(base)]
            response = client.post("/v1/events", content=json_body(batch(seq, events, engine)), headers=JSON)
            if response.status_code != 200:
                errors.append(response.text)

    threads = [threading.Thread(target=sender, args=(f"e{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sql(client, "SELECT count(*), count(DISTINCT engine_id) FROM requests") == [[40, 4]]
    assert client.get("/v1/query/ingest_seq_gaps").json()["rows"] == [[f"e{i}", 4, 5, 0] for i in range(4)]


# -- regressions from the review -------------------------------------------------------------------
def test_values_that_would_poison_sums_are_rejected(client: TestClient, base: int) -> None:
    """bytes_moved is bounded (2**48) and durations are finite, so no batch can overflow a
    cache_minute sum (stopping the rollup for good) or turn a histogram sum into +Inf."""
    huge = lookup_event(base, "r1", outcome="recovered", reason="kv_evicted", bytes_moved=2**62)
    response = client.post("/v1/events", content=json_body(batch(0, [huge])), headers=JSON)
    assert response.status_code == 422 and response.json()["error"]["path"] == "$.events[0].bytes_moved"
    infinite = lookup_event(base, "r1", outcome="recovered", reason="kv_evicted", recovery_seconds=float("inf"))
    packed = msgspec.msgpack.encode(batch(1, [infinite]))
    response = client.post("/v1/events", content=packed, headers={"content-type": "application/msgpack"})
    assert response.status_code == 422 and response.json()["error"]["path"] == "$.events[0].recovery_seconds"
    assert sql(client, "SELECT count(*) FROM cache_lookups") == [[0]]


def test_a_rejected_batch_that_skips_seqs_records_the_gap(client: TestClient, base: int) -> None:
    assert client.post("/v1/events", content=json_body(batch(0, known_events(base))), headers=JSON).status_code == 200
    bad = batch(5, [lookup_event(base, "r9", usable_tokens=5)])
    assert client.post("/v1/events", content=json_body(bad), headers=JSON).status_code == 422
    assert sql(client, "SELECT first_missing, last_missing FROM ingest_gaps") == [[1, 4]]
    assert gauge(client, "kvscope_ingest_seq_gaps_total") == 1.0
    assert gauge(client, "kvscope_ingest_missing_batches") == 4.0


def test_wall_clock_seqs_of_old_clients_and_huge_seqs_do_not_break_gap_accounting(
    client: TestClient, base: int
) -> None:
    legacy = 1_764_000_000_000_000  # an old client's seq: wall-clock microseconds
    old = [dict(e, engine_id="old") for e in known_events(base)]
    for seq in (legacy, legacy + 2):
        assert client.post("/v1/events", content=json_body(batch(seq, old, "old")), headers=JSON).status_code == 200
    hostile = [dict(e, engine_id="big") for e in known_events(base)]
    assert client.post("/v1/events", content=json_body(batch(2**63 - 1, hostile, "big")), headers=JSON).status_code == 200
    response = client.get("/v1/query/ingest_seq_gaps")
    assert response.status_code == 200, response.text
    # an engine whose first seq is that large is counted from it (LEGACY_SEQ_FLOOR): the old
    # client's hole is one seq; the hostile seq neither overflows the query nor invents 2**63 gaps
    assert response.json()["rows"] == [["old", legacy + 2, 2, 1], ["big", 2**63 - 1, 1, 0]]
    assert sql(client, "SELECT engine_id, first_missing, last_missing FROM ingest_gaps ORDER BY 1") == [
        ["old", legacy + 1, legacy + 1],
    ]
    assert gauge(client, "kvscope_ingest_missing_batches") == 1.0


def test_a_cancelled_request_does_not_fail_the_rest_of_its_flush(store: Store, base: int) -> None:
    ingestor = Ingestor(store, AgentMetrics())
    prepared = [prepare_batch(decode_batch(json_body(batch(seq, known_events(base))))) for seq in range(2)]
    try:
        with store.transaction():
            first, second = (ingestor.submit(p) for p in prepared)
            assert first.cancel()  # its request went away while queued
        assert second.result(10).status == "stored"
    finally:
        ingestor.close()
    with store.cursor() as cur:
        assert cur.execute("SELECT seq FROM ingest_batches ORDER BY seq").fetchall() == [(0,), (1,)]


def test_flusher_stamps_after_every_watermark_even_when_tables_are_empty(tmp_path: Path, base: int) -> None:
    """A restarted flusher must stamp after the rollup and export watermarks, even once
    retention emptied the tables and the clock went back (review finding 11)."""
    with Store.open(tmp_path / "k.duckdb") as store:
        future = utc_now() + timedelta(hours=5)
        ingest_batch(store, decode_batch(json_body(batch(0, known_events(base)))), received_at=future)
        assert fold_cache_minute(store) == 4
        with store.transaction() as cur:
            cur.execute("DELETE FROM cache_lookups")
        ingestor = Ingestor(store, AgentMetrics())
        try:
            late = prepare_batch(decode_batch(json_body(batch(1, known_events(base)))))
            assert ingestor.submit(late).result(10).status == "stored"
        finally:
            ingestor.close()
        assert fold_cache_minute(store) == 4


def test_a_dead_decode_worker_is_replaced(base: int) -> None:
    import asyncio
    import os
    import signal

    from agent.decode import BatchDecoder, Decoded

    decoder = BatchDecoder(1)
    body = json_body(batch(0, known_events(base)))
    try:
        assert isinstance(asyncio.run(decoder.decode(body, "json")), Decoded)
        for pid in list(decoder._executor._processes):  # type: ignore[attr-defined]
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        assert isinstance(asyncio.run(decoder.decode(body, "json")), Decoded)
        assert decoder.restarts == 1
    finally:
        decoder.shutdown()


def test_minute_sums_beyond_bigint_stay_exact(store: Store, base: int) -> None:
    """2**16 lookups of 2**48 bytes moved in one minute sum to 2**64: the rollup keeps folding
    (HUGEINT sums) instead of failing on every run (second review, finding 1)."""
    n = 2**16
    events = [
        lookup_event(base, f"r{i}", tier="host", outcome="recovered", reason="kv_evicted", bytes_moved=2**48)
        for i in range(n)
    ]
    assert store_batch(store, 0, events) == "stored"
    assert fold_cache_minute(store) == n
    store_batch(store, 1, events[:1])
    assert fold_cache_minute(store) == 1
    with store.cursor() as cur:
        assert cur.execute("SELECT lookups, bytes_moved FROM cache_minute").fetchall() == [(n + 1, (n + 1) * 2**48)]


def test_an_engine_upgraded_from_wall_clock_seqs_counts_each_numbering(client: TestClient, base: int) -> None:
    legacy = 1_764_000_000_000_000
    for seq in (legacy, legacy + 1, 0, 1, 5):
        assert client.post("/v1/events", content=json_body(batch(seq, known_events(base))), headers=JSON).status_code == 200
    assert client.get("/v1/query/ingest_seq_gaps").json()["rows"] == [["e1", legacy + 1, 5, 3]]
    assert sql(client, "SELECT first_missing, last_missing FROM ingest_gaps") == [[2, 4]]
    assert gauge(client, "kvscope_ingest_missing_batches") == 3.0
    ranges = SeqRanges()
    for seq in (legacy, legacy + 3, 0, 2):
        ranges.add(seq)
    assert ranges.missing == 3  # 1, legacy+1, legacy+2
    assert ranges.top_in_numbering(7) == 2 and ranges.top_in_numbering(legacy + 9) == legacy + 3


def test_parquet_parts_are_fsynced_before_they_are_recorded(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    import agent.maintenance as maintenance

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(maintenance.os, "fsync", fsync)
    hour = (int(time.time()) // 3600 - 3) * 3600
    store_batch(store, 0, [lookup_event(hour + 10, "r1")])
    [part] = [p for p in export_parquet(store, tmp_path / "x", now=hour + 3 * 3600) if p.table == "cache_lookups"]
    [path] = part.files
    assert str(path.with_name(f".{path.name}.tmp")) in synced  # the file, before its rename
    assert str(path.parent) in synced and str(path.parent.parent) in synced  # its folders
