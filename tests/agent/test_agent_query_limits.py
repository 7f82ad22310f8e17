"""Bounded queries: the concurrency cap on /v1/sql and /v1/query (wait, then 429 with
Retry-After), the time limit for a query that is one long function call (a function that blocks
until the test releases it: :mod:`blocking_query`), one start for the limit's wait and interrupt,
the worker thread behind it, and the client's timeout above the agent's limits."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pytest
from blocking_query import BLOCKING_SQL, install_blocking_query
from fastapi.testclient import TestClient

from agent import sql
from agent.app import create_app
from agent.client import DEFAULT_QUERY_TIMEOUT_SECONDS, query_timeout_for
from agent.config import AgentConfig
from agent.deadline import INTERRUPT_GRACE_SECONDS, Budget, StillRunning, run_in_worker
from agent.metrics import AgentMetrics
from agent.query_gate import QueryGate, Slot
from agent.store import Store


def wait_until(condition: object, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def limited(config: AgentConfig, store: Store) -> Iterator[tuple[TestClient, QueryGate]]:
    """An app admitting one query at a time, waiting 0.05 s for a slot, with a 0.1 s limit."""
    tight = dataclasses.replace(
        config,
        sql_max_concurrent_queries=1,
        sql_queue_timeout_seconds=0.05,
        sql_timeout_seconds=0.1,
    )
    app = create_app(tight, store, metrics=AgentMetrics(), environ={})
    with TestClient(app) as client:
        yield client, app.state.query_gate


def hold_slot(client: TestClient, gate: QueryGate) -> Slot:
    """Take a slot on the app's own event loop, as a running query would."""
    assert client.portal is not None
    return client.portal.call(gate.admit)


def test_excess_queries_wait_then_get_429_with_retry_after(
    limited: tuple[TestClient, QueryGate],
) -> None:
    client, gate = limited
    slot = hold_slot(client, gate)
    refused = client.post("/v1/sql", json={"sql": "SELECT 1"})
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert "1 queries are running" in refused.json()["error"]["reason"]
    assert client.get("/v1/query/schema").status_code == 429  # named queries share the cap
    assert client.get("/healthz").status_code == 200  # nothing else is capped
    slot.release()
    wait_until(lambda: gate.running == 0, "the slot to be released")
    assert client.post("/v1/sql", json={"sql": "SELECT 1"}).json()["rows"] == [[1]]
    assert gate.running == 0


def test_a_waiting_query_runs_once_a_slot_frees(config: AgentConfig, store: Store) -> None:
    patient = dataclasses.replace(
        config, sql_max_concurrent_queries=1, sql_queue_timeout_seconds=60
    )
    app = create_app(patient, store, metrics=AgentMetrics(), environ={})
    with TestClient(app) as client:
        gate: QueryGate = app.state.query_gate
        slot = hold_slot(client, gate)
        answer: dict[str, object] = {}
        waiter = threading.Thread(
            target=lambda: answer.update(r=client.post("/v1/sql", json={"sql": "SELECT 2"}))
        )
        waiter.start()
        wait_until(lambda: gate.waiting == 1, "the query to queue")
        slot.release()
        waiter.join(timeout=60)
        response = answer["r"]
        assert response.status_code == 200 and response.json()["rows"] == [[2]]  # type: ignore[attr-defined]


def test_one_long_function_call_is_answered_at_the_limit_and_keeps_its_slot(
    limited: tuple[TestClient, QueryGate], store: Store
) -> None:
    client, gate = limited
    blocking = install_blocking_query(store)
    response = client.post("/v1/sql", json={"sql": BLOCKING_SQL})
    assert response.status_code == 408
    assert "it was interrupted but is one long function call" in response.json()["error"]["reason"]
    assert blocking.entered.is_set()
    assert gate.running == 1  # DuckDB is still inside the call: its slot stays taken
    assert client.post("/v1/sql", json={"sql": "SELECT 1"}).status_code == 429
    blocking.release()
    wait_until(lambda: gate.running == 0, "the long call to end")
    assert client.post("/v1/sql", json={"sql": "SELECT 3"}).json()["rows"] == [[3]]


class SlowAdmission(Store):
    """A store whose cursors open only once ``admit`` is set: a query worker starved of CPU."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.admit = threading.Event()

    @contextmanager
    def cursor(self, *, purpose: str | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
        assert self.admit.wait(60)
        with super().cursor(purpose=purpose) as cur:
            yield cur


def test_a_query_whose_limit_passed_before_it_started_gets_a_408_saying_so_and_never_runs(tmp_path: Path) -> None:
    store = SlowAdmission.open(tmp_path / "slow.duckdb", threads=1)
    store.admit.set()
    blocking = install_blocking_query(store)
    store.admit.clear()
    ended = threading.Event()
    with pytest.raises(sql.SqlTimeout, match=r"time limit of 0\.05 s passed before the query started .* it was not run"):
        sql.run_read_query(store, BLOCKING_SQL, row_limit=1, timeout_seconds=0.05, on_done=ended.set, untrusted=True)
    store.admit.set()  # the worker opens its cursor only now, past the limit
    wait_until(ended.is_set, "on_done")
    assert not blocking.entered.is_set()  # the query itself never ran
    blocking.release()
    assert store.close()


def test_the_budget_counts_the_wait_and_the_interrupt_from_one_instant() -> None:
    now = [10.0]
    con = duckdb.connect()
    late = Budget(1.0, clock=lambda: now[0])
    now[0] = 10.75
    assert late.remaining() == 0.25  # admission spent 0.75 s: the interrupt timer gets the rest
    now[0] = 11.0
    assert late.begin(con) is None and late.guard is None  # nothing left: never started
    assert late.abandon() is False
    given_up = Budget(60.0, clock=lambda: now[0])
    assert given_up.abandon() is False
    assert given_up.begin(con) is None  # the caller gave up first: never started
    running = Budget(60.0, clock=lambda: now[0])
    guard = running.begin(con)
    assert guard is not None and not guard.fired
    assert running.abandon() is True and guard.fired  # interrupted when the caller gives up
    guard.stop()
    con.close()


def test_run_in_worker_answers_at_the_limit_and_reports_the_real_end() -> None:
    release = threading.Event()
    ended: list[str] = []
    with pytest.raises(StillRunning):
        run_in_worker(
            lambda: release.wait(60), wait_seconds=0.05, on_done=lambda: ended.append("done")
        )
    assert ended == []  # the work goes on
    release.set()
    wait_until(lambda: ended == ["done"], "on_done")
    assert run_in_worker(lambda: 7, wait_seconds=5, on_done=lambda: ended.append("again")) == 7
    wait_until(lambda: ended == ["done", "again"], "on_done after a result")
    with pytest.raises(ZeroDivisionError):
        run_in_worker(lambda: 1 // 0, wait_seconds=5)


def test_the_client_waits_longer_than_the_agent_may_take() -> None:
    defaults = AgentConfig()
    assert (
        defaults.sql_timeout_seconds + defaults.sql_queue_timeout_seconds + INTERRUPT_GRACE_SECONDS
    ) < DEFAULT_QUERY_TIMEOUT_SECONDS
    published = {"limits": {"sql_timeout_seconds": defaults.sql_timeout_seconds, "sql_queue_timeout_seconds": defaults.sql_queue_timeout_seconds}}
    assert query_timeout_for(published) == DEFAULT_QUERY_TIMEOUT_SECONDS  # the defaults give the default
    raised = {"limits": {"sql_timeout_seconds": 3600, "sql_queue_timeout_seconds": 5}}
    assert query_timeout_for(raised) == 3605 + 18.0
    for silent in ({}, {"limits": None}, {"limits": {"sql_timeout_seconds": 5}}, {"limits": {"sql_timeout_seconds": True, "sql_queue_timeout_seconds": 1}}):
        assert query_timeout_for(silent) is None  # an older agent: the client keeps its default


def test_gate_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="max_running"):
        QueryGate(0, 1.0)
    with pytest.raises(ValueError, match="queue_timeout_seconds"):
        QueryGate(1, -1.0)


def test_closing_the_store_waits_for_a_query_still_running(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "close.duckdb", threads=1)
    blocking = install_blocking_query(store)
    ended = threading.Event()
    with pytest.raises(sql.SqlTimeout, match="one long function call"):
        sql.run_read_query(store, BLOCKING_SQL, row_limit=1, timeout_seconds=0.1, on_done=ended.set)
    assert not ended.is_set()
    closed: list[bool] = []
    closer = threading.Thread(target=lambda: closed.append(store.close(cursor_wait_seconds=60)))
    closer.start()
    wait_until(lambda: store.close_requested, "close to begin")
    assert closed == [] and store.running == ("query " + BLOCKING_SQL,)  # close waits for the query
    blocking.release()
    closer.join(60)
    assert closed == [True] and not store.is_open and not store.connection_left_open
    wait_until(ended.is_set, "on_done")  # the worker calls it just after its cursor closed
