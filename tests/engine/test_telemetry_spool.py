"""The telemetry client's spool (engine/spool.py): batches the agent cannot take are kept on
disk and re-sent oldest first with their own seq; nothing is lost unless the spool's budget is
exhausted (then counted)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.events import EngineStats
from engine.events_arrow_check import batch_dict
from engine.spool import Spool
from engine.telemetry import TelemetryClient
from tests.helpers import numbered_stats


def stats(i: int, engine_id: str = "e-spool") -> EngineStats:
    return numbered_stats(engine_id, i)


class FlakyAgent:
    """An httpx transport standing in for the agent: refuses connections while ``down``,
    otherwise records each batch once per seq (like the agent's idempotent ingest)."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.batches: dict[int, list[int]] = {}
        self.deliveries = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down.is_set():
            raise httpx.ConnectError("agent down", request=request)
        if request.url.path != "/v1/events":  # an agent without durable watermarks
            return httpx.Response(404, json={"error": {"reason": "not found"}})
        body = batch_dict(request.content)
        self.deliveries += 1
        self.batches.setdefault(body["seq"], [e["used_bytes"] for e in body["events"]])
        return httpx.Response(200, json={"status": "stored"})

    def events(self) -> list[int]:
        return [e for seq in sorted(self.batches) for e in self.batches[seq]]


def client(agent: FlakyAgent, spool: Path, **kwargs: object) -> TelemetryClient:
    c = TelemetryClient("http://agent.invalid", "e-spool", batch_max_events=10, batch_max_seconds=0.02, spool_path=spool, **kwargs)  # type: ignore[arg-type]
    c._http = httpx.Client(transport=httpx.MockTransport(agent))
    return c


def emit(c: TelemetryClient, ids: range) -> None:
    for i in ids:
        c.emit(stats(i))


def wait_until(condition: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_an_unreachable_agent_gets_every_event_later_exactly_once_in_order(tmp_path: Path) -> None:
    agent = FlakyAgent()
    agent.down.set()
    c = client(agent, tmp_path / "e.spool")
    emit(c, range(50))
    assert c.flush(timeout_seconds=10)
    assert c.spooled_events == 50 and c.dropped_events == 0 and not agent.batches
    assert c.spool is not None and c.spool.pending_bytes > 0
    emit(c, range(50, 80))  # new events while the backlog waits: they queue behind it
    assert c.flush(timeout_seconds=10)
    agent.down.clear()
    # the sender counts a batch just after the spool marks it sent: wait for the count too
    wait_until(lambda: c.spool is not None and not c.spool and c.replayed_events == 80)
    assert agent.events() == list(range(80))  # everything, once, oldest first
    assert c.lost_events == 0
    assert (tmp_path / "e.spool").stat().st_size == 0  # drained: truncated
    c.close(timeout_seconds=5)


def test_a_restarted_engine_resends_the_previous_runs_spool_first(tmp_path: Path) -> None:
    agent = FlakyAgent()
    agent.down.set()
    first = client(agent, tmp_path / "e.spool")
    emit(first, range(25))
    assert first.flush(timeout_seconds=10)
    first.close(timeout_seconds=0.2)  # the agent is still down: the spool stays on disk
    assert first.spooled_events == 25
    agent.down.clear()
    second = client(agent, tmp_path / "e.spool")
    emit(second, range(25, 40))
    second.flush(timeout_seconds=10)
    wait_until(lambda: second.spool is not None and not second.spool and len(agent.events()) == 40)
    assert agent.events() == list(range(40))
    second.close(timeout_seconds=5)


def test_only_an_exhausted_spool_budget_drops_events_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    agent = FlakyAgent()
    agent.down.set()
    c = client(agent, tmp_path / "e.spool", spool_max_bytes=20_000)
    emit(c, range(200))
    assert c.flush(timeout_seconds=20)
    assert c.dropped_events > 0 and c.spooled_events > 0 and c.spooled_events + c.dropped_events == 200
    assert "DROPPED" in caplog.text
    c.close(timeout_seconds=0.2)


def test_a_torn_record_ends_the_spool_and_is_counted(tmp_path: Path) -> None:
    path = tmp_path / "e.spool"
    spool = Spool(path, 1 << 20)
    assert spool.append(b"first", 1) and spool.append(b"second", 2)
    spool.close()
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # a crash cut the last append short
    again = Spool(path, 1 << 20)
    assert again.peek() == (b"first", 1)
    again.pop()
    assert again.peek() is None and again.corrupt_records == 1 and not again
    assert path.stat().st_size == 0
    again.close()


def test_a_delivered_prefix_is_remembered_across_restarts(tmp_path: Path) -> None:
    path = tmp_path / "e.spool"
    spool = Spool(path, 1 << 20)
    for i in range(3):
        assert spool.append(f"batch{i}".encode(), i + 1)
    assert spool.peek() == (b"batch0", 1)
    spool.pop()
    spool.close()
    reopened = Spool(path, 1 << 20)
    assert reopened.peek() == (b"batch1", 2)
    reopened.close()
    with pytest.raises(ValueError, match="budget"):
        Spool(path, 0)
