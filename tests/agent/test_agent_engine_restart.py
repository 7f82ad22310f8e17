"""An engine that keeps its name (issue 24): three runs of one engine id against a real agent
process — the second loses an acknowledgement (its batch is re-sent), the agent is SIGKILLed
and restarted during the third, whose spool is new — and every event is stored exactly once,
with no 409, no rejection and no gap: each run continues the seqs of the one before
(``engine/run_seq.py``). Every run's id is stored, ``kvscope_engine_run_info`` names the latest."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.events import EngineStats, Form, Tier
from engine.events_arrow_check import batch_dict
from engine.telemetry import TelemetryClient
from tests.agent_process import start_agent

ENGINE = "gpu-node-1-kvscope_hybrid-small"
BATCH = 10


class LoseAcknowledgement(httpx.BaseTransport):
    """The agent's transport, except that the answer to the first POST of batch ``seq`` is lost
    after the agent stored it (a dropped connection): the client must send it again."""

    def __init__(self, seq: int) -> None:
        self.inner = httpx.HTTPTransport()
        self.seq = seq
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        posted = request.method == "POST" and request.url.path == "/v1/events"
        if posted and not self.lost and batch_dict(request.content)["seq"] == self.seq:
            response.read()
            response.close()
            self.lost += 1
            raise httpx.ReadError("connection dropped before the answer", request=request)
        return response

    def close(self) -> None:
        self.inner.close()


def stats(i: int) -> EngineStats:
    """Event number ``i`` (its ``used_bytes``), to count every event stored once."""
    return EngineStats(
        ts=1_700_000_000.0 + i, engine_id=ENGINE, model="kvscope_hybrid-small", form=Form.FULL_KV, tier=Tier.DEVICE,
        used_bytes=i, used_blocks=0, cached_blocks=0, free_blocks=0, total_blocks=1,
    )  # fmt: skip


def start_run(url: str, **kwargs: Any) -> TelemetryClient:
    """A new engine process's telemetry client under the same engine id (a new run id)."""
    return TelemetryClient(url, ENGINE, batch_max_events=BATCH, batch_max_seconds=2.0, watermark_poll_seconds=0.1, timeout_seconds=5.0, **kwargs)


def send_batch(client: TelemetryClient, first: int) -> None:
    for i in range(first, first + BATCH):
        client.emit(stats(i))
    assert client.flush(timeout_seconds=30)


def sql(url: str, query: str) -> list[list[Any]]:
    response = httpx.post(url + "/v1/sql", json={"sql": query}, timeout=10)
    assert response.status_code == 200, response.text
    rows: list[list[Any]] = response.json()["rows"]
    return rows


def samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_restarted_engine_keeps_its_id_and_a_resent_batch_is_stored_once(tmp_path: Path) -> None:
    port, data = free_port(), tmp_path / "data"
    url = f"http://127.0.0.1:{port}"
    agent = start_agent(port, data, log_level="error")
    try:
        run1 = start_run(url)  # no spool: its first seq comes from the agent (0 for a new engine)
        for first in (0, 10, 20):
            send_batch(run1, first)
        run1.close(timeout_seconds=10)

        lossy = LoseAcknowledgement(seq=4)
        run2 = start_run(url, transport=lossy)  # same engine id, new run id: continues at seq 3
        for first in (30, 40, 50):
            send_batch(run2, first)
        run2.close(timeout_seconds=10)
        assert lossy.lost == 1 and run2.sent_batches == 3 and run2.lost_events == 0
        assert [labels["run_id"] for labels, _ in samples(url, "kvscope_engine_run_info")] == [run2.run_id]

        run3 = start_run(url, spool_path=tmp_path / "new-spool" / f"{ENGINE}.spool")  # its spool is new
        send_batch(run3, 60)  # acknowledged, not yet durable at the agent
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        agent = start_agent(port, data, log_level="error")
        send_batch(run3, 70)  # meets the new agent process: what was not durable is sent again
        send_batch(run3, 80)
        run3.close(timeout_seconds=30)
        assert run3.resent_events == BATCH and run3.lost_events == 0 and not run3.spool

        assert len({run1.run_id, run2.run_id, run3.run_id}) == 3
        ids = sql(url, f"SELECT used_bytes, count(*) FROM engine_stats WHERE engine_id = '{ENGINE}' GROUP BY 1 ORDER BY 1")
        assert ids == [[i, 1] for i in range(90)]  # every event exactly once
        stored = sql(url, "SELECT seq, run_id FROM ingest_batches WHERE status = 'stored' ORDER BY seq")
        runs = [run1.run_id] * 3 + [run2.run_id] * 3 + [run3.run_id] * 3
        assert stored == [[seq, run] for seq, run in enumerate(runs)]  # seqs continued across runs
        statuses = dict(sql(url, "SELECT status, count(*) FROM ingest_batches GROUP BY 1"))
        assert "rejected" not in statuses and statuses["duplicate"] >= 2  # the lost ack, the re-send after the restart
        assert {seq for (seq,) in sql(url, "SELECT seq FROM ingest_batches WHERE status = 'duplicate'")} >= {4, 6}
        assert sql(url, "SELECT count(*) FROM ingest_gaps") == [[0]]
        assert samples(url, "kvscope_ingest_missing_batches") == [({}, 0.0)]
        assert httpx.get(url + "/v1/ingest/next-seq", params={"engine_id": ENGINE}, timeout=5).json()["next_seq"] == 9
        assert samples(url, "kvscope_engine_run_info") == [({"engine": ENGINE, "run_id": run3.run_id}, 1.0)]
    finally:
        agent.terminate()
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
