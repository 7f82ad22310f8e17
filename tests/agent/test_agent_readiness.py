"""``/readyz``: ready, degraded (the agent's :class:`agent.health.Health`), not ready (no store,
or a data directory that cannot be written — a full disk, a read-only one); the agent's query
limits in every body; the disk probe's cache (:mod:`agent.readiness`). Failing system calls are
injected into the probe (:class:`agent.readiness.ProbeIO`), never patched into ``os``."""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from agent.app import create_app
from agent.config import AgentConfig
from agent.health import Health
from agent.migrations import SCHEMA_VERSION
from agent.readiness import PROBE_FILE, DataDirProbe, ProbeIO
from agent.store import Store


def failing(code: int):
    def fail(*args: object) -> None:
        raise OSError(code, os.strerror(code))

    return fail


def limits(config: AgentConfig) -> dict[str, float]:
    return {"sql_timeout_seconds": config.sql_timeout_seconds, "sql_queue_timeout_seconds": config.sql_queue_timeout_seconds}


def test_ready_then_degraded_with_reasons(config: AgentConfig, store: Store) -> None:
    health = Health()
    app = create_app(config, store, health=health, environ={})
    with TestClient(app) as client:
        assert client.get("/readyz").json() == {"status": "ready", "schema_version": SCHEMA_VERSION, "degraded": [], "limits": limits(config)}
        health.degrade("wal_quarantined", "the WAL was moved to quarantine/kvscope.duckdb.wal.1", since=1764500000.5)
        response = client.get("/readyz")
    assert response.status_code == 200  # degraded still stores and answers: kvscope up counts it as up
    assert response.json() == {
        "status": "degraded",
        "schema_version": SCHEMA_VERSION,
        "degraded": [{"reason": "wal_quarantined", "detail": "the WAL was moved to quarantine/kvscope.duckdb.wal.1", "since": 1764500000.5}],
        "limits": limits(config),
    }
    assert app.state.health is health
    assert not (config.data_dir / PROBE_FILE).exists()  # the probe cleans up after itself


@pytest.mark.parametrize(("where", "code"), [("fsync", errno.ENOSPC), ("write", errno.ENOSPC), ("open", errno.EROFS), ("open", errno.EACCES)])
def test_unwritable_data_dir_is_not_ready(config: AgentConfig, store: Store, where: str, code: int) -> None:
    health = Health()
    health.degrade("acknowledged_batches_missing", "2 batches", since=5.0)
    app = create_app(config, store, health=health, environ={})
    disk_full = [True]
    real = getattr(os, where)

    def call(*args: object) -> object:
        return failing(code)(*args) if disk_full[0] else real(*args)

    app.state.data_dir_probe = DataDirProbe(config.data_dir, ttl_seconds=0, io=dataclasses.replace(ProbeIO(), **{where: call}))
    with TestClient(app) as client:
        response = client.get("/readyz")
        disk_full[0] = False
        assert response.status_code == 503
        name = errno.errorcode[code]
        assert response.json() == {
            "status": "not_ready",
            "reasons": [f"the data directory {config.data_dir} cannot be written ({name}: {os.strerror(code)})"],
            "schema_version": SCHEMA_VERSION,
            "degraded": [{"reason": "acknowledged_batches_missing", "detail": "2 batches", "since": 5.0}],
            "limits": limits(config),
            "error": {"reason": f"not ready: the data directory {config.data_dir} cannot be written ({name}: {os.strerror(code)})"},
        }
        assert client.get("/readyz").status_code == 200  # the disk has room again
    assert not (config.data_dir / PROBE_FILE).exists()


def test_store_not_open_is_not_ready(config: AgentConfig) -> None:
    store = Store.open(config.db_path)
    app = create_app(config, store, environ={})
    with TestClient(app) as client:
        store.close()
        response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {
        "status": "not_ready",
        "reasons": ["the store is not open"],
        "schema_version": None,
        "degraded": [],
        "limits": limits(config),
        "error": {"reason": "not ready: the store is not open"},
    }


def test_missing_data_dir_names_the_errno(tmp_path: Path) -> None:
    assert DataDirProbe(tmp_path / "gone", ttl_seconds=0).problem() == (
        f"the data directory {tmp_path / 'gone'} cannot be written (ENOENT: No such file or directory)"
    )


def test_probe_answers_from_its_cache_and_one_probe_runs_at_a_time(tmp_path: Path) -> None:
    now = [100.0]
    calls: list[int] = []
    release = threading.Event()
    fsync = [os.fsync]

    def slow_fsync(fd: int) -> None:
        calls.append(fd)
        assert release.wait(10)
        os.fsync(fd)

    probe = DataDirProbe(tmp_path, ttl_seconds=1.5, clock=lambda: now[0], io=ProbeIO(fsync=lambda fd: fsync[0](fd)))
    assert probe.cached() is None
    fsync[0] = slow_fsync
    first = threading.Thread(target=probe.problem)
    first.start()
    while not calls:  # bounded by the thread's 10 s wait
        assert first.is_alive()
        threading.Event().wait(0.001)
    answers: list[str | None] = []
    waiters = [threading.Thread(target=lambda: answers.append(probe.problem())) for _ in range(8)]
    for waiter in waiters:
        waiter.start()
    release.set()
    for thread in (first, *waiters):
        thread.join(10)
    assert answers == [None] * 8 and probe.probes == 1 and len(calls) == 1  # the first callers wait for the first answer
    now[0] += 1.0
    assert probe.problem() is None and probe.probes == 1  # cached
    now[0] += 0.5
    assert probe.cached() is None
    fsync[0] = failing(errno.ENOSPC)
    assert "ENOSPC" in (probe.problem() or "") and probe.probes == 2
    assert "ENOSPC" in (probe.problem() or "") and probe.probes == 2  # a failure is cached too
    # while a probe is stuck on the disk, other callers get the answer before it at once
    now[0] += 2.0
    calls.clear()
    release.clear()
    fsync[0] = slow_fsync
    stuck = threading.Thread(target=probe.problem)
    stuck.start()
    while not calls:
        assert stuck.is_alive()
        threading.Event().wait(0.001)
    assert "ENOSPC" in (probe.problem() or "") and probe.probes == 2
    release.set()
    stuck.join(10)
    assert probe.problem() is None and probe.probes == 3


def test_probe_ttl_must_be_finite() -> None:
    with pytest.raises(ValueError, match="ttl_seconds must be finite and >= 0, got -1"):
        DataDirProbe(Path("."), ttl_seconds=-1)
