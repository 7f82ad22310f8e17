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

from engine.events import EngineStats
from engine.events_arrow_check import batch_dict
from engine.spool import _OFFSET, Spool
from engine.telemetry import TelemetryClient
from tests.helpers import numbered_stats


def stats(i: int) -> EngineStats:
    return numbered_stats("e-durable", i)


class DurableAgent:
    """An httpx transport standing in for an agent with durable watermarks (agent/durability.py):
    stores each seq once, answers with its checkpoint epoch, makes what it stored durable on
    :meth:`checkpoint` (the epoch moves), and on :meth:`restart` loses what was not durable (a
    damaged WAL) and answers as a new process, which checkpoints at start (epoch 1)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.instance = uuid.uuid4().hex
        self.batches: dict[int, list[int]] = {}
        self.durable: set[int] = set()
        self.epoch = 1
        self.posts = 0

    def checkpoint(self) -> None:
        with self.lock:
            self.durable = set(self.batches)
            self.epoch += 1

    def restart(self, *, lose_wal: bool) -> None:
        with self.lock:
            if lose_wal:
                self.batches = {s: ids for s, ids in self.batches.items() if s in self.durable}
            self.durable = set(self.batches)
            self.instance = uuid.uuid4().hex
            self.epoch = 1

    def watermark(self) -> dict[str, object]:
        return {"checkpoint_epoch": self.epoch, "durable_seq": max(self.durable, default=None), "agent_instance": self.instance}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/ingest/checkpoint":
            self.checkpoint()
        if request.url.path != "/v1/events":
            with self.lock:
                return httpx.Response(200, json={"engine_id": "e-durable", **self.watermark()})
        body = batch_dict(request.content)
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
    # the sender thread releases the records, then truncates the file: wait for both
    wait_until(lambda: c.spool is not None and c.spool.awaiting_records == 0 and (tmp_path / "e.spool").stat().st_size == 0)
    assert c.resent_events == 0 and c.sent_events == 50
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
    # noticed at the next poll, re-sent; the agent holds a batch before the sender counts it
    wait_until(lambda: c.resent_events == 30)
    assert agent.events() == list(range(50)) and c.lost_events == 0
    c.close(timeout_seconds=5)  # the close makes the rest durable and releases it
    assert agent.durable == set(range(5)) and (tmp_path / "e.spool").stat().st_size == 0


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
        spool.sent(i // 20)  # the first 20 acknowledged at epoch 0, the rest at epoch 1
    spool.release(1)  # epoch 1: 20 records durable, 2 MB before the 1 MB still awaiting, so compacted
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
    spool.release(1)
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
    record = 12 + 1000
    spool = Spool(path, 8 * record)
    for i in range(8):
        assert spool.append(bytes([i]) * 1000, 1)
    for _ in range(7):
        spool.sent(0)  # acknowledged, none durable yet: one record unsent
    assert spool.append(b"y" * 1000, 1)  # room: the oldest acknowledged given up, a quarter besides
    assert spool.released_records == 3 and spool.awaiting_records == 4
    assert path.stat().st_size == 6 * record  # compacted once for the next appends too
    assert spool.append(b"z" * 1000, 1) and spool.released_records == 3  # no copy, no release
    assert not spool.append(b"w" * 9000, 1)  # larger than the whole budget: refused ...
    assert spool.released_records == 3 and spool.awaiting_records == 4  # ... giving up nothing
    spool.rewind()
    assert spool.peek() == (bytes([3]) * 1000, 1)  # the oldest kept record is sent again first
    spool.close()


def test_a_backlog_that_fills_the_budget_refuses_without_giving_up_acknowledged_records(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "e.spool", 4 * (12 + 1000))
    for _ in range(4):
        assert spool.append(b"x" * 1000, 1)
    spool.sent(0)  # one acknowledged, three unsent: releasing it would not make room for 3000 bytes
    assert not spool.append(b"y" * 3000, 1)
    assert spool.released_records == 0 and spool.awaiting_records == 1
    spool.close()


def test_a_page_that_is_not_the_agents_neither_stops_the_sender_nor_releases_anything(tmp_path: Path) -> None:
    agent = DurableAgent()
    proxy_pages = {"left": 5}

    def behind_a_proxy(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/ingest/watermark" and proxy_pages["left"] > 0:
            proxy_pages["left"] -= 1
            return httpx.Response(200, text="<html>maintenance</html>") if proxy_pages["left"] % 2 else httpx.Response(502)
        return agent(request)

    c = client(agent, tmp_path / "e.spool")
    c._http = httpx.Client(transport=httpx.MockTransport(behind_a_proxy))
    send(c, range(20))
    agent.checkpoint()
    wait_until(lambda: c.spool is not None and c.spool.awaiting_records == 0)  # the real answer, at last
    assert proxy_pages["left"] == 0 and c._thread.is_alive()
    send(c, range(20, 30))  # and the sender still sends
    assert agent.events() == list(range(30))
    c.close(timeout_seconds=5)


def test_an_agent_replaced_by_one_without_watermarks_gets_what_was_not_durable_again(tmp_path: Path) -> None:
    agent = DurableAgent()
    c = client(agent, tmp_path / "e.spool")
    send(c, range(30))
    legacy: dict[int, list[int]] = {}

    def older_agent(request: httpx.Request) -> httpx.Response:  # stores, answers without epochs
        if request.url.path != "/v1/events":
            return httpx.Response(404, json={"error": {"reason": "not found"}})
        body = batch_dict(request.content)
        legacy.setdefault(body["seq"], [e["used_bytes"] for e in body["events"]])
        return httpx.Response(200, json={"status": "stored", "events": len(body["events"])})

    c._http = httpx.Client(transport=httpx.MockTransport(older_agent))
    # noticed at the next poll: all three re-sent (the transport stores a batch before the
    # sender thread counts it, so wait for the count, then look at what arrived)
    wait_until(lambda: c.resent_events == 30)
    assert sorted(legacy) == [0, 1, 2] and legacy[2] == [20 + i for i in range(10)]
    assert c.spool is not None and c.spool.awaiting_records == 0
    c.close(timeout_seconds=5)
    assert (tmp_path / "e.spool").stat().st_size == 0
