"""Fixtures for the agent tests: a store in tmp_path, an app on it, the known batch stored."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_testdata import batch, json_body, known_events, minute_start
from fastapi.testclient import TestClient

from agent.app import create_app
from agent.config import AgentConfig
from agent.metrics import AgentMetrics
from agent.store import Store


@pytest.fixture
def config(tmp_path: Path) -> AgentConfig:
    return AgentConfig(
        data_dir=tmp_path / "data",
        sql_timeout_seconds=0.5,
        max_body_bytes=64 * 1024,
        decode_processes=0,  # threads: no worker processes per test app
    )


@pytest.fixture
def store(config: AgentConfig) -> Iterator[Store]:
    opened = Store.open(config.db_path)
    yield opened
    opened.close()


@pytest.fixture
def metrics() -> AgentMetrics:
    return AgentMetrics()


@pytest.fixture
def client(config: AgentConfig, store: Store, metrics: AgentMetrics) -> Iterator[TestClient]:
    app = create_app(config, store, metrics=metrics, environ={})
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def base() -> int:
    return minute_start(-2)


@pytest.fixture
def loaded(client: TestClient, base: int) -> TestClient:
    """The client after the known batch (seq 1) was stored."""
    response = client.post(
        "/v1/events",
        content=json_body(batch(1, known_events(base))),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 200, response.text
    return client
