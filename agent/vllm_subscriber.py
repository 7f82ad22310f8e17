"""Subscribe to a vLLM engine's ZMQ KV-event publisher and store what it publishes as an external
engine's ``block`` events (``kvscope agent --vllm-kv-events tcp://HOST:PORT``).

One thread owns a pyzmq SUB socket (and, with a replay endpoint, a DEALER socket to vLLM's
ROUTER replay socket). Each vLLM batch becomes one kvscope :class:`~engine.events.EventBatch`
(:mod:`agent.vllm_events` maps the fields) under ``engine_id`` and goes through the agent's own
ingest pipeline, so it is checked, deduplicated and counted like any engine's batch.

Seqs: vLLM numbers its batches from 0 at each start of its publisher. The batch with vLLM seq v
is stored under seq ``base + v``, and ``run_id`` ``vllm-b{base}`` records the base, so that after
an agent restart the subscriber continues the same numbering (it reads the last stored batch's
run id). A live seq at or below one already stored means vLLM restarted: a new base (one above
the highest seq stored) starts. A live seq past the next expected one means batches were missed:
with a replay endpoint they are asked for (vLLM keeps its last ``buffer_steps`` batches) and
stored first; without one the agent's gap accounting counts them. A batch received twice (live
and replayed, or replayed again after an agent restart) is stored once: same seq, same events.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from agent.ingest import IngestOutcome, prepare_batch
from agent.metrics import AgentMetrics
from agent.pipeline import Ingestor, IngestorClosed, QueueFull
from agent.store import Store
from agent.vllm_events import GroupForms, VllmEventError, VllmMessage, block_events, decode_message
from engine.events import SCHEMA_VERSION, Event, EventBatch, decode_batch

log = logging.getLogger(__name__)

RUN_ID = re.compile(r"^vllm-b(\d+)$")
Ingest = Callable[[EventBatch], IngestOutcome | None]
"""Stores one batch (None: the agent is shutting down and took nothing)."""
LastStored = Callable[[str], tuple[int, str | None] | None]
"""The highest seq stored for an engine id and that batch's run id (None: nothing stored)."""


class VllmKvEventSubscriber:
    """A background subscriber to one vLLM publisher.

    Args:
        endpoint: vLLM's PUB address (``--kv-events-config``'s ``endpoint`` as seen from here,
            ``tcp://127.0.0.1:5557``).
        ingest: stores one batch through the agent's pipeline, blocking until it committed.
        last_stored: what the store holds for ``engine_id`` (read once, at start).
        replay_endpoint: vLLM's ROUTER replay address (``replay_endpoint``), or None.
        replay_timeout_seconds: how long a replay may go without a message before it is given up.
        engine_id / model: the names the rows get (vLLM's events carry neither).
        topic: the topic subscribed to (vLLM's ``topic``; empty: every message).

    Raises:
        ValueError: an empty endpoint, engine id or model.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        ingest: Ingest,
        last_stored: LastStored,
        replay_endpoint: str | None = None,
        engine_id: str = "vllm",
        model: str = "vllm",
        topic: str = "",
        replay_timeout_seconds: float = 2.0,
    ) -> None:
        if not endpoint or not engine_id or not model:
            raise ValueError("the vLLM KV-event endpoint, engine id and model must not be empty")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.engine_id = engine_id
        self.model = model
        self.topic = topic.encode()
        self.replay_timeout_seconds = replay_timeout_seconds
        self._ingest = ingest
        self._last_stored = last_stored
        self._groups = GroupForms()
        self._base: int | None = None
        self._next_vseq: int | None = None
        self._top = -1  # highest kvscope seq stored under engine_id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.received = 0
        """vLLM batches received (live and replayed), decoded or not."""
        self.stored = 0
        """Batches the pipeline stored (not counting duplicates)."""
        self.undecodable = 0
        """Messages that were not vLLM KV-event batches (logged, skipped)."""
        self.restarts = 0
        """Times vLLM's publisher was seen to start again from a lower seq."""
        self.errors = 0
        """Batches whose storing raised (logged; the batch is asked for again on replay)."""

    def start(self) -> None:
        """Read back what the store holds for ``engine_id`` and start the subscriber thread.

        Raises:
            RuntimeError: started already.
            duckdb.Error: the store could not be read.
        """
        if self._thread is not None:
            raise RuntimeError("the vLLM KV-event subscriber is started already")
        last = self._last_stored(self.engine_id)
        if last is not None:
            self._top, run_id = last
            found = RUN_ID.match(run_id or "")
            if found:
                self._base = int(found.group(1))
                self._next_vseq = self._top + 1 - self._base
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()
        log.info("subscribed to vLLM KV events at %s (engine_id %r)", self.endpoint, self.engine_id)

    def close(self, timeout_seconds: float = 5.0) -> None:
        """Stop the thread and wait up to ``timeout_seconds`` for it (a batch being stored
        finishes first; past the timeout the daemon thread is left to end by itself)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                try:
                    self._on_live(frames)
                except Exception:  # one batch failed (a store error): logged, counted; the next goes on
                    self.errors += 1
                    log.exception("storing a vLLM KV-event batch failed (%d so far); with a replay address the next one asks for it again", self.errors)
                    self._stop.wait(min(5.0, 0.1 * self.errors))
        finally:
            sub.close(0)

    def _on_live(self, frames: list[bytes]) -> None:
        message = self._decoded(frames)
        if message is None:
            return
        v = message.seq
        if self._base is None or (self._next_vseq is not None and v < self._next_vseq and self._base + v <= self._top):
            if self._base is not None:
                self.restarts += 1
                log.info("vLLM's publisher started again (seq %d after %d): a new numbering from seq %d", v, self._next_vseq, self._top + 1)
            self._base = self._top + 1
            self._next_vseq = 0
        assert self._next_vseq is not None
        if v > self._next_vseq and self.replay_endpoint is not None:
            self._replay(self._next_vseq, v)
        self._store(message)

    def _replay(self, first: int, live: int) -> None:
        """Ask vLLM for its batches ``first … live − 1`` and store those it still has."""
        assert self.replay_endpoint is not None
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while not self._stop.is_set():  # an idle timeout: storing a replayed batch does not count
                if not dealer.poll(int(self.replay_timeout_seconds * 1000) + 1):
                    break
                frames = dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3 and frames[1] == (-1).to_bytes(8, "big", signed=True):
                    return  # vLLM's end of replay
                message = self._decoded(frames)
                if message is not None and first <= message.seq < live:
                    self._store(message)
            log.warning("vLLM's replay of seqs %d..%d went silent for %.1f s before its end", first, live - 1, self.replay_timeout_seconds)
        finally:
            dealer.close(0)

    def _decoded(self, frames: list[bytes]) -> VllmMessage | None:
        self.received += 1
        try:
            return decode_message(frames)
        except VllmEventError as exc:
            self.undecodable += 1
            if self.undecodable in (1, 10, 100) or self.undecodable % 10_000 == 0:
                log.warning("skipped a message from %s that is not a vLLM KV-event batch (%d so far): %s", self.endpoint, self.undecodable, exc)
            return None

    def _store(self, message: VllmMessage) -> None:
        assert self._base is not None
        seq = self._base + message.seq
        events: list[Event] = [*block_events(message.batch, engine_id=self.engine_id, model=self.model, groups=self._groups)]
        raw = EventBatch(
            schema_version=SCHEMA_VERSION, engine_id=self.engine_id, seq=seq, sent_at=time.time(), events=events, run_id=f"vllm-b{self._base}"
        )
        try:  # the contract's checks (lengths, ranges) on what vLLM sent
            batch = decode_batch(msgspec.msgpack.encode(raw), "msgpack")
        except ValueError as exc:
            self.undecodable += 1
            log.warning("skipped vLLM batch seq %d: %s", message.seq, exc)
            return
        outcome = self._ingest(batch)
        if outcome is None:
            self._stop.set()
            return
        if outcome.status == "stored":
            self.stored += 1
        elif outcome.status == "conflict":
            log.error("vLLM batch seq %d (stored as %d) conflicts with a stored batch; not stored", message.seq, seq)
        self._top = max(self._top, seq)
        self._next_vseq = max(self._next_vseq or 0, message.seq + 1)


def pipeline_ingest(ingestor_of: Callable[[], Ingestor | None], metrics: AgentMetrics, *, retry_seconds: float = 0.05) -> Ingest:
    """An :data:`Ingest` through the agent's pipeline (``ingestor_of()``; None once it is gone):
    it waits while the queue is full, and counts the outcome as ``POST /v1/events`` does."""

    def ingest(batch: EventBatch) -> IngestOutcome | None:
        prepared = prepare_batch(batch)
        while True:
            ingestor = ingestor_of()
            if ingestor is None:
                return None
            try:
                outcome = ingestor.submit(prepared).result()
            except QueueFull:
                time.sleep(retry_seconds)
                continue
            except IngestorClosed:
                return None
            metrics.observe_ingest(outcome)
            metrics.run_info.observe(outcome)
            return outcome

    return ingest


def store_last_stored(store: Store) -> LastStored:
    """A :data:`LastStored` reading ``ingest_batches``."""

    def last_stored(engine_id: str) -> tuple[int, str | None] | None:
        with store.cursor(purpose="vLLM subscriber start") as cur:
            row = cur.execute(
                "SELECT seq, run_id FROM ingest_batches WHERE engine_id = ? AND status = 'stored' ORDER BY seq DESC LIMIT 1",
                [engine_id],
            ).fetchone()
        return None if row is None else (int(row[0]), row[1])

    return last_stored
