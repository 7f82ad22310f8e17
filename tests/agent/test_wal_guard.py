"""A damaged WAL (agent/wal_guard.py, agent/startup.py): the agent opens the database whatever
the damage — a flipped byte, an overwritten header, a truncation, garbage appended — quarantines
what it cannot replay (bytes kept), and names exactly the acknowledged batches it lost, even when
DuckDB itself replays short without an error."""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent import wal_guard
from agent.durability import AckLog, ack_log_path
from agent.health import Health
from agent.seq_tracker import SeqTracker
from agent.startup import open_guarded_store
from agent.wal_guard import DatabaseUnusableError, wal_path
from tests.agent_process import ROOT, agent_env

BATCHES = 40

# An agent's store and acknowledgement log, one batch per commit, killed before any checkpoint:
# its batches are only in the WAL.
_WRITER = """
import os, sys, time
from collections.abc import Callable
from pathlib import Path
from agent.durability import AckLog, ack_log_path
from agent.ingest import prepare_batch, write_batches
from agent.seq_tracker import SeqTracker
from agent.store import Store, utc_now
from engine.events import EngineStats, EventBatch, Form, Tier
from datetime import timedelta
db = Path(sys.argv[1])
store = Store.open(db, wal_autocheckpoint_bytes=1 << 30)
store.checkpoint()
log = AckLog(ack_log_path(db))
tracker = SeqTracker.load(store)
at = utc_now()
for seq in range(int(sys.argv[2])):
    event = EngineStats(ts=1.7e9 + seq, engine_id="e1", model="m", form=Form.FULL_KV, tier=Tier.DEVICE,
                        used_bytes=seq, used_blocks=0, cached_blocks=0, free_blocks=0, total_blocks=1)
    batch = prepare_batch(EventBatch(schema_version=1, engine_id="e1", seq=seq, sent_at=0.0, events=[event]))
    outcomes = write_batches(store, tracker, [batch], ingested_at=at + timedelta(microseconds=seq))
    log.append((o.engine_id, o.seq) for o in outcomes if o.status == "stored")
os._exit(0)
"""


def stored_batches(db: Path) -> int:
    pairs, _ = AckLog.read(ack_log_path(db))
    return len(pairs)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "data" / "kvscope.duckdb"
    path.parent.mkdir()
    subprocess.run([sys.executable, "-c", _WRITER, str(path), str(BATCHES)], cwd=ROOT, env=agent_env(), check=True, timeout=120)
    assert wal_path(path).stat().st_size > 0 and stored_batches(path) == BATCHES
    return path


def flip(at: float) -> Callable[[bytes], bytes]:
    def damage(data: bytes) -> bytes:
        i = min(int(len(data) * at), len(data) - 1)
        return data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1 :]

    return damage


DAMAGES = {
    "flip_first_byte": flip(0.0),
    "flip_middle_byte": flip(0.5),
    "flip_last_byte": flip(1.0),
    "header_overwritten": lambda data: b"\xff" * 64 + data[64:],
    "truncated_by_1": lambda data: data[:-1],
    "truncated_by_half": lambda data: data[: len(data) // 2],
    "garbage_appended": lambda data: data + bytes(range(256)) * 2,
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_every_damage_opens_and_names_the_lost_batches_exactly(db: Path, damage: str) -> None:
    wal = wal_path(db)
    original = wal.read_bytes()
    damaged = DAMAGES[damage](original)
    wal.write_bytes(damaged)
    health = Health()
    registry = CollectorRegistry()
    guarded = open_guarded_store(db, health=health, registry=registry)
    try:
        guarded.durability.attach(SeqTracker.load(guarded.store))
        guarded.start()  # checkpoint: the log is emptied, the watermark stays below the lost batches
        with guarded.store.cursor() as cur:
            kept = {r[0] for r in cur.execute("SELECT seq FROM ingest_batches WHERE status = 'stored'").fetchall()}
            rows = cur.execute("SELECT count(*) FROM engine_stats").fetchall()[0][0]
        assert rows == len(kept) and kept == set(range(len(kept)))  # a prefix survives, whole batches
        lost = sorted(set(range(BATCHES)) - kept)
        assert guarded.missing == ({"e1": lost} if lost else {})
        # durable: every batch in the file, none of the lost ones (the engine re-sends from there)
        assert guarded.durability.durable_seq("e1") == (max(kept) if kept else None)
        assert guarded.durability.awaiting_resend() == len(lost)
        reasons = [d.reason for d in health.degraded]
        if lost:
            assert "acknowledged_batches_missing" in reasons
            assert registry.get_sample_value("kvscope_store_acknowledged_batches_missing_total") == len(lost)
            # the evidence: the WAL's bytes as they were before the open, in the quarantine folder
            assert guarded.quarantined and all(p.parent == db.parent / "quarantine" for p in guarded.quarantined)
            assert any(p.read_bytes() == damaged for p in guarded.quarantined)
        else:
            assert damage == "garbage_appended" and reasons == [] and not guarded.quarantined
        assert registry.get_sample_value("kvscope_store_wal_quarantined_total") == len(guarded.quarantined)
        assert not wal.with_name(wal.name + ".preflight").exists()
    finally:
        guarded.durability.ack_log.close()
        guarded.store.close()
    # the next start is clean: nothing more is quarantined, nothing reported missing
    again = open_guarded_store(db, health=(quiet := Health()), registry=CollectorRegistry())
    try:
        assert again.missing == {} and quiet.degraded == () and not again.quarantined
    finally:
        again.durability.ack_log.close()
        again.store.close()


def test_a_replay_failure_is_quarantined_not_a_crash_loop(db: Path) -> None:
    wal = wal_path(db)
    data = wal.read_bytes()
    wal.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # DuckDB: "Corrupt WAL file ... checksum"
    health = Health()
    guarded = open_guarded_store(db, health=health, registry=CollectorRegistry())
    try:
        (quarantined,) = [d for d in health.degraded if d.reason == "wal_quarantined"]
        assert "checksum" in quarantined.detail or "Corrupt" in quarantined.detail
        assert not wal.exists()
    finally:
        guarded.durability.ack_log.close()
        guarded.store.close()


def test_a_damaged_database_file_is_a_clear_error_not_a_quarantine(tmp_path: Path) -> None:
    db = tmp_path / "kvscope.duckdb"
    db.write_bytes(b"this is not a DuckDB file" * 100)
    with pytest.raises(DatabaseUnusableError, match="cannot open"):
        open_guarded_store(db, health=Health(), registry=CollectorRegistry())
    assert db.exists() and not (tmp_path / "quarantine").exists()


def test_a_damaged_database_file_with_its_wal_leaves_the_wal_in_place(db: Path) -> None:
    wal = wal_path(db)
    before = wal.read_bytes()
    data = bytearray(db.read_bytes())
    data[: 8192] = b"\xee" * 8192  # the file's headers
    db.write_bytes(bytes(data))
    with pytest.raises(DatabaseUnusableError, match="left in place"):
        open_guarded_store(db, health=Health(), registry=CollectorRegistry())
    assert wal.read_bytes() == before and not (db.parent / "quarantine").exists()


def test_a_full_disk_is_a_clear_error_never_a_quarantine(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_run = subprocess.run

    def small_files(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        def limit() -> None:  # the child may write no file larger than the ones it has: ENOSPC-like
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))

        return real_run(*args, preexec_fn=limit, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(wal_guard.subprocess, "run", small_files)
    wal = wal_path(db)
    before = wal.read_bytes()
    with pytest.raises(DatabaseUnusableError, match="File too large") as raised:
        open_guarded_store(db, health=Health(), registry=CollectorRegistry())
    assert "left in place" in str(raised.value)
    assert wal.read_bytes().startswith(before) and not (db.parent / "quarantine").exists()
    monkeypatch.undo()  # room again: every acknowledged batch is still there
    again = open_guarded_store(db, health=(health := Health()), registry=CollectorRegistry())
    try:
        assert again.missing == {} and health.degraded == ()
    finally:
        again.durability.ack_log.close()
        again.store.close()


def test_an_unwritable_quarantine_folder_is_a_clear_error(db: Path) -> None:
    (db.parent / "quarantine").write_text("a file where the folder should be")
    wal = wal_path(db)
    data = wal.read_bytes()
    wal.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(DatabaseUnusableError, match="quarantine folder"):
        open_guarded_store(db, health=Health(), registry=CollectorRegistry())
    assert wal.exists()


def test_another_process_holding_the_file_is_not_damage(db: Path) -> None:
    import duckdb

    holder = subprocess.Popen(
        [sys.executable, "-c", "import duckdb, sys, time; con = duckdb.connect(sys.argv[1]); print('held', flush=True); time.sleep(60)", str(db)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        before = wal_path(db).exists()
        with pytest.raises(duckdb.IOException, match="Conflicting lock"):
            open_guarded_store(db, health=Health(), registry=CollectorRegistry())
        assert not (db.parent / "quarantine").exists() and wal_path(db).exists() == before
    finally:
        holder.kill()
        holder.wait()
