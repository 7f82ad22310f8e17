"""Bounded metric labels (issue 19): 20,000 distinct models through the real app fold into
``other`` with exact sums; ``/metrics`` renders off the event loop; process and DuckDB gauges."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from agent_testdata import batch, known_events, lookup_event, request_event
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from agent.app import create_app
from agent.config import AgentConfig, ConfigError, config_from_mapping
from agent.label_cap import FOLDED_VALUE, LabelCap
from agent.metrics import AgentMetrics
from agent.process_metrics import duckdb_memory_bytes
from agent.store import Store

MSGPACK = {"content-type": "application/msgpack"}
MODELS = 20_000
PER_BATCH = 5_000

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def config(tmp_path: Path) -> AgentConfig:
    # overrides conftest's: batches of 5,000 requests need more than its 64 KiB body limit
    return AgentConfig(
        data_dir=tmp_path / "data", max_body_bytes=16 * 1024 * 1024, decode_processes=0
    )


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def by_model(samples: Samples, name: str) -> dict[str, float]:
    """Sample ``name`` summed per model label (over every other label)."""
    out: dict[str, float] = {}
    for (sample, labels), value in samples.items():
        if sample == name:
            model = dict(labels)["model"]
            out[model] = out.get(model, 0.0) + value
    return out


def prompt_tokens(i: int) -> int:
    return 100 + i % 37


def events_for(models: range, base: float) -> list[dict[str, object]]:
    events: list[dict[str, object]] = []
    for i in models:
        model = f"m{i:05d}"
        n = prompt_tokens(i)
        events.append(
            lookup_event(
                base, f"r{i}", model=model, hash_hit_tokens=n, usable_tokens=n, recoverable_tokens=n
            )
        )
        events.append(
            request_event(base, f"r{i}", model=model, prompt_tokens=n, recomputed_tokens=n)
        )
    return events


def test_twenty_thousand_models_fold_into_other(
    client: TestClient, metrics: AgentMetrics, base: int
) -> None:
    for seq, start in enumerate(range(0, MODELS, PER_BATCH)):
        body = msgspec.msgpack.encode(
            batch(seq, events_for(range(start, start + PER_BATCH), base + 1))
        )
        response = client.post("/v1/events", content=body, headers=MSGPACK)
        assert response.status_code == 200, response.text
    response = client.get("/metrics")
    assert response.status_code == 200
    assert len(response.content) < 1_000_000  # was 74 MB without the cap
    samples = parse(response.text)

    cap = metrics.label_cap.max_values
    assert cap == 100
    folded = MODELS - cap
    assert samples[("kvscope_metric_label_values_folded_total", (("label", "model"),))] == folded
    assert samples[("kvscope_metric_label_values_folded_total", (("label", "engine"),))] == 0
    requests = by_model(samples, "kvscope_requests_total")
    kept = set(requests) - {FOLDED_VALUE}
    # the first values seen keep their series: all from the first batch, one request each
    assert len(kept) == cap
    assert all(int(model[1:]) < PER_BATCH for model in kept)
    assert kept == metrics.label_cap.kept("model")
    assert {m: v for m, v in requests.items() if m in kept} == dict.fromkeys(kept, 1.0)
    assert requests[FOLDED_VALUE] == folded
    # exact sums preserved: other holds every folded model's tokens, and nothing else
    kept_tokens = sum(prompt_tokens(int(m[1:])) for m in kept)
    total_tokens = sum(prompt_tokens(i) for i in range(MODELS))
    tokens = by_model(samples, "kvscope_prompt_tokens_total")
    assert {m: v for m, v in tokens.items() if m in kept} == {
        m: float(prompt_tokens(int(m[1:]))) for m in kept
    }
    assert tokens[FOLDED_VALUE] == total_tokens - kept_tokens
    # every metric carrying model folds the same values
    lookups = by_model(samples, "kvscope_cache_lookups_total")
    assert set(lookups) == kept | {FOLDED_VALUE} and lookups[FOLDED_VALUE] == folded
    assert (
        by_model(samples, "kvscope_lookup_recoverable_tokens_total")[FOLDED_VALUE]
        == total_tokens - kept_tokens
    )
    assert by_model(samples, "kvscope_request_ttft_seconds_count")[FOLDED_VALUE] == folded

    # later: a kept model stays kept, a new one folds (counted once, however often it comes)
    old = min(kept)
    late = [
        *events_for(range(MODELS, MODELS + 1), base + 2),
        *events_for(range(MODELS, MODELS + 1), base + 3),
    ]
    late += events_for(range(int(old[1:]), int(old[1:]) + 1), base + 2)
    response = client.post(
        "/v1/events", content=msgspec.msgpack.encode(batch(99, late)), headers=MSGPACK
    )
    assert response.status_code == 200, response.text
    after = parse(client.get("/metrics").text)
    assert after[("kvscope_metric_label_values_folded_total", (("label", "model"),))] == folded + 1
    requests = by_model(after, "kvscope_requests_total")
    assert requests[old] == 2.0 and requests[FOLDED_VALUE] == folded + 2


def test_label_cap_keeps_the_first_values() -> None:
    registry = CollectorRegistry()
    cap = LabelCap(("engine", "model"), 2, registry)
    seen = [cap.fold("model", v) for v in ("a", "b", "c", "a", "d", "c", FOLDED_VALUE)]
    assert seen == ["a", "b", "other", "a", "other", "other", "other"]
    assert cap.kept("model") == {"a", "b"}
    assert cap.fold("engine", "c") == "c"  # per label name
    assert cap.folded_values.labels(label="model")._value.get() == 2.0  # c and d, once each
    assert cap.folded_values.labels(label="engine")._value.get() == 0.0
    with pytest.raises(ValueError, match="max_values must be >= 1, got 0"):
        LabelCap(("model",), 0, CollectorRegistry())


def test_ratio_gauge_folds_series_as_a_ratio_of_sums() -> None:
    metrics = AgentMetrics(label_max_values=1)
    metrics.set_recoverable_hit_ratios(
        {
            ("e1", "m1"): (50.0, 100.0),
            ("e1", "m2"): (1.0, 4.0),
            ("e1", "m3"): (2.0, 4.0),
            ("e2", "m1"): (3.0, 4.0),
        }
    )
    gauge = {
        k: v
        for k, v in parse(generate_latest(metrics.registry).decode()).items()
        if k[0] == "kvscope_recoverable_hit_ratio"
    }
    assert gauge == {
        ("kvscope_recoverable_hit_ratio", (("engine", "e1"), ("model", "m1"))): 0.5,
        ("kvscope_recoverable_hit_ratio", (("engine", "e1"), ("model", "other"))): 3.0 / 8.0,
        ("kvscope_recoverable_hit_ratio", (("engine", "other"), ("model", "m1"))): 0.75,
    }


class _LoopProbe(Collector):
    """Records, at each collect, whether the calling thread runs an asyncio event loop."""

    def __init__(self) -> None:
        self.on_loop: list[bool] = []
        self.threads: list[str] = []

    def collect(self) -> Iterator[Metric]:
        try:
            asyncio.get_running_loop()
            self.on_loop.append(True)
        except RuntimeError:
            self.on_loop.append(False)
        self.threads.append(threading.current_thread().name)
        yield GaugeMetricFamily("kvscope_test_probe", "probe", value=1.0)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def test_metrics_render_off_the_event_loop(client: TestClient, metrics: AgentMetrics) -> None:
    probe = _LoopProbe()
    metrics.registry.register(probe)
    assert client.get("/metrics").status_code == 200
    assert probe.on_loop == [False]  # a worker thread, not the loop's
    assert probe.threads[0] != threading.current_thread().name


def test_process_and_duckdb_gauges(
    client: TestClient, metrics: AgentMetrics, store: Store, config: AgentConfig
) -> None:
    samples = parse(client.get("/metrics").text)
    if Path("/proc/self/stat").exists():
        assert samples[("process_resident_memory_bytes", ())] > 0
        assert samples[("process_start_time_seconds", ())] > 1.6e9
    assert samples[("kvscope_duckdb_memory_bytes", ())] >= 0
    assert duckdb_memory_bytes(store) is not None
    # a closed store, a missing one, a failing source: absent, and the scrape still works
    closed = Store.open(config.data_dir / "other.duckdb")
    closed.close()
    assert duckdb_memory_bytes(closed) is None and duckdb_memory_bytes(None) is None
    for source in (lambda: duckdb_memory_bytes(closed), lambda: 1 / 0):
        metrics.set_duckdb_memory_source(source)
        response = client.get("/metrics")
        assert response.status_code == 200
        after = parse(response.text)
        assert ("kvscope_duckdb_memory_bytes", ()) not in after
        assert ("kvscope_ingest_queue_events", ()) in after


def test_config_key_metric_label_max_values(config: AgentConfig, store: Store) -> None:
    assert AgentConfig().metric_label_max_values == 100
    assert config_from_mapping({"metric_label_max_values": 5}).metric_label_max_values == 5
    with pytest.raises(ConfigError, match="metric_label_max_values must be >= 1, got 0"):
        config_from_mapping({"metric_label_max_values": 0})
    with pytest.raises(ConfigError, match="metric_label_max_values must be at most"):
        config_from_mapping({"metric_label_max_values": 10**6})
    app = create_app(
        AgentConfig(data_dir=config.data_dir, metric_label_max_values=3, decode_processes=0),
        store,
        environ={},
    )
    with TestClient(app):  # its lifespan stops the ingest thread it started
        assert app.state.metrics.label_cap.max_values == 3


class FakeClock:
    """Monotonic seconds the test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_label_cap_evicts_the_longest_idle_value_only_when_full() -> None:
    clock, evicted = FakeClock(), []
    cap = LabelCap(
        ("engine", "model"), 2, CollectorRegistry(), idle_seconds=10.0, clock=clock,
        on_evict=lambda name, value: evicted.append((name, value)),
    )  # fmt: skip
    assert cap.fold("engine", "a") == "a"
    clock.now = 5.0
    assert cap.fold("engine", "b") == "b"
    clock.now = 9.0
    assert cap.fold("engine", "c") == FOLDED_VALUE  # full, and a is idle 9 s only
    clock.now = 12.0
    assert cap.fold("engine", "c") == "c"  # a idle 12 s: evicted; b (7 s) stays
    assert evicted == [("engine", "a")] and cap.kept("engine") == {"b", "c"}
    clock.now = 30.0
    assert cap.fold("engine", "b") == "b"  # seen again: b is now the most recent
    assert cap.fold("engine", "a") == "a"  # back, as a new value: takes c's slot (idle 18 s)
    assert evicted == [("engine", "a"), ("engine", "c")] and cap.kept("engine") == {"a", "b"}
    assert cap.evicted_values.labels(label="engine")._value.get() == 2.0
    assert cap.evicted_values.labels(label="model")._value.get() == 0.0
    # below the cap nothing is evicted, however long the idle
    assert cap.fold("model", "m1") == "m1"
    clock.now = 1e6
    assert cap.fold("model", "m2") == "m2" and cap.kept("model") == {"m1", "m2"}
    assert len(evicted) == 2

    never = LabelCap(("engine",), 1, CollectorRegistry(), idle_seconds=None, clock=clock)
    never.fold("engine", "a")
    clock.now = 1e9
    assert never.fold("engine", "b") == FOLDED_VALUE and never.kept("engine") == {"a"}
    with pytest.raises(ValueError, match="idle_seconds must be > 0 or None, got 0"):
        LabelCap(("engine",), 1, CollectorRegistry(), idle_seconds=0)


def engines_by_metric(samples: Samples) -> dict[str, set[str]]:
    """Sample name → the engine label values it carries."""
    out: dict[str, set[str]] = {}
    for (name, labels), _ in samples.items():
        engine = dict(labels).get("engine")
        if engine is not None:
            out.setdefault(name, set()).add(engine)
    return out


def test_idle_engines_are_evicted_with_every_series_and_new_ones_take_their_slot(
    config: AgentConfig, store: Store, base: int
) -> None:
    # engine ids are new at every engine run (host-pid-start): a full cap must not blind the
    # metrics to every later engine
    clock = FakeClock()
    metrics = AgentMetrics(label_max_values=2, label_idle_seconds=60.0, clock=clock)
    seqs: dict[str, int] = {}

    def post(engine: str, at: float) -> None:
        clock.now = at
        events = [{**e, "engine_id": engine} for e in known_events(base)]
        seqs[engine] = seqs.get(engine, -1) + 1
        body = msgspec.msgpack.encode(batch(seqs[engine], events, engine_id=engine))
        response = client.post("/v1/events", content=body, headers=MSGPACK)
        assert response.status_code == 200, response.text

    with TestClient(create_app(config, store, metrics=metrics, environ={})) as client:
        post("e1", 0.0)
        post("e2", 10.0)
        metrics.set_recoverable_hit_ratios({("e1", "m1"): (1.0, 2.0), ("e2", "m1"): (1.0, 4.0)})
        post("e3", 30.0)  # full; the idlest (e1) unseen for 20 s only: e3 folds
        before = parse(client.get("/metrics").text)
        post("e4", 75.0)  # e1 unseen for 65 s: evicted; e2 (as idle) stays, one slot is enough
        after = parse(client.get("/metrics").text)
        kept_after = metrics.label_cap.kept("engine")
        post("e1", 80.0)  # back: a new value, taking the slot of e2 (idle 70 s)
        again = parse(client.get("/metrics").text)

    engines = engines_by_metric(before)
    capped = {name for name in engines if not name.startswith("kvscope_recoverable_hit_ratio")}
    assert {"kvscope_recovery_seconds_count", "kvscope_request_ttft_seconds_count",
            "kvscope_invalidations_total", "kvscope_cache_lookups_total"} <= capped  # fmt: skip
    assert all(engines[name] == {"e1", "e2", FOLDED_VALUE} for name in capped), engines
    assert engines["kvscope_recoverable_hit_ratio"] == {"e1", "e2"}
    engines = engines_by_metric(after)
    assert all(engines[name] == {"e2", "e4", FOLDED_VALUE} for name in capped), engines
    assert engines["kvscope_recoverable_hit_ratio"] == {"e2"}  # the ratio series of e1 removed too
    assert kept_after == {"e2", "e4"}
    evicted = "kvscope_metric_label_values_evicted_total"
    assert after[(evicted, (("label", "engine"),))] == 1.0
    assert after[(evicted, (("label", "model"),))] == 0.0
    assert after[("kvscope_requests_total", (("engine", "e4"), ("model", "m1")))] == 2.0
    assert again[("kvscope_requests_total", (("engine", "e1"), ("model", "m1")))] == 2.0  # anew
    assert engines_by_metric(again)["kvscope_requests_total"] == {"e1", "e4", FOLDED_VALUE}
    assert again[(evicted, (("label", "engine"),))] == 2.0


def test_config_key_metric_label_idle_seconds() -> None:
    assert AgentConfig().metric_label_idle_seconds == 3600.0
    assert config_from_mapping({"metric_label_idle_seconds": None}).metric_label_idle_seconds is None
    assert config_from_mapping({"metric_label_idle_seconds": 60}).metric_label_idle_seconds == 60
    with pytest.raises(ConfigError, match="metric_label_idle_seconds must be > 0 or null, got 0"):
        config_from_mapping({"metric_label_idle_seconds": 0})
