"""GET /metrics: exact counter values after the known batch; rejected/duplicate batches."""

from __future__ import annotations

from agent_testdata import batch, json_body, known_events
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from agent.metrics import AgentMetrics

JSON = {"content-type": "application/json"}


def samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.startswith("kvscope_") and not sample.name.endswith("_created"):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def lbl(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


EM = {"engine": "e1", "model": "m1"}


def test_metrics_after_known_batch_duplicate_and_rejected(client: TestClient, base: int) -> None:
    body = json_body(batch(1, known_events(base)))
    assert client.post("/v1/events", content=body, headers=JSON).json()["status"] == "stored"
    assert client.post("/v1/events", content=body, headers=JSON).json()["status"] == "duplicate"
    assert client.post("/v1/events", content=b"{", headers=JSON).status_code == 422
    assert client.post("/v1/events", content=b"{}", headers={"content-type": "text/plain"}).status_code == 415
    everything = samples(client)
    # DuckDB's buffer manager holds the stored rows' blocks: some memory, read at scrape time
    assert everything.pop(("kvscope_duckdb_memory_bytes", ())) > 0
    # seconds spent per ingest stage: every stage ran for the stored batch (and the duplicate)
    stages = {k[1][0][1]: everything.pop(k) for k in list(everything) if k[0] == "kvscope_ingest_stage_seconds_total"}
    assert set(stages) == {"decode", "check", "insert", "commit", "summary"}
    assert all(seconds > 0 for seconds in stages.values()), stages
    histograms = {k: v for k, v in everything.items() if k[0].endswith(("_bucket", "_sum", "_count"))}
    assert {k: v for k, v in everything.items() if k not in histograms} == {
        ("kvscope_cache_lookups_total", lbl(**EM, form="full_kv", tier="device", outcome="hit")): 1.0,
        ("kvscope_cache_lookups_total", lbl(**EM, form="swa_window", tier="device", outcome="invalidated")): 1.0,
        ("kvscope_cache_lookups_total", lbl(**EM, form="full_kv", tier="host", outcome="recovered")): 1.0,
        ("kvscope_cache_lookups_total", lbl(**EM, form="linear_state", tier="device", outcome="replayed")): 1.0,
        ("kvscope_lookup_hash_hit_tokens_total", lbl(**EM, form="full_kv", tier="device", outcome="hit")): 800.0,
        ("kvscope_lookup_hash_hit_tokens_total", lbl(**EM, form="swa_window", tier="device", outcome="invalidated")): 800.0,
        ("kvscope_lookup_hash_hit_tokens_total", lbl(**EM, form="full_kv", tier="host", outcome="recovered")): 3000.0,
        ("kvscope_lookup_hash_hit_tokens_total", lbl(**EM, form="linear_state", tier="device", outcome="replayed")): 3000.0,
        ("kvscope_lookup_usable_tokens_total", lbl(**EM, form="full_kv", tier="device", outcome="hit")): 800.0,
        ("kvscope_lookup_usable_tokens_total", lbl(**EM, form="swa_window", tier="device", outcome="invalidated")): 600.0,
        ("kvscope_lookup_usable_tokens_total", lbl(**EM, form="full_kv", tier="host", outcome="recovered")): 3000.0,
        ("kvscope_lookup_usable_tokens_total", lbl(**EM, form="linear_state", tier="device", outcome="replayed")): 2400.0,
        ("kvscope_lookup_recoverable_tokens_total", lbl(**EM, form="full_kv", tier="device", outcome="hit")): 600.0,
        ("kvscope_lookup_recoverable_tokens_total", lbl(**EM, form="swa_window", tier="device", outcome="invalidated")): 600.0,
        ("kvscope_lookup_recoverable_tokens_total", lbl(**EM, form="full_kv", tier="host", outcome="recovered")): 2400.0,
        ("kvscope_lookup_recoverable_tokens_total", lbl(**EM, form="linear_state", tier="device", outcome="replayed")): 2400.0,
        ("kvscope_invalidations_total", lbl(**EM, form="swa_window", reason="swa_evicted")): 1.0,
        ("kvscope_requests_total", lbl(**EM)): 2.0,
        ("kvscope_prompt_tokens_total", lbl(**EM)): 4000.0,
        ("kvscope_hash_hit_tokens_total", lbl(**EM)): 3800.0,
        ("kvscope_recoverable_tokens_total", lbl(**EM)): 3000.0,
        ("kvscope_replayed_tokens_total", lbl(**EM)): 200.0,
        ("kvscope_recomputed_tokens_total", lbl(**EM)): 800.0,
        ("kvscope_ingest_batches_total", lbl(status="stored")): 1.0,
        ("kvscope_ingest_batches_total", lbl(status="duplicate")): 1.0,
        ("kvscope_ingest_batches_total", lbl(status="rejected")): 2.0,
        ("kvscope_ingest_rejected_batches_total", lbl(reason="invalid")): 1.0,
        ("kvscope_ingest_rejected_batches_total", lbl(reason="content_type")): 1.0,
        ("kvscope_ingest_events_total", lbl(kind="cache_lookup")): 4.0,
        ("kvscope_ingest_events_total", lbl(kind="request")): 2.0,
        ("kvscope_ingest_events_total", lbl(kind="engine_stats")): 1.0,
        ("kvscope_ingest_events_total", lbl(kind="block")): 1.0,
        # the known batch is seq 1: seq 0 was never received
        ("kvscope_ingest_seq_gaps_total", ()): 1.0,
        ("kvscope_ingest_missing_batches", ()): 1.0,
        ("kvscope_ingest_queue_events", ()): 0.0,
        # one engine and one model: nothing folded
        ("kvscope_metric_label_values_folded_total", lbl(label="engine")): 0.0,
        ("kvscope_metric_label_values_folded_total", lbl(label="model")): 0.0,
        ("kvscope_metric_label_values_evicted_total", lbl(label="engine")): 0.0,
        ("kvscope_metric_label_values_evicted_total", lbl(label="model")): 0.0,
    }  # fmt: skip
    host = lbl(**EM, form="full_kv", tier="host")
    replayed = lbl(**EM, form="linear_state", tier="device")
    # recovered full_kv from host took 0.25 s; the replayed linear state reported 0 s
    assert histograms[("kvscope_recovery_seconds_bucket", lbl(**dict(host), le="0.1"))] == 0.0
    assert histograms[("kvscope_recovery_seconds_bucket", lbl(**dict(host), le="0.25"))] == 1.0
    assert histograms[("kvscope_recovery_seconds_sum", host)] == 0.25
    assert histograms[("kvscope_recovery_seconds_bucket", lbl(**dict(replayed), le="0.001"))] == 1.0
    assert histograms[("kvscope_recovery_seconds_count", replayed)] == 1.0
    assert {k[1] for k in histograms if k[0] == "kvscope_recovery_seconds_count"} == {host, replayed}
    # TTFTs 0.125 s and 0.1 s
    assert histograms[("kvscope_request_ttft_seconds_bucket", lbl(**EM, le="0.05"))] == 0.0
    assert histograms[("kvscope_request_ttft_seconds_bucket", lbl(**EM, le="0.1"))] == 1.0
    assert histograms[("kvscope_request_ttft_seconds_bucket", lbl(**EM, le="0.25"))] == 2.0
    assert histograms[("kvscope_request_ttft_seconds_sum", lbl(**EM))] == 0.225
    # the events are ~2 minutes old: every one lands in the 60 s < lag <= 300 s bucket
    assert histograms[("kvscope_ingest_lag_seconds_bucket", lbl(le="60.0"))] == 0.0
    assert histograms[("kvscope_ingest_lag_seconds_bucket", lbl(le="300.0"))] == 8.0
    assert histograms[("kvscope_ingest_lag_seconds_count", ())] == 8.0


def test_each_app_has_its_own_registry() -> None:
    first, second = AgentMetrics(), AgentMetrics()
    first.observe_rejected("invalid")
    assert first.registry is not second.registry
    assert first.ingest_batches.labels(status="rejected")._value.get() == 1.0
    assert second.ingest_batches.labels(status="rejected")._value.get() == 0.0


def test_ratio_gauge_replaces_its_series(metrics: AgentMetrics, client: TestClient) -> None:
    metrics.set_recoverable_hit_ratios({("e1", "m1"): (750.0, 1000.0), ("e2", "m1"): (50.0, 100.0)})
    metrics.set_recoverable_hit_ratios({("e1", "m1"): (250.0, 1000.0)})
    gauge = {k: v for k, v in samples(client).items() if k[0] == "kvscope_recoverable_hit_ratio"}
    assert gauge == {("kvscope_recoverable_hit_ratio", lbl(**EM)): 0.25}


def test_tensor_parallel_disagreements_are_counted_by_the_vetoing_rank(client: TestClient, base: int) -> None:
    from agent_testdata import lookup_event

    lost = {"outcome": "invalidated", "reason": "tp_disagree", "hash_hit_tokens": 96, "usable_tokens": 96, "recoverable_tokens": 48}
    events = [
        lookup_event(base + 1, "r1", form="linear_state", tp_rank=1, **lost),
        lookup_event(base + 2, "r2", form="linear_state", tp_rank=1, **lost),
        lookup_event(base + 3, "r3", form="full_kv", tp_rank=3, **lost),
        lookup_event(base + 4, "r4", form="full_kv", outcome="invalidated", reason="kv_evicted", hash_hit_tokens=96, usable_tokens=32, recoverable_tokens=32),
    ]
    assert client.post("/v1/events", content=json_body(batch(1, events)), headers=JSON).json()["status"] == "stored"
    counted = {k: v for k, v in samples(client).items() if k[0] == "kvscope_tp_disagreements_total"}
    assert counted == {
        ("kvscope_tp_disagreements_total", lbl(**EM, form="linear_state", tp_rank="1")): 2.0,
        ("kvscope_tp_disagreements_total", lbl(**EM, form="full_kv", tp_rank="3")): 1.0,
    }


def test_metrics_export_no_created_series(client: TestClient, base: int) -> None:
    assert client.post("/v1/events", content=json_body(batch(1, known_events(base))), headers=JSON).json()["status"] == "stored"
    text = client.get("/metrics").text
    assert "kvscope_cache_lookups_total{" in text  # counters and histograms are there, with samples
    assert "kvscope_ingest_lag_seconds_bucket{" in text
    assert [line for line in text.splitlines() if "_created" in line] == []
