"""Health, readiness, bearer token, store restart and migrations, config loading."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from agent_testdata import batch, json_body, known_events, lookup_event, minute_start, request_event
from fastapi.testclient import TestClient

from agent.app import create_app
from agent.config import AgentConfig, ConfigError, load_config
from agent.ingest import ingest_batch
from agent.migrations import MIGRATIONS, SCHEMA_VERSION
from agent.store import Store, StoreClosedError, utc_now
from engine.events import decode_batch

JSON = {"content-type": "application/json"}


def test_healthz_and_readyz(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {
        "status": "ready",
        "schema_version": SCHEMA_VERSION,
        "degraded": [],
        "limits": {"sql_timeout_seconds": 0.5, "sql_queue_timeout_seconds": 2.0},  # the agent's query limits
    }


def test_app_owning_its_store_is_ready_only_inside_its_lifespan(config: AgentConfig) -> None:
    app = create_app(config, environ={})
    outside = TestClient(app)  # no lifespan: the store was never opened
    assert outside.get("/healthz").status_code == 200
    assert outside.get("/readyz").status_code == 503
    with TestClient(app) as inside:
        assert inside.get("/readyz").status_code == 200
        assert inside.post("/v1/sql", json={"sql": "SELECT 1 AS one"}).json()["rows"] == [[1]]
    assert app.state.store is None
    with Store.open(config.db_path) as reopened:  # released on shutdown
        assert reopened.open_report.applied == ()


@pytest.mark.parametrize("source", ["config", "env"])
def test_bearer_token_required_except_healthz(
    config: AgentConfig, store: Store, source: str
) -> None:
    if source == "config":
        app = create_app(dataclasses.replace(config, token="s3cret"), store, environ={})
    else:
        app = create_app(config, store, environ={"KVSCOPE_TOKEN": "s3cret"})
    with TestClient(app) as client:
        assert client.get("/healthz").status_code == 200
        for method, path in [
            ("GET", "/readyz"),
            ("GET", "/metrics"),
            ("GET", "/v1/query/totals"),
            ("POST", "/v1/sql"),
            ("POST", "/v1/events"),
            ("GET", "/no/such/path"),
        ]:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
                response = client.request(method, path, headers=headers)
                assert response.status_code == 401, (method, path, headers)
                assert response.headers["www-authenticate"] == "Bearer"
                assert response.json() == {"error": {"reason": "missing or wrong bearer token"}}
        good = {"authorization": "Bearer s3cret"}
        assert client.get("/readyz", headers=good).status_code == 200
        assert client.get("/v1/query/totals", headers=good).json()["rows"][0][0] == 0
        assert client.get("/no/such/path", headers=good).status_code == 404


def test_restart_keeps_data_and_does_not_rerun_migrations(config: AgentConfig, base: int) -> None:
    first = Store.open(config.db_path)
    assert first.open_report.applied == tuple(m.version for m in MIGRATIONS)
    with TestClient(create_app(config, first, environ={})) as client:
        response = client.post(
            "/v1/events", content=json_body(batch(1, known_events(base))), headers=JSON
        )
        assert response.json() == {"status": "stored", "events": 8}
    with first.cursor() as cur:
        migrations_before = cur.execute("SELECT * FROM schema_migrations").fetchall()
    first.close()
    first.close()  # idempotent
    with pytest.raises(StoreClosedError), first.cursor():
        pass

    second = Store.open(config.db_path)
    try:
        assert second.open_report.applied == ()
        assert second.schema_version == SCHEMA_VERSION
        with second.cursor() as cur:
            assert cur.execute("SELECT * FROM schema_migrations").fetchall() == migrations_before
            assert cur.execute("SELECT count(*) FROM requests").fetchall() == [(2,)]
        with TestClient(create_app(config, second, environ={})) as client:
            again = client.post(
                "/v1/events", content=json_body(batch(1, known_events(base))), headers=JSON
            )
            assert again.json() == {"status": "duplicate", "events": 8}
    finally:
        second.close()


def test_store_is_locked_down(store: Store, tmp_path: Path) -> None:
    import duckdb

    with store.cursor() as cur:
        with pytest.raises(duckdb.Error, match="locked"):
            cur.execute("SET enable_external_access = true")
        with pytest.raises(duckdb.PermissionException):
            cur.execute(f"COPY requests TO '{tmp_path / 'x.csv'}'")
    assert not (tmp_path / "x.csv").exists()


def test_failed_transaction_rolls_back(store: Store) -> None:
    with pytest.raises(RuntimeError, match="boom"), store.transaction() as cur:
        cur.execute(
            "INSERT INTO ingest_batches (engine_id, seq, received_at, rows, status) "
            "VALUES ('e1', 1, now()::TIMESTAMP, 0, 'stored')"
        )
        raise RuntimeError("boom")
    with store.cursor() as cur:
        assert cur.execute("SELECT count(*) FROM ingest_batches").fetchall() == [(0,)]


def test_load_config(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(
        "host: 0.0.0.0\nport: 9500\ndata_dir: /var/lib/kvscope\ntoken: t0k\n"
        "sql_timeout_seconds: 2\nalert_rules_file: /etc/kvscope/rules.yaml\nalert_interval_seconds: null\n"
        "alert_notify_file: notify.yaml\nexternal_url: https://kvscope.example/\n"
    )
    config = load_config(path)
    assert config == AgentConfig(
        host="0.0.0.0",
        port=9500,
        data_dir=Path("/var/lib/kvscope"),
        token="t0k",
        sql_timeout_seconds=2.0,
        alert_rules_file=Path("/etc/kvscope/rules.yaml"),
        alert_notify_file=Path("notify.yaml"),
        external_url="https://kvscope.example/",
    )
    assert config.db_path == Path("/var/lib/kvscope/kvscope.duckdb")
    assert config.alert_log_path == Path("/var/lib/kvscope/alerts.log")
    assert config.agent_url == "https://kvscope.example/"
    assert AgentConfig(host="10.0.0.1", port=9401).agent_url == "http://10.0.0.1:9401"
    overridden = dataclasses.replace(config, port=9600, data_dir=tmp_path)
    assert (overridden.port, overridden.host, overridden.data_dir) == (9600, "0.0.0.0", tmp_path)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == AgentConfig()


def test_load_config_buffers_retention_export(tmp_path: Path) -> None:
    """The issue-6 keys: the ingest buffer and its full policy, decode workers, retention,
    export and checkpoints, all from one YAML file."""
    path = tmp_path / "agent.yaml"
    path.write_text(
        "data_dir: /srv/kvscope\ndecode_processes: 0\ningest_queue_max_events: 5000\n"
        "ingest_full_policy: block\ningest_block_timeout_seconds: 2\nflush_max_events: 2000\n"
        "rollup_interval_seconds: 30\nraw_retention_hours: 24\nrollup_retention_days: null\n"
        "export_enabled: false\nexport_dir: /srv/parquet\nexport_lag_seconds: 300\n"
        "checkpoint_interval_seconds: 60\ncheckpoint_wal_bytes: 1048576\ngpu_sample_seconds: null\n"
    )
    config = load_config(path)
    assert config == AgentConfig(
        data_dir=Path("/srv/kvscope"),
        decode_processes=0,
        ingest_queue_max_events=5000,
        ingest_full_policy="block",
        ingest_block_timeout_seconds=2.0,
        flush_max_events=2000,
        rollup_interval_seconds=30.0,
        raw_retention_hours=24.0,
        rollup_retention_days=None,
        export_enabled=False,
        export_dir=Path("/srv/parquet"),
        export_lag_seconds=300,
        checkpoint_interval_seconds=60.0,
        checkpoint_wal_bytes=1048576,
        gpu_sample_seconds=None,
    )
    assert config.parquet_dir == Path("/srv/parquet")
    assert AgentConfig(data_dir=Path("/d")).parquet_dir == Path("/d/export")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prot: 9400\n", "unknown key 'prot'; known keys: host, port,"),
        ("port: '9400'\n", "key 'port' must be int, got str '9400'"),
        ("port: true\n", "key 'port' must be int, got bool True"),
        ("token: 5\n", "key 'token' must be str or null, got int 5"),
        ("port: 70000\n", "port must be in [0, 65535], got 70000"),
        ("alert_threshold: 0.5\n", "key 'alert_threshold' was removed: the built-in RecoverableHitRateLow rule was replaced by rule files"),
        ("external_url: kvscope.local\n", "external_url must be an http(s) URL, got 'kvscope.local'"),
        ("- 1\n- 2\n", "expected a mapping of settings, got list"),
        ("port: [\n", "invalid YAML"),
        ("ingest_full_policy: drop\n", "ingest_full_policy must be one of reject, block, got 'drop'"),
        ("export_enabled: 1\n", "key 'export_enabled' must be bool, got int 1"),
        ("raw_retention_hours: 0\n", "raw_retention_hours must be > 0 or null, got 0.0"),
        ("decode_processes: -1\n", "decode_processes must be >= 0, got -1"),
        ("raw_retention_hours: .inf\n", "raw_retention_hours must be a finite number, got inf"),
        ("raw_retention_hours: 1.0e+8\n", "raw_retention_hours must be at most 876000, got 1e+08"),
        ("ingest_block_timeout_seconds: 1.0e+10\n", "ingest_block_timeout_seconds must be at most 3600, got 1e+10"),
        ("ingest_block_timeout_seconds: .nan\n", "ingest_block_timeout_seconds must be a finite number, got nan"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.yaml")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sql_row_limit": 0}, "sql_row_limit must be >= 1, got 0"),
        ({"sql_timeout_seconds": 0.0}, "sql_timeout_seconds must be > 0, got 0.0"),
        ({"alert_ingest_lag_seconds": 60}, "alert_ingest_lag_seconds must be in [0, 59], got 60"),
        ({"token": ""}, "token must not be empty"),
    ],
)
def test_config_validation(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        AgentConfig(**changes)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_a_version_1_database_is_upgraded_in_place(tmp_path: Path) -> None:
    """Migration 2 adds the admission's predicted and actual seconds to ``requests``; rows
    stored under version 1 keep their values and read 0 there. Migration 3 follows; a batch
    stored before it (no digest) is still a duplicate when re-sent. Migration 5 marks the alert
    rows already there as transitions."""
    import duckdb

    from agent.store import _migrate

    path = tmp_path / "v1.duckdb"
    con = duckdb.connect(str(path))
    _migrate(con, MIGRATIONS[:1])
    con.execute(
        "INSERT INTO requests VALUES (now()::TIMESTAMP, 'e1', 'r1', 'm1', 100, 1, 64, 64, 64, 0, 36, false, "
        "NULL, 'none', 'exact', 0.5, 0.6, now()::TIMESTAMP)"
    )
    con.execute("INSERT INTO ingest_batches VALUES ('e1', 0, now()::TIMESTAMP, 8, 'stored', NULL)")
    con.execute("INSERT INTO alerts VALUES (now()::TIMESTAMP, 'A', 'f1', 'firing', 0.5, '{}', 's', 'd')")
    con.close()
    store = Store.open(path)
    try:
        assert store.open_report.applied == (2, 3, 4, 5, 6, 7, 8, 9, 10, 11)
        assert store.schema_version == SCHEMA_VERSION
        with store.cursor() as cur:  # migration 5: old alert rows are transitions
            assert cur.execute("SELECT state, event, receiver, error FROM alerts").fetchall() == [("firing", "transition", None, None)]
        resent = ingest_batch(store, decode_batch(json_body(batch(0, known_events(minute_start())))), received_at=utc_now())
        assert resent.status == "duplicate"
        with store.cursor() as cur:
            rows = cur.execute(
                "SELECT request_id, ttft_seconds, predicted_seconds, actual_seconds, limiting_forms FROM requests"
            ).fetchall()
        assert rows == [("r1", 0.5, 0.0, 0.0, [])]
    finally:
        store.close()


def test_a_version_8_database_gains_limiting_forms_and_keeps_its_rows(tmp_path: Path) -> None:
    """Migration 9 adds ``requests.limiting_forms``: a request stored under version 8 keeps every
    value and reads [] there; after it a tie is stored as a list, and a ``tier_incomplete``
    lookup (a reason newer than the stored rows: reasons are VARCHAR) is accepted."""
    import duckdb

    from agent.store import _migrate

    path = tmp_path / "v8.duckdb"
    con = duckdb.connect(str(path))
    _migrate(con, MIGRATIONS[:8])
    con.execute(
        "INSERT INTO requests VALUES (now()::TIMESTAMP, 'e1', 'r-old', 'm1', 100, 1, 64, 48, 48, 0, 52, false, "
        "'swa_window', 'swa_evicted', 'exact', 0.5, 0.6, now()::TIMESTAMP, 0.2, 0.3)"
    )
    con.close()
    with Store.open(path) as store:
        assert store.open_report.applied == (9, 10, 11) and store.schema_version == SCHEMA_VERSION == 11
        tie = request_event(
            minute_start() + 1, "r-tie", hash_hit_tokens=64, resume_tokens=48, recoverable_tokens=48, recomputed_tokens=952,
            limiting_form="full_kv", limiting_reason="tier_incomplete", limiting_forms=["full_kv", "swa_window"],
        )  # fmt: skip
        lost = {"tier": "host", "outcome": "invalidated", "reason": "tier_incomplete"}
        tier = lookup_event(minute_start() + 1, "r-tie", **lost)
        body = json_body(batch(1, [tier, tie]))
        stored = ingest_batch(store, decode_batch(body), received_at=utc_now())
        assert stored.status == "stored"
        with store.cursor() as cur:
            requests = cur.execute(
                "SELECT request_id, resume_tokens, limiting_form, limiting_reason, predicted_seconds, actual_seconds, "
                "limiting_forms FROM requests ORDER BY request_id"
            ).fetchall()
            reasons = cur.execute("SELECT reason FROM cache_lookups").fetchall()
        assert requests == [
            ("r-old", 48, "swa_window", "swa_evicted", 0.2, 0.3, []),
            ("r-tie", 48, "full_kv", "tier_incomplete", 0.0, 0.0, ["full_kv", "swa_window"]),
        ]
        assert reasons == [("tier_incomplete",)]
