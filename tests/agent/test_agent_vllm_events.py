"""Issue 26, item 4: vLLM's KV events into the agent. The messages a real vLLM run published
(``tests/peer/data/vllm_kv_events.json``, recorded by ``tests/peer/vllm_kv_events_run.py``) are
published again over a real pyzmq socket to :class:`agent.vllm_subscriber.VllmKvEventSubscriber`,
which stores them through a real ingest pipeline: once each, whatever is resent, replayed or
restarted. The oracle counts the hashes in the raw msgpack, not through the agent's structs."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from agent.ingest import IngestOutcome
from agent.metrics import AgentMetrics
from agent.pipeline import Ingestor
from agent.store import Store
from agent.vllm_events import VllmEventError, decode_message
from agent.vllm_subscriber import VllmKvEventSubscriber, pipeline_ingest, store_last_stored
from engine.events import EventBatch

FIXTURE = Path(__file__).resolve().parents[1] / "peer" / "data" / "vllm_kv_events.json"
ENGINE = "vllm-test"


def recorded() -> list[list[bytes]]:
    messages = json.loads(FIXTURE.read_text())["messages"]
    return [[m["topic"].encode(), m["seq"].to_bytes(8, "big"), base64.b64decode(m["payload"])] for m in messages]


def expected_rows(messages: list[list[bytes]]) -> Counter[str]:
    """Rows per action, from the raw msgpack: one per block hash (stored / removed); a clear is
    one row per form seen stored before it (at least one)."""
    counts: Counter[str] = Counter()
    kinds: set[str] = set()
    for frames in messages:
        _ts, events, *_ = msgspec.msgpack.decode(frames[2])
        for event in events:
            if event["type"] == "BlockStored":
                counts["stored"] += len(event["block_hashes"])
                kinds.add(event.get("kv_cache_spec_kind") or "full_attention")
            elif event["type"] == "BlockRemoved":
                counts["removed"] += len(event["block_hashes"])
            else:
                counts["cleared"] += max(1, len({"mamba" in k for k in kinds}))
    return counts


def with_seq(frames: list[bytes], seq: int) -> list[bytes]:
    return [frames[0], seq.to_bytes(8, "big"), frames[2]]


class Publisher:
    """An XPUB socket on loopback (it sees the subscription arrive, so nothing is published
    before the subscriber listens)."""

    def __init__(self) -> None:
        self.socket = zmq.Context.instance().socket(zmq.XPUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, a second one to the same topic too
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"

    def wait_for_subscriber(self) -> None:
        """Until a subscription arrives (an earlier subscriber's unsubscription may come first)."""
        while True:
            assert self.socket.poll(10_000), "the subscriber never subscribed"
            if self.socket.recv()[:1] == b"\x01":
                return

    def send(self, frames: list[bytes]) -> None:
        self.socket.send_multipart(frames)

    def close(self) -> None:
        self.socket.close(0)


@pytest.fixture
def pipeline(store: Store, metrics: AgentMetrics) -> Iterator[Ingestor]:
    ingestor = Ingestor(store, metrics, flush_wait_seconds=0.0)
    yield ingestor
    ingestor.close()


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


def subscriber(store: Store, ingestor: Ingestor, metrics: AgentMetrics, address: str, replay: str | None = None) -> VllmKvEventSubscriber:
    sub = VllmKvEventSubscriber(
        address, ingest=pipeline_ingest(lambda: ingestor, metrics), last_stored=store_last_stored(store),
        replay_endpoint=replay, engine_id=ENGINE, model="tiny-qwen3-next",
    )  # fmt: skip
    sub.start()
    return sub


def wait_until(check: Callable[[], bool], seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def rows(store: Store) -> Counter[str]:
    with store.cursor() as cur:
        found = cur.execute("SELECT action, count(*) FROM block_events WHERE engine_id = ? GROUP BY action", [ENGINE]).fetchall()
    return Counter({action: n for action, n in found})


def stored_seqs(store: Store) -> list[int]:
    with store.cursor() as cur:
        found = cur.execute("SELECT seq FROM ingest_batches WHERE engine_id = ? AND status = 'stored' ORDER BY seq", [ENGINE]).fetchall()
    return [s for (s,) in found]


def test_the_recording_is_a_real_vllm_run_with_stores_and_removals() -> None:
    messages = recorded()
    decoded = [decode_message(m) for m in messages]
    assert [m.seq for m in decoded] == list(range(len(messages)))
    counts = expected_rows(messages)
    assert counts["stored"] > 0 and counts["removed"] > 0, counts
    kinds = {e.kv_cache_spec_kind for m in decoded for e in m.batch.events if type(e).__name__ == "BlockStored"}
    assert "full_attention" in kinds or "mamba" in kinds, kinds


def test_every_published_batch_is_stored_exactly_once(store: Store, metrics: AgentMetrics, pipeline: Ingestor, publisher: Publisher) -> None:
    messages = recorded()
    sub = subscriber(store, pipeline, metrics, publisher.address)
    try:
        publisher.wait_for_subscriber()
        for frames in messages:
            publisher.send(frames)
        publisher.send(messages[0])  # a stale seq resent live: vLLM started again (a new numbering)
        wait_until(lambda: sub.received == len(messages) + 1)
        wait_until(lambda: len(stored_seqs(store)) == len(messages) + 1)
    finally:
        sub.close()
    expected = expected_rows(messages)
    again = expected_rows(messages[:1])
    assert rows(store) == expected + again
    assert stored_seqs(store) == list(range(len(messages) + 1))
    assert sub.restarts == 1 and sub.undecodable == 0


def test_missed_batches_are_replayed_and_a_batch_seen_twice_is_stored_once(
    store: Store, metrics: AgentMetrics, pipeline: Ingestor, publisher: Publisher
) -> None:
    messages = recorded()[:4]
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    replay = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    asked: list[int] = []

    def serve_replay() -> None:  # vLLM's protocol: [client, b"", start] -> batches >= start, then seq -1
        if not router.poll(10_000):
            return
        client, _, start = router.recv_multipart()
        asked.append(int.from_bytes(start, "big"))
        for frames in messages[asked[-1] :]:  # more than was missed: the live one comes again
            router.send_multipart([client, b"", *frames])
        router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    server = threading.Thread(target=serve_replay)
    server.start()
    sub = subscriber(store, pipeline, metrics, publisher.address, replay)
    try:
        publisher.wait_for_subscriber()
        publisher.send(messages[0])
        wait_until(lambda: stored_seqs(store) == [0])
        publisher.send(messages[3])  # 1 and 2 were missed
        wait_until(lambda: stored_seqs(store) == [0, 1, 2, 3])
        server.join(10)
    finally:
        sub.close()
        router.close(0)
    assert asked == [1]
    assert rows(store) == expected_rows(messages)


def test_a_restarted_agent_continues_the_numbering(store: Store, metrics: AgentMetrics, pipeline: Ingestor, publisher: Publisher) -> None:
    messages = recorded()[:3]
    first = subscriber(store, pipeline, metrics, publisher.address)
    publisher.wait_for_subscriber()
    publisher.send(messages[0])
    publisher.send(messages[1])
    wait_until(lambda: stored_seqs(store) == [0, 1])
    first.close()
    second = subscriber(store, pipeline, metrics, publisher.address)  # reads base and top back
    try:
        publisher.wait_for_subscriber()
        publisher.send(messages[2])  # vLLM went on meanwhile: its next seq
        wait_until(lambda: second.received == 1)
        wait_until(lambda: stored_seqs(store) == [0, 1, 2])
    finally:
        second.close()
    assert second.restarts == 0
    assert rows(store) == expected_rows(messages)
    with store.cursor() as cur:
        run_ids = cur.execute("SELECT DISTINCT run_id FROM ingest_batches WHERE engine_id = ?", [ENGINE]).fetchall()
    assert run_ids == [("vllm-b0",)]


def test_a_message_that_is_not_a_batch_is_skipped_and_nothing_stored_is_lost(
    store: Store, metrics: AgentMetrics, pipeline: Ingestor, publisher: Publisher
) -> None:
    messages = recorded()[:2]
    with pytest.raises(VllmEventError, match="3 frames"):
        decode_message([b"x"])
    with pytest.raises(VllmEventError, match="not a vLLM KV-event batch"):
        decode_message([b"", (0).to_bytes(8, "big"), b"\x93not msgpack"])
    with pytest.raises(VllmEventError, match="holds -1"):
        decode_message(with_seq(messages[0], 2**64 - 1))
    sub = subscriber(store, pipeline, metrics, publisher.address)
    try:
        publisher.wait_for_subscriber()
        publisher.send(messages[0])
        publisher.send([b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode({"not": "a batch"})])
        publisher.send(with_seq(messages[1], 1))
        wait_until(lambda: sub.received == 3)
        wait_until(lambda: stored_seqs(store) == [0, 1])
    finally:
        sub.close()
    assert sub.undecodable == 1
    assert rows(store) == expected_rows(messages)


def test_the_agent_config_refuses_an_address_that_is_not_zmq(tmp_path: Path) -> None:
    from agent.config import AgentConfig

    for wrong in ("http://127.0.0.1:5557", "tcp://*:5557", "tcp://127.0.0.1"):  # '*' is where vLLM binds, not an address to reach
        with pytest.raises(ValueError, match="vllm_kv_events must be a ZMQ address"):
            AgentConfig(data_dir=tmp_path, vllm_kv_events=wrong)
    with pytest.raises(ValueError, match="1 to 256 characters"):
        AgentConfig(data_dir=tmp_path, vllm_model="m" * 257)
    assert AgentConfig(data_dir=tmp_path, vllm_kv_events="tcp://127.0.0.1:5557").vllm_kv_events == "tcp://127.0.0.1:5557"


def test_a_batch_whose_storing_failed_is_asked_for_again(store: Store, metrics: AgentMetrics, pipeline: Ingestor, publisher: Publisher) -> None:
    """The first attempt to store batch 1 raises (as a store error would); the subscriber goes on,
    and batch 2's arrival asks vLLM's replay socket for 1 again."""
    messages = recorded()[:3]
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    replay = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    asked: list[int] = []

    def serve_replay() -> None:
        if router.poll(10_000):
            client, _, start = router.recv_multipart()
            asked.append(int.from_bytes(start, "big"))
            router.send_multipart([client, b"", *messages[1]])
            router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    server = threading.Thread(target=serve_replay)
    server.start()
    real = pipeline_ingest(lambda: pipeline, metrics)
    failed: list[int] = []

    def flaky(batch: EventBatch) -> IngestOutcome | None:
        if batch.seq == 1 and not failed:
            failed.append(batch.seq)
            raise RuntimeError("the store is unavailable")
        return real(batch)

    sub = VllmKvEventSubscriber(
        publisher.address, ingest=flaky, last_stored=store_last_stored(store), replay_endpoint=replay, engine_id=ENGINE, model="m"
    )  # fmt: skip
    sub.start()
    try:
        publisher.wait_for_subscriber()
        for frames in messages:
            publisher.send(frames)
        wait_until(lambda: stored_seqs(store) == [0, 1, 2])
        server.join(10)
    finally:
        sub.close()
        router.close(0)
    assert failed == [1] and sub.errors == 1 and asked == [1]
    assert rows(store) == expected_rows(messages)
