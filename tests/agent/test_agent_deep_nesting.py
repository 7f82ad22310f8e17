"""A value nested 1,000 deep inside an event field (a 2 KB body): a 422 naming the field, with
the rejected batch filed under its engine_id and seq — not a 500 from a ``RecursionError`` in
msgspec's decode or in the rejected-batch audit (:mod:`engine.batch_scan`). A large body nested
deep with its header beyond the audit's byte budget: still a 422, no audit row. SQL nested too
deep for the sandbox to check: a 400 saying so, not a 500."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import msgspec
import pytest
from fastapi.testclient import TestClient

from agent.app import create_app
from agent.config import AgentConfig
from agent.metrics import AgentMetrics
from agent.store import Store
from engine.batch_scan import HEADER_SCAN_BYTES

DEPTH = 1000
HEADER = {"schema_version": 1, "engine_id": "e-deep", "seq": 3, "sent_at": 1764500000.0}


def deep_body(fmt: str, *, header_first: bool) -> bytes:
    """A batch whose one event holds ``request_id`` = a list nested ``DEPTH`` deep, before the
    event's ``kind`` tag (msgspec must skip it to find the tag). Built by hand: msgspec cannot
    encode it either."""
    if fmt == "json":
        event = b'{"request_id": ' + b"[" * DEPTH + b"]" * DEPTH + b', "kind": "cache_lookup"}'
        header = msgspec.json.encode(HEADER)[1:-1]
        events = b'"events": [' + event + b"]"
        return b"{" + (header + b", " + events if header_first else events + b", " + header) + b"}"
    pack = msgspec.msgpack.encode
    event = b"\x82" + pack("request_id") + b"\x91" * (DEPTH - 1) + b"\x90" + pack("kind") + pack("cache_lookup")
    header = b"".join(pack(k) + pack(v) for k, v in HEADER.items())
    events = pack("events") + b"\x91" + event
    return b"\x85" + (header + events if header_first else events + header)


@pytest.fixture
def raw(config: AgentConfig, store: Store, metrics: AgentMetrics) -> Iterator[TestClient]:
    """A client that answers 500s instead of raising them (we assert on status codes)."""
    app = create_app(config, store, metrics=metrics, environ={})
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("header_first", [True, False], ids=["header-first", "header-last"])
@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_deeply_nested_event_field_is_a_422_and_is_audited(raw: TestClient, metrics: AgentMetrics, fmt: str, header_first: bool) -> None:
    body = deep_body(fmt, header_first=header_first)
    assert len(body) < 2200  # the 2 KB body
    response = raw.post("/v1/events", content=body, headers={"content-type": f"application/{fmt}"})
    assert response.status_code == 422, response.text
    assert response.json() == {
        "error": {"path": "$.events[0].request_id", "reason": "nested more than 64 levels deep (the batch schema needs 3)"}
    }
    filed = raw.post("/v1/sql", json={"sql": "SELECT engine_id, seq, status, rows, error FROM ingest_batches"}).json()["rows"]
    assert filed == [["e-deep", 3, "rejected", 0, "$.events[0].request_id: nested more than 64 levels deep (the batch schema needs 3)"]]
    assert metrics.registry.get_sample_value("kvscope_ingest_rejected_batches_total", {"reason": "invalid"}) == 1.0
    stored = raw.post("/v1/sql", json={"sql": "SELECT count(*) FROM cache_lookups"}).json()["rows"]
    assert stored == [[0]]


def test_a_large_deep_body_with_its_header_past_the_audit_budget_is_a_422_without_an_audit_row(config: AgentConfig, store: Store, metrics: AgentMetrics) -> None:
    roomy = dataclasses.replace(config, max_body_bytes=4 * HEADER_SCAN_BYTES)
    depth = HEADER_SCAN_BYTES  # 2 x 64 KiB of brackets: the header lies past the walk's budget
    event = b'{"request_id": ' + b"[" * depth + b"]" * depth + b', "kind": "cache_lookup"}'
    body = b'{"events": [' + event + b"], " + msgspec.json.encode(HEADER)[1:-1] + b"}"
    with TestClient(create_app(roomy, store, metrics=metrics, environ={}), raise_server_exceptions=False) as client:
        response = client.post("/v1/events", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 422, response.text
        assert response.json()["error"]["path"] == "$.events[0].request_id"
        filed = client.post("/v1/sql", json={"sql": "SELECT count(*) FROM ingest_batches"}).json()["rows"]
    assert filed == [[0]]  # the audit gave up: best effort
    assert metrics.registry.get_sample_value("kvscope_ingest_rejected_batches_total", {"reason": "invalid"}) == 1.0


def test_sql_nested_too_deep_to_check_is_a_400(raw: TestClient) -> None:
    deep = "SELECT " + "abs(" * 900 + "1" + ")" * 900
    response = raw.post("/v1/sql", json={"sql": deep})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["reason"].startswith("this statement is nested too deep to check")
    assert raw.post("/v1/sql", json={"sql": "SELECT " + "abs(" * 20 + "-1" + ")" * 20}).json()["rows"] == [[1]]
