"""The indexer's sync delay (issue 23, item 4): 0 in a healthy engine; under ``lag_index`` the
indexer's pending rows trail the main compressed KV boundary by one unit, which the engine
measures on the ``indexer_state`` lookup and the agent stores, exports as
``kvscope_indexer_sync_delay_tokens`` / ``_seconds`` and answers in ``indexer_sync_delay``; a
stale slot a request keeps from being replaced goes on trailing, for longer, until it is."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from agent.app import create_app
from agent.config import AgentConfig
from agent.metrics import AgentMetrics
from agent.store import Store
from engine import LLM, CacheConfig
from engine.events import (
    SCHEMA_VERSION,
    CacheLookup,
    EventBatch,
    Form,
    Outcome,
    Reason,
    encode_batch,
)
from engine.faults import Faults
from engine.telemetry import ListSink
from tests.helpers import assert_no_leases, tokens

U = 16
CFG = CacheConfig(unit_tokens=U, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64)
MODEL = "kvscope_hybrid-tiny"  # CSA layers (ratio 4) with an indexer, one indexer group


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[TestClient, Store, AgentMetrics]]:
    config = AgentConfig(data_dir=tmp_path / "data", decode_processes=0)
    store, metrics = Store.open(config.db_path), AgentMetrics()
    try:
        with TestClient(create_app(config, store, metrics=metrics, environ={})) as client:
            yield client, store, metrics
    finally:
        store.close()


def serve(engine_id: str, faults: Faults) -> tuple[LLM, ListSink]:
    """A prefix of 128 tokens, then a follow-up resuming on it, through a fresh engine."""
    sink = ListSink()
    llm = LLM(MODEL, cache=CFG, check_invariants=True, telemetry=sink, engine_id=engine_id, faults=faults)
    prefix = tokens(128, 80)
    llm.score(prefix)
    llm.score([*prefix, *tokens(20, 81)])  # that the output equals a cold run: tests/engine/test_faults.py
    assert_no_leases(llm)
    return llm, sink


def sample(metrics: AgentMetrics, name: str, engine: str, model: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, {"engine": engine, "model": model, "layer_group": "0", **labels})
    return 0.0 if value is None else value


def test_lag_index_makes_the_sync_delay_non_zero_end_to_end(agent: tuple[TestClient, Store, AgentMetrics]) -> None:
    client, store, metrics = agent
    for engine_id, faults in (("healthy", Faults()), ("lagging", Faults(lag_index=True))):
        llm, sink = serve(engine_id, faults)
        indexer = [e for e in sink.events if isinstance(e, CacheLookup) and e.form == Form.INDEXER_STATE]
        assert len(indexer) == 2
        follow_up = indexer[-1]
        others = [e for e in sink.events if isinstance(e, CacheLookup) and e.form != Form.INDEXER_STATE]
        assert all(e.indexer_sync_delay_tokens == 0 and e.indexer_sync_delay_seconds == 0 for e in [indexer[0], *others])
        if faults.lag_index:  # its rows stamped one unit behind the boundary they are stored at
            assert (follow_up.outcome, follow_up.reason) == (Outcome.INVALIDATED, Reason.INDEXER_STALE)
            assert (follow_up.indexer_sync_delay_tokens, follow_up.layer_group) == (U, 0)
            assert 0 < follow_up.indexer_sync_delay_seconds < 60
        else:
            assert follow_up.outcome == Outcome.HIT
            assert (follow_up.indexer_sync_delay_tokens, follow_up.indexer_sync_delay_seconds) == (0, 0.0)
        body = encode_batch(EventBatch(schema_version=SCHEMA_VERSION, engine_id=engine_id, seq=0, sent_at=time.time(), events=list(sink.events)))
        response = client.post("/v1/events", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 200 and response.json()["status"] == "stored", response.text
        model = llm.model_name
    with store.cursor() as cur:
        stored = cur.execute(
            "SELECT engine_id, indexer_sync_delay_tokens, indexer_sync_delay_seconds > 0 FROM cache_lookups "
            "WHERE form = 'indexer_state' ORDER BY engine_id, ts, indexer_sync_delay_tokens"
        ).fetchall()
        elsewhere = cur.execute("SELECT count(*) FROM cache_lookups WHERE form <> 'indexer_state' AND indexer_sync_delay_tokens > 0").fetchone()
    assert stored == [("healthy", 0, False), ("healthy", 0, False), ("lagging", 0, False), ("lagging", U, True)]
    assert elsewhere == (0,)
    for engine_id, trailing in (("healthy", 0), ("lagging", 1)):
        count = sample(metrics, "kvscope_indexer_sync_delay_tokens_count", engine_id, model)
        in_sync = sample(metrics, "kvscope_indexer_sync_delay_tokens_bucket", engine_id, model, le="0.0")
        assert (count, count - in_sync) == (2, trailing)
        assert sample(metrics, "kvscope_indexer_sync_delay_tokens_sum", engine_id, model) == U * trailing
        assert (sample(metrics, "kvscope_indexer_sync_delay_seconds_sum", engine_id, model) > 0) == bool(trailing)
    answer = client.get("/v1/query/indexer_sync_delay", params={"engine_id": "lagging", "since_seconds": 3600}).json()
    rows = [dict(zip(answer["columns"], row, strict=True)) for row in answer["rows"]]
    assert sum(r["lookups"] for r in rows) == 2 and sum(r["trailing_lookups"] for r in rows) == 1
    assert max(r["max_delay_tokens"] for r in rows) == U and {r["layer_group"] for r in rows} == {0}


def test_a_stale_slot_replaced_late_trails_for_longer_then_is_in_sync() -> None:
    llm = LLM(MODEL, cache=CFG, faults=Faults(lag_index=True))
    assert llm.cache.indexer is not None
    slots = llm.cache.indexer.slots
    now = [1000.0]
    slots.clock = lambda: now[0]
    prefix = tokens(128, 82)
    llm.score(prefix)  # stores every indexer slot one unit behind, at 1000 s
    now[0] = 1030.0
    delay = llm.score([*prefix, *tokens(20, 83)]).cache.form(Form.INDEXER_STATE)
    assert (delay.sync_delay_tokens, delay.sync_delay_seconds) == (U, 30.0)
    llm.cache.faults = Faults()
    stale = slots.pool.lookup(llm.cache.block_hashes(prefix)[128 // U - 1])
    assert stale is not None
    slots.pool.lease(stale)  # a request still reads the stale slot: the right rows cannot replace it
    llm.score(prefix)
    slots.pool.release(stale)
    now[0] = 1090.0
    late = llm.score([*prefix, *tokens(20, 84)]).cache.form(Form.INDEXER_STATE)
    assert (late.sync_delay_tokens, late.sync_delay_seconds) == (U, 90.0)  # still the first stale store's
    llm.score(prefix)  # now replaced with rows at the right boundary
    healed = llm.score([*prefix, *tokens(20, 85)]).cache.form(Form.INDEXER_STATE)
    assert (healed.outcome, healed.sync_delay_tokens, healed.sync_delay_seconds) == (Outcome.HIT, 0, 0.0)
    assert_no_leases(llm)
