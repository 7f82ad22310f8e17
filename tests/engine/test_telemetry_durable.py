"""End-to-end acknowledgement on the engine's side (engine/spool.py, engine/telemetry.py): a batch
the agent acknowledged stays in the spool until the agent's durable watermark passes it; an agent
that restarted having lost its WAL gets what it lacks again, once; the spool compacts what is
durable and never loses a record across a crash in the middle of a compaction."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec

from engine.events import EngineStats, Form, Tier
from engine.spool import _OFFSET, Spool
from engine.telemetry import TelemetryClient


def stats(i: int) -> EngineStats:
    return EngineStats(
        ts=1_700_000_000.0 + i,
        engine_id="e-durable",
        model="m",
        form=Form.FULL_KV,
        tier=Tier.DEVICE,
        used_bytes=i,
        used_blocks=0,
        cached_blocks=0,
        free_blocks=0,
        total_blocks=1,
    )


class DurableAgent:
    """An httpx transport standing in for an agent with durable watermarks: stores each seq
    once, makes what it stored durable on :meth:`checkpoint`, and on :meth:`restart` loses what
    was not durable (a damaged WAL) and answers as a new process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.instance = uuid.uuid4().hex
        self.batches: dict[int, list[int]] = {}
        self.durable = -1
        self.posts = 0

    def checkpoint(self) -> None:
        with self.lock:
            self.durable = max(self.batches, default=-1)

    def restart(self, *, lose_wal: bool) -> None:
        with self.lock:
            if lose_wal:
                self.batches = {s: ids for s, ids in self.batches.items() if s <= self.durable}
            self.instance = uuid.uuid4().hex

    def watermark(self) -> dict[str, object]:
        return {"durable_seq": self.durable if self.durable >= 0 else None, "agent_instance": self.instance}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/ingest/checkpoint":
            self.checkpoint()
        if request.url.path != "/v1/events":
            with self.lock:
                return httpx.Response(200, json={"engine_id": "e-durable", **self.watermark()})
        body = msgspec.msgpack.decode(request.content)
        with self.lock:
            self.posts += 1
            status = "duplicate" if body["seq"] in self.batches else "stored"
            self.batches.setdefault(body["seq"], [e["used_bytes"] for e in body["events"]])
            return httpx.Response(200, json={"status": status, "events": len(body["events"]), "seq": body["seq"], **self.watermark()})

    def events(self) -> list[int]:
        with self.lock:
            return [e for seq in sorted(self.batches) for e in self.batches[seq]]


def client(agent: DurableAgent, spool: Path) -> TelemetryClient:
    c = TelemetryClient(
        "http://agent.invalid", "e-durable", batch_max_events=10, batch_max_seconds=0.01, spool_path=spool, watermark_poll_seconds=0.02
    )
    c._http = httpx.Client(transport=httpx.MockTransport(agent))
    return c


def send(c: TelemetryClient, ids: range) -> None:
    for i in ids:
        c.emit(stats(i))
    assert c.flush(timeout_seconds=10)
    wait_until(lambda: c.spool is not None and not c.spool)  # all acknowledged


def wait_until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_acknowledged_batches_stay_in_the_spool_until_the_agent_makes_them_durable(tmp_path: Path) -> None:
    agent = DurableAgent()
    c = client(agent, tmp_path / "e.spool")
    send(c, range(50))
    assert c.spool is not None
    time.sleep(0.1)  # several watermark polls: nothing durable yet, so nothing released
    assert c.spool.awaiting_records == 5 and (tmp_path / "e.spool").stat().st_size > 0
    agent.checkpoint()
    wait_until(lambda: c.spool is not None and c.spool.awaiting_records == 0)
    assert (tmp_path / "e.spool").stat().st_size == 0 and c.resent_events == 0 and c.sent_events == 50
    c.close(timeout_seconds=5)


def test_an_agent_restarted_without_its_wal_gets_the_lost_batches_again_exactly_once(tmp_path: Path) -> None:
    agent = DurableAgent()
    c = client(agent, tmp_path / "e.spool")
    send(c, range(20))
    agent.checkpoint()  # seqs 0, 1 durable
    wait_until(lambda: c.spool is not None and c.spool.awaiting_records == 0)
    send(c, range(20, 50))  # seqs 2..4 acknowledged, in the WAL only
    agent.restart(lose_wal=True)
    assert agent.events() == list(range(20))
    wait_until(lambda: agent.events() == list(range(50)))  # noticed at the next poll, re-sent
    assert c.resent_events == 30 and c.lost_events == 0
    c.close(timeout_seconds=5)  # the close makes the rest durable and releases it
    assert agent.durable == 4 and (tmp_path / "e.spool").stat().st_size == 0


def test_an_agent_restarted_with_its_wal_gets_duplicates_at_most(tmp_path: Path) -> None:
    agent = DurableAgent()
    c = client(agent, tmp_path / "e.spool")
    send(c, range(30))
    agent.restart(lose_wal=False)
    wait_until(lambda: c.resent_events == 30)
    assert agent.events() == list(range(30)) and agent.posts == 6  # three re-sent, as duplicates
    c.close(timeout_seconds=5)


def test_durable_records_are_compacted_away_and_the_rest_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "e.spool"
    spool = Spool(path, 64 << 20)
    payload = [bytes([i]) * 100_000 for i in range(30)]
    for i, data in enumerate(payload):
        assert spool.append(data, i + 1)
    for i in range(30):
        spool.sent(i)
    spool.release(19)  # 20 records durable: 2 MB before the 1 MB still awaiting, so compacted
    assert path.stat().st_size == spool.pending_bytes == 10 * (100_000 + 12)
    assert spool.awaiting_records == 10
    spool.close()
    reopened = Spool(path, 64 << 20)  # an engine restarted: what was not durable is sent again
    assert reopened.peek() == (payload[20], 21) and reopened.pending_bytes == 10 * (100_000 + 12)
    reopened.close()


def test_a_crash_between_saving_the_offset_and_the_rename_replays_duplicates_never_loses(tmp_path: Path) -> None:
    path = tmp_path / "e.spool"
    spool = Spool(path, 1 << 20)
    for i in range(3):
        assert spool.append(f"batch{i}".encode(), 1)
    spool.sent(0)
    spool.release(0)
    spool.close()
    offset_file = path.with_name(path.name + ".offset")
    offset, inode = _OFFSET.unpack(offset_file.read_bytes())
    assert offset > 0 and inode == path.stat().st_ino
    # a compaction saved "offset 0 of the new file", then the process died before the rename
    offset_file.write_bytes(_OFFSET.pack(0, inode + 1))
    reopened = Spool(path, 1 << 20)
    assert reopened.peek() == (b"batch0", 1)  # the old file from its start: a duplicate, no loss
    reopened.close()


def test_a_full_budget_releases_acknowledged_records_before_refusing_new_ones(tmp_path: Path) -> None:
    path = tmp_path / "e.spool"
    spool = Spool(path, 3 * (12 + 1000))
    for _ in range(3):
        assert spool.append(b"x" * 1000, 1)
    spool.sent(0)
    spool.sent(1)
    assert spool.append(b"y" * 1000, 1)  # room made by giving up seq 0 (acknowledged, committed)
    assert spool.released_records == 1 and spool.awaiting_records == 1
    assert not spool.append(b"z" * 5000, 1)  # larger than the whole budget: refused
    assert spool.peek() == (b"x" * 1000, 1)  # the unsent record is still next
    spool.close()
