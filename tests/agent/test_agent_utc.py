"""UTC everywhere: every DuckDB connection of the agent (and of ``kvscope sql --db``) uses
``TimeZone = 'UTC'`` whatever the host's ``TZ``; exported Parquet timestamps are UTC-adjusted;
the store's memory limit and threads are set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from agent.config import AgentConfig, ConfigError, config_from_mapping
from agent.maintenance import export_parquet
from agent.store import Store, utc_now

ROOT = Path(__file__).resolve().parents[2]
ZONES = ("UTC", "Asia/Kolkata", "America/Los_Angeles")
MINUTES_AGO = tuple(5 + 10 * k for k in range(10))  # 5, 15, ..., 95: six in the last hour
PROBE = """
import json, sys
from pathlib import Path
from agent import sql
from agent.store import Store
from kvscope.sql import run_sql
queries = {
    "recent": "SELECT count(*) AS n FROM tz_probe WHERE ts > now() - INTERVAL 1 HOUR",
    "zone": "SELECT current_setting('TimeZone') AS zone",
    "hours": "SELECT DISTINCT hour(ts::TIMESTAMPTZ) AS h FROM tz_probe ORDER BY h",
    "day": "SELECT strftime(TIMESTAMPTZ '2024-03-01 23:30:00+00', '%Y-%m-%d %H:%M') AS d",
}
out = {}
with Store.open(Path(sys.argv[1]), memory_limit_bytes=64 * 2**20, threads=1) as store:
    for name, query in queries.items():
        result = sql.run_read_query(store, query, row_limit=10, timeout_seconds=30)
        out[name] = sql.rows_of(result)
out["file"] = {name: json.loads(run_sql(query, db=Path(sys.argv[1]), agent=None, fmt="json"))["rows"] for name, query in queries.items()}
print(json.dumps(out, default=str))
"""


def test_the_same_query_gives_the_same_answer_under_every_host_time_zone(tmp_path: Path) -> None:
    db = tmp_path / "tz.duckdb"
    now = utc_now()
    with Store.open(db) as store, store.transaction() as cur:
        cur.execute("CREATE TABLE tz_probe (ts TIMESTAMP)")
        cur.executemany(
            "INSERT INTO tz_probe VALUES (?)", [[now - timedelta(minutes=m)] for m in MINUTES_AGO]
        )
    answers = {}
    for zone in ZONES:
        env = {**os.environ, "TZ": zone, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", PROBE, str(db)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        answers[zone] = json.loads(done.stdout)
    utc_hours = sorted({(now - timedelta(minutes=m)).hour for m in MINUTES_AGO})
    expected = {
        "recent": [[6]],
        "zone": [["UTC"]],
        "hours": [[h] for h in utc_hours],
        "day": [["2024-03-01 23:30"]],
    }
    for zone in ZONES:
        assert {k: v for k, v in answers[zone].items() if k != "file"} == expected, zone
        assert answers[zone]["file"] == expected, f"kvscope sql --db under TZ={zone}"


def test_exported_parquet_timestamps_are_utc_adjusted(
    loaded: TestClient, store: Store, tmp_path: Path
) -> None:
    export_dir = tmp_path / "export"
    done = export_parquet(store, export_dir, now=time.time() + 2 * 3600, lag_seconds=60)
    files = [path for part in done for path in part.files]
    assert files, "nothing was exported"
    checked = 0
    for path in files:
        schema = pq.read_metadata(path).schema
        for i in range(len(schema)):
            logical = json.loads(schema.column(i).logical_type.to_json())
            if logical.get("Type") == "Timestamp":
                assert logical["isAdjustedToUTC"] is True, (path.name, schema.column(i).name)
                checked += 1
    assert checked >= len(files)  # every table has at least its ts column
    lookups = next(p for p in files if p.name.startswith("cache_lookups"))
    with store.cursor() as cur:
        stored = {r[0] for r in cur.execute("SELECT ts FROM cache_lookups").fetchall()}
    read_back = pq.read_table(lookups).column("ts").to_pylist()
    assert {t.replace(tzinfo=None) for t in read_back} <= stored  # the same instants, marked UTC
    assert {str(t.tzinfo) for t in read_back} == {"UTC"}


def test_store_sets_the_memory_limit_threads_and_utc(tmp_path: Path) -> None:
    with (
        Store.open(tmp_path / "s.duckdb", memory_limit_bytes=256 * 2**20, threads=1) as store,
        store.cursor() as cur,
    ):
        got = cur.execute(
            "SELECT current_setting('memory_limit'), current_setting('threads'), current_setting('TimeZone')"
        ).fetchall()
    assert got == [("256.0 MiB", 1, "UTC")]


def test_new_limit_keys_are_validated() -> None:
    config = config_from_mapping(
        {
            "sql_max_concurrent_queries": 2,
            "sql_queue_timeout_seconds": 0,
            "duckdb_memory_limit_bytes": 2**30,
            "duckdb_threads": 3,
        }
    )
    assert (config.sql_max_concurrent_queries, config.sql_queue_timeout_seconds, config.duckdb_memory_limit_bytes, config.duckdb_threads) == (
        2, 0.0, 2**30, 3,
    )  # fmt: skip
    for key, value in (
        ("sql_max_concurrent_queries", 0),
        ("sql_queue_timeout_seconds", -1),
        ("duckdb_memory_limit_bytes", 1000),
        ("duckdb_threads", 0),
        ("duckdb_threads", 5000),
    ):
        with pytest.raises(ConfigError, match=key):
            config_from_mapping({key: value})
    assert AgentConfig().duckdb_memory_limit_bytes is None  # half of RAM, decided at open
