"""Engine-side telemetry: event sinks and the non-blocking client that ships batches to the agent.

:class:`TelemetryClient` never blocks the engine step: :meth:`~TelemetryClient.emit` puts the
event on a bounded in-memory queue (a full queue drops the event and counts it); a background
thread groups events into batches (by size and by age), stamps each batch with the engine id,
this process's ``run_id`` (:func:`engine.identity.new_run_id`) and a per-engine ``seq`` that
grows by one per batch, and posts it as Arrow IPC (:mod:`engine.events_arrow`, built column by
column; ``wire_format`` msgpack or JSON on request) to ``POST /v1/events``,
retrying connection failures and 5xx answers with capped exponential backoff. A batch the agent
rejects (4xx) is not retried: it is counted and logged with the agent's reason.

With a spool (``spool_path``, :mod:`engine.spool`), every batch is appended to the spool file
first and sent from there, oldest first, with its own ``seq`` (a batch the agent stored but did
not acknowledge comes back a counted duplicate, never stored twice); while the agent cannot take
batches — after the retries, while the queue is over its high-water mark — they wait there and
new ones queue behind them, so the order is kept. A batch the agent acknowledged stays in the
spool until the agent's **durable watermark** (:mod:`agent.durability`; in every answer and at
``GET /v1/ingest/watermark``) passes its seq; when the client meets a new agent process (a new
``agent_instance``: it restarted, perhaps with a damaged WAL) it re-sends every batch above the
watermark. Events are dropped only when the spool's disk budget is exhausted, and then loudly.
The sinks the engine also takes (:class:`~engine.sinks.NullSink`, :class:`~engine.sinks.ListSink`)
live in :mod:`engine.sinks`.

**Seqs across restarts** (DESIGN.md §5): an engine keeps its id across restarts and its seqs
*continue* (no seq reused: a 409; none skipped: a gap) from max(the spool's saved next seq, the
agent's next expected one, ``GET /v1/ingest/next-seq``): :mod:`engine.run_seq`. The run id only
labels batches (not in the idempotency key); two processes under one engine id at once collide.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import Literal

import httpx
import pyarrow as pa

from engine.agent_http import epoch_of, post_batch
from engine.event_buffer import EventBuffer
from engine.events import Event
from engine.events_arrow import WireFormat
from engine.events_arrow_encode import encode_body
from engine.identity import new_run_id
from engine.run_seq import first_seq
from engine.sinks import EventSink, ListSink, NullSink
from engine.spool import Spool

SPOOL_RETRIES = 3
"""Attempts per batch before it goes to the spool (without a spool: ``max_retries``)."""

log = logging.getLogger(__name__)

__all__ = ["SPOOL_RETRIES", "EventSink", "ListSink", "NullSink", "TelemetryClient"]


class TelemetryClient:
    """Bounded queue + background sender to an agent at ``url``.

    Args:
        url: the agent's base URL (``http://127.0.0.1:9400``).
        engine_id: stamped on every batch; events must carry the same id.
        max_queue_events: capacity of the in-memory queue; beyond it events are dropped and
            counted in :attr:`dropped_events`.
        batch_max_events / batch_max_seconds: a batch is sent when it holds this many events or
            its oldest event is this old (5,000: the agent's cost per batch is mostly fixed —
            a request, a flush's share — so a busy engine sends few large batches; an idle one
            still sends within ``batch_max_seconds``).
        max_retries: attempts per batch for connection errors and 5xx answers (backoff doubles
            from 0.1 s up to 2 s) when there is no spool; with one, :data:`SPOOL_RETRIES`.
        token: optional bearer token for the agent.
        spool_path: the spool file (None: no spool; undeliverable batches are dropped, counted).
        spool_max_bytes: the spool's disk budget.
        high_water_events: queue depth from which batches go to the spool directly (default
            three quarters of ``max_queue_events``).
        watermark_poll_seconds: how often the agent's durable watermark is asked for while
            acknowledged batches wait for it and nothing else is sent.
        run_id: stamped on every batch (default: a new :func:`engine.identity.new_run_id`).
        transport: the HTTP transport (default: httpx's; tests pass one to an agent in-process).
        wire_format: the body format, ``arrow`` (Arrow IPC, :mod:`engine.events_arrow`; built
            column by column), ``msgpack`` or ``json``.

    Raises:
        ValueError: a non-positive limit, or a spool path that cannot be opened.
    """

    def __init__(
        self,
        url: str,
        engine_id: str,
        *,
        max_queue_events: int = 200_000,
        batch_max_events: int = 5_000,
        batch_max_seconds: float = 0.5,
        max_retries: int = 8,
        timeout_seconds: float = 10.0,
        token: str | None = None,
        spool_path: Path | None = None,
        spool_max_bytes: int = 256 << 20,
        high_water_events: int | None = None,
        watermark_poll_seconds: float = 1.0,
        run_id: str | None = None,
        transport: httpx.BaseTransport | None = None,
        wire_format: WireFormat = "arrow",
    ) -> None:
        self._buffer = EventBuffer(max_queue_events, batch_max_events, batch_max_seconds)
        self.wire_format: WireFormat = wire_format
        self.url = url.rstrip("/") + "/v1/events"
        self.engine_id = engine_id
        self.run_id = run_id or new_run_id()
        self.batch_max_events = batch_max_events
        self.batch_max_seconds = batch_max_seconds
        self.max_retries = max_retries
        headers = {}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(timeout=timeout_seconds, headers=headers, transport=transport)
        self._stop = threading.Event()
        self.sent_events = 0
        self.sent_batches = 0
        self.dropped_events = 0
        self.rejected_batches = 0
        self.rejected_events = 0
        self.failed_batches = 0
        self.spooled_events = 0
        self.replayed_events = 0
        self.resent_events = 0
        """Events sent again because the agent restarted before making them durable."""
        self.watermark_poll_seconds = watermark_poll_seconds
        self._agent_instance: str | None = None
        self._instance_checked = False
        self._next_poll = 0.0
        self.spool: Spool | None = Spool(spool_path, spool_max_bytes) if spool_path is not None else None
        self._seq: int | None = None  # the next batch's; None until this run's first (engine.run_seq)
        self.high_water_events = high_water_events if high_water_events is not None else max_queue_events * 3 // 4
        self._retry_at = 0.0
        self._backoff = 0.1
        if self.spool:
            log.info("telemetry spool %s holds %d bytes from an earlier run: re-sending them first", spool_path, self.spool.pending_bytes)
        self._thread = threading.Thread(target=self._run, name="kvscope-telemetry", daemon=True)
        self._thread.start()

    def emit(self, event: Event) -> None:
        """Queue one event; never blocks (:meth:`engine.event_buffer.EventBuffer.put`). A full
        queue, or a closed client, drops it (counted, logged)."""
        if not self._stop.is_set() and self._buffer.put(event):
            return
        self.dropped_events += 1
        if self._stop.is_set():
            log.error("telemetry client is closed: event dropped")
        elif self.dropped_events in (1, 10, 100) or self.dropped_events % 10_000 == 0:
            log.error("telemetry queue full: %d events dropped so far", self.dropped_events)

    def flush(self, timeout_seconds: float | None = None) -> bool:
        """Wait until every queued event was sent (or given up on). True if drained in time."""
        return self._buffer.drained(timeout_seconds)

    def close(self, timeout_seconds: float | None = 30.0) -> None:
        """Flush, give the spool the rest of ``timeout_seconds`` to send its backlog to the agent,
        ask the agent to make what it acknowledged durable (``POST /v1/ingest/checkpoint``) and
        release it; what is left stays on disk for the next run. Then stop the sender and close
        the HTTP client."""
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        self.flush(timeout_seconds)
        while self.spool and self._thread.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.02)
        self._stop.set()
        self._thread.join(None if deadline is None else max(deadline - time.monotonic(), 1.0))
        if self._thread.is_alive():
            log.warning("telemetry sender still busy at close; what it holds stays in the spool for the next run")
            return
        self._http.close()

    @property
    def lost_events(self) -> int:
        """Events the agent will never store: dropped here, or in batches it rejected."""
        return self.dropped_events + self.rejected_events

    # -- sender thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not (self._stop.is_set() and not self._buffer):
            try:
                self._replay()
            except Exception:  # never let the sender die: back off and go on
                log.exception("telemetry sender: re-sending from the spool failed; retrying")
                self._retry_at = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, 2.0)
            events = self._buffer.take(0.05 if self.spool else 0.1, self._stop.is_set)
            if not events:
                continue
            try:
                self._deliver(events)
            except Exception:  # the batch is in the spool (or counted dropped): go on
                log.exception("telemetry sender: delivering a batch failed")
            finally:
                self._buffer.done()
        if self.spool is not None:
            try:
                if self.spool.awaiting_records and time.monotonic() >= self._retry_at:
                    self._watermark(checkpoint=True)  # make what the agent holds durable, then release it
            except Exception:
                log.exception("telemetry sender: the last checkpoint request failed; the spool keeps its batches")
            self.spool.close()

    def _deliver(self, events: list[Event]) -> None:
        if self._seq is None:  # this run's first batch: continue the engine id's seqs
            spooled = self.spool.next_seq if self.spool is not None else None
            self._seq = first_seq(self._http, self.url, self.engine_id, spool_next_seq=spooled, attempts=self.max_retries, stop=self._stop)
            if self._seq is None:  # no spool and no agent: the batch could not be posted either
                self.failed_batches += 1
                self.dropped_events += len(events)
                log.error("telemetry batch dropped: the agent at %s cannot be reached (%d events)", self.url, len(events))
                return
        seq = self._seq
        self._seq += 1
        try:
            body = encode_body(self.wire_format, events, engine_id=self.engine_id, seq=seq, sent_at=time.time(), run_id=self.run_id)
        except (TypeError, ValueError, OverflowError, pa.ArrowException) as exc:  # an event built with a wrong value
            self.failed_batches += 1
            self.dropped_events += len(events)
            log.error("telemetry batch seq=%d could not be encoded (%d events dropped): %s", seq, len(events), exc)
            return
        if self.spool is None:
            outcome, _ = self._post(body, seq, len(events), self.max_retries)
            if outcome == "sent":
                self.sent_events += len(events)
                self.sent_batches += 1
            elif outcome == "unreachable":
                self.failed_batches += 1
                self.dropped_events += len(events)
                log.error("telemetry batch seq=%d dropped after %d attempts (%d events)", seq, self.max_retries, len(events))
            return
        self.spool.save_next_seq(self._seq)
        # behind the backlog, the queue too deep, or the agent down: the drain loop sends it
        deferred = bool(self.spool) or len(self._buffer) >= self.high_water_events or time.monotonic() < self._retry_at
        if not self._to_spool(body, len(events)):
            return
        if deferred:
            self.spooled_events += len(events)
            return
        first = self._send_next(SPOOL_RETRIES, fresh=True)
        if first in ("unreachable", "rewound"):  # it waits in the spool: sent (again) from there
            self.spooled_events += len(events)
        if first == "unreachable":
            self._retry_at = time.monotonic() + self._backoff

    def _to_spool(self, body: bytes, events: int) -> bool:
        assert self.spool is not None
        if self.spool.append(body, events):  # a full spool first releases acknowledged records (it logs them)
            return True
        self.failed_batches += 1
        self.dropped_events += events
        log.error(
            "telemetry spool %s is full (%d bytes): %d events DROPPED (%d so far)",
            self.spool.path,
            self.spool.max_bytes,
            events,
            self.dropped_events,
        )
        return False

    def _send_next(self, attempts: int, *, fresh: bool) -> Literal["sent", "rejected", "unreachable", "rewound", "empty"]:
        """POST the oldest unsent spool record; on an answer, file it in the spool (kept until a
        later checkpoint epoch of the same agent process shows it durable). ``rewound``: the
        answer came from a new agent process, and every record not yet durable — this one too —
        is unsent again."""
        assert self.spool is not None
        record = self.spool.peek()
        if record is None:
            return "empty"
        body, events = record
        resending = self.spool.resending
        outcome, answer = self._post(body, None, events, attempts)
        if outcome == "unreachable":
            self._instance_checked = False
            return outcome
        if outcome == "rejected" or answer is None:
            self.spool.sent(None)  # refused for good: nothing to wait for
            return outcome
        if not self._on_agent(answer):
            return "rewound"
        epoch = epoch_of(answer)
        self.spool.sent(epoch)
        self.spool.release(epoch)
        if resending:  # acknowledged before, counted in sent_events then
            self.resent_events += events
            return outcome
        self.sent_events += events
        self.sent_batches += 1
        if not fresh:
            self.replayed_events += events
        return outcome

    def _on_agent(self, answer: dict[str, object]) -> bool:
        """Note the agent process an answer came from; False when it is another one than before
        (it restarted, or was replaced by an agent without watermarks): every batch acknowledged
        but not yet durable is made unsent, to be re-sent — nothing is released on the new
        process's word until it acknowledged the batch itself."""
        instance = answer.get("agent_instance")
        if not isinstance(instance, str) or epoch_of(answer) is None:
            instance = None  # an agent without watermarks: acknowledged means durable
        known, self._agent_instance = self._agent_instance, instance
        self._instance_checked = True
        self._next_poll = time.monotonic() + self.watermark_poll_seconds
        if known is None or known == instance:
            return True
        assert self.spool is not None
        if self.spool.awaiting_records:
            log.warning(
                "the agent restarted: re-sending the %d batches it acknowledged but had not made durable",
                self.spool.awaiting_records,
            )
        self.spool.rewind()
        return False

    def _watermark(self, *, checkpoint: bool = False) -> None:
        """Ask the agent for its checkpoint epoch (``checkpoint``: after a checkpoint) and
        release what it shows durable. An answer that is not the agent's (a proxy's page, a
        5xx, a 401) is retried later with backoff, and said."""
        assert self.spool is not None
        url = self.url.rsplit("/", 1)[0] + ("/ingest/checkpoint" if checkpoint else "/ingest/watermark")
        try:
            resp = self._http.request("POST" if checkpoint else "GET", url, params={"engine_id": self.engine_id})
        except httpx.HTTPError as exc:
            log.debug("telemetry watermark: %s", exc)
            self._retry_at = time.monotonic() + self._backoff
            return
        self._next_poll = time.monotonic() + self.watermark_poll_seconds
        if resp.status_code == 404:  # an agent without watermarks: acknowledged means durable
            if self._on_agent({}):
                self.spool.release(sys.maxsize)
            return
        try:
            answer = resp.json() if resp.status_code == 200 else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or epoch_of(answer) is None or not isinstance(answer.get("agent_instance"), str):
            log.warning("telemetry watermark %s answered HTTP %d without a checkpoint epoch; asking again later", url, resp.status_code)
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, 2.0)
            return
        if self._on_agent(answer):
            self.spool.release(epoch_of(answer))

    def _replay(self) -> None:
        """Send unsent spool records, oldest first, while the agent takes them (at most ~50 ms per
        call, so new events keep flowing into the spool behind them); poll the durable watermark
        while acknowledged records wait for it."""
        if self.spool is None or time.monotonic() < self._retry_at:
            return
        if not self._instance_checked and (self.spool or self.spool.awaiting_records):
            self._watermark()
            if not self._instance_checked:
                return
        until = time.monotonic() + 0.05
        while self.spool and time.monotonic() < until:
            outcome = self._send_next(1, fresh=False)
            if outcome == "unreachable":
                self._retry_at = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, 2.0)
                return
            self._backoff = 0.1
        if self.spool.awaiting_records and not self.spool and time.monotonic() >= self._next_poll:
            self._watermark()

    def _post(
        self, body: bytes, seq: int | None, events: int, attempts: int
    ) -> tuple[Literal["sent", "rejected", "unreachable"], dict[str, object] | None]:
        """POST one encoded batch (:func:`engine.agent_http.post_batch`); a refusal is counted and
        logged with the agent's reason."""
        outcome, answer, refusal = post_batch(self._http, self.url, body, seq, attempts, self._stop)
        if outcome == "rejected":
            self.rejected_batches += 1
            self.rejected_events += events
            log.error("agent rejected batch seq=%s (%d events): %s", seq, events, refusal)
        return outcome, answer
