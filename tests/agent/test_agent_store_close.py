"""``Store.close`` with cursors still open: it waits without the writer lock (a cursor's holder
can still commit), names what still runs past its wait, interrupts it, and — when DuckDB still
refuses, inside one long function call — leaves the connection to the process's exit without
raising; a later close finishes the job. The long query is :mod:`blocking_query`'s function,
which returns when the test says, or a scan DuckDB can interrupt."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import duckdb
import pytest
from blocking_query import BLOCKING_SQL, install_blocking_query

from agent import sql
from agent.store import Store, StoreClosedError

ENDLESS_SCAN = "SELECT sum(i * i) FROM range(10000000000000) t(i)"
"""A scan of 10^13 rows: runs for hours unless interrupted (DuckDB stops it between vectors)."""


def wait_until(condition: object, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_call_duckdb_cannot_stop_leaves_the_connection_open_without_raising(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store.open(tmp_path / "busy.duckdb", threads=1)
    with store.transaction() as cur:
        cur.execute("CREATE TABLE kept AS SELECT 42 AS v")
    blocking = install_blocking_query(store)
    ended = threading.Event()
    with pytest.raises(sql.SqlTimeout):
        sql.run_read_query(store, BLOCKING_SQL, row_limit=1, timeout_seconds=0.05, on_done=ended.set)
    with caplog.at_level(logging.WARNING, logger="agent.store"):
        assert store.close(cursor_wait_seconds=0.05, interrupt_wait_seconds=0.05) is False
    warning, error = [r for r in caplog.records if r.name == "agent.store"]
    assert warning.levelno == logging.WARNING
    assert f"still running after 0.05 s: query {BLOCKING_SQL}" in warning.getMessage()
    assert error.levelno == logging.ERROR
    assert "left open: DuckDB refuses to close it while query SELECT kvscope_block(1) AS n still runs" in error.getMessage()
    assert not store.is_open and store.connection_left_open  # closed for use; DuckDB's connection is not
    with pytest.raises(StoreClosedError), store.cursor():
        pass
    blocking.release()
    wait_until(ended.is_set, "the call to return")
    assert store.close(cursor_wait_seconds=5) is True  # a later close finishes the job
    assert not store.is_open and not store.connection_left_open
    with Store.open(tmp_path / "busy.duckdb") as reopened, reopened.cursor() as cur:
        assert cur.execute("SELECT v FROM kept").fetchall() == [(42,)]


def test_a_scan_still_running_past_the_wait_is_interrupted_and_the_store_closed(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "scan.duckdb", threads=1)
    opened = threading.Event()
    failures: list[BaseException] = []

    def scan() -> None:
        try:
            with store.cursor(purpose="endless scan") as cur:
                opened.set()
                cur.execute(ENDLESS_SCAN).fetchall()
        except duckdb.Error as exc:  # interrupted, or the connection closed before it began
            failures.append(exc)

    worker = threading.Thread(target=scan)
    worker.start()
    assert opened.wait(60)
    assert store.close(cursor_wait_seconds=0.05) is True
    worker.join(60)
    assert not worker.is_alive() and len(failures) == 1
    assert not store.is_open and not store.connection_left_open


def test_close_waits_without_the_writer_lock_so_a_cursor_holder_can_still_commit(tmp_path: Path) -> None:
    """As a Parquet export does: it holds a read cursor, then commits under the writer lock."""
    store = Store.open(tmp_path / "export.duckdb", threads=1)
    go = threading.Event()
    committed: list[bool] = []

    def export() -> None:
        with store.cursor(purpose="export"):
            assert go.wait(60)
            with store.transaction() as writer:
                writer.execute("CREATE TABLE exported AS SELECT 7 AS part")
            committed.append(True)

    worker = threading.Thread(target=export)
    worker.start()
    closed: list[bool] = []
    closer = threading.Thread(target=lambda: closed.append(store.close(cursor_wait_seconds=60)))
    closer.start()
    wait_until(lambda: store.close_requested, "close to begin waiting")
    go.set()
    worker.join(60)
    closer.join(60)
    assert committed == [True] and closed == [True]
    with Store.open(tmp_path / "export.duckdb") as reopened, reopened.cursor() as cur:
        assert cur.execute("SELECT part FROM exported").fetchall() == [(7,)]
