"""The ingest pipeline: a bounded queue of prepared batches and one flusher thread that commits
them in groups (group commit).

Contract:

* A request thread decodes and prepares its batch (:func:`agent.ingest.prepare_batch`), then
  :meth:`Ingestor.submit` puts it on the queue and gets a ``Future``; the HTTP answer waits for
  that future, so a batch is acknowledged **only after the transaction holding it committed**
  (DuckDB writes and syncs its WAL at commit). A crash loses at most what was not acknowledged,
  and the client re-sends it (the same seq: stored once).
* The queue is bounded by ``max_queue_events`` events. When a batch does not fit, the declared
  full policy applies: ``reject`` raises :class:`QueueFull` at once (the agent answers 503 with
  ``Retry-After``; the engine's client backs off and spools), ``block`` waits up to
  ``block_timeout_seconds`` for room, then raises :class:`QueueFull`. A batch larger than the
  whole queue is accepted when the queue is empty (it could never fit otherwise).
* The flusher takes everything queued (up to ``flush_max_events`` events, at least one batch)
  and writes it with :func:`agent.ingest.write_batches` in one transaction, stamping
  ``ingested_at`` in strictly increasing order (what :func:`agent.rollups.fold_cache_minute`
  relies on). If that group fails, each of its batches is retried alone, so one failing batch
  never fails the others. The rows a flush stores are summarised in one grouped aggregation
  (:func:`agent.batch_summary.summarize_tables`) on a summary thread while DuckDB inserts and
  commits them; after the commit, and before any of its batches is answered, the flusher adds
  that summary to the event metrics
  (:meth:`agent.metrics.AgentMetrics.observe_summary`), so they are up to date when an answer
  is sent; the request that receives an outcome counts its status
  (:meth:`~agent.metrics.AgentMetrics.observe_ingest`).
* :meth:`Ingestor.close` stops accepting, flushes what is queued and joins the thread.

Peers: the OpenTelemetry Collector's ``batch`` processor and Vector's buffers (bounded, with a
declared ``when_full`` policy of ``block`` or ``drop_newest``); here "drop" is a 503 so the
sender keeps the batch.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

import duckdb
import pyarrow as pa

from agent.batch_summary import BatchSummary, summarize_tables
from agent.ingest import IngestOutcome, PreparedBatch, latest_ingested_at, write_flush
from agent.metrics import AgentMetrics
from agent.seq_tracker import SeqTracker
from agent.store import Store, StoreClosedError, utc_now

log = logging.getLogger(__name__)

FullPolicy = Literal["reject", "block"]
FULL_POLICIES: tuple[FullPolicy, ...] = ("reject", "block")


class QueueFull(Exception):
    """The ingest queue has no room for a batch (after waiting, under ``block``)."""


class StoreWriteError(RuntimeError):
    """A batch could not be written for a reason other than the database itself (an internal
    error); the agent answers 503 and logs it."""


class IngestorClosed(Exception):
    """The ingestor is shutting down and takes no more batches."""


@dataclass(slots=True)
class _Item:
    batch: PreparedBatch
    future: Future[IngestOutcome]


def _settle(
    future: Future[IngestOutcome], outcome: IngestOutcome | None = None, *, error: BaseException | None = None
) -> None:
    """Resolve ``future`` unless it is already done (its request was cancelled): one request
    going away never stops the others of the flush from getting their answer."""
    try:
        if error is not None:
            future.set_exception(error)
        elif outcome is not None:
            future.set_result(outcome)
    except InvalidStateError:
        pass


class Ingestor:
    """Bounded queue + group-commit flusher over one :class:`~agent.store.Store`.

    Args:
        store: the open store (the caller closes it, after :meth:`close`).
        metrics: updated after each commit; its queue-depth gauge reads :attr:`depth_events`.
        max_queue_events: events the queue holds at most (≥ 1).
        full_policy: ``reject`` or ``block`` (see the module docstring).
        block_timeout_seconds: how long ``block`` waits for room.
        flush_max_events: events one transaction takes at most (≥ 1).
        flush_wait_seconds: how long a flush waits for batches still being decoded
            (:meth:`incoming`) to join it — group commit, as PostgreSQL's ``commit_delay`` with
            ``commit_siblings``: it never waits when none is on its way.
        on_committed: called with a flush's outcomes after its commit and before any of its
            answers is sent (the acknowledgement log of :mod:`agent.durability`); when it raises,
            the flush's batches are answered 503 (they are committed: a re-send is a duplicate).

    Raises:
        ValueError: a limit below 1 or an unknown policy.
        duckdb.Error: the store's ``ingest_batches`` cannot be read (seq state).
    """

    def __init__(
        self,
        store: Store,
        metrics: AgentMetrics,
        *,
        max_queue_events: int = 200_000,
        full_policy: FullPolicy = "reject",
        block_timeout_seconds: float = 5.0,
        flush_max_events: int = 50_000,
        flush_wait_seconds: float = 0.0,
        on_committed: Callable[[Sequence[IngestOutcome]], None] | None = None,
    ) -> None:
        if max_queue_events < 1 or flush_max_events < 1:
            raise ValueError("max_queue_events and flush_max_events must be >= 1")
        if full_policy not in FULL_POLICIES:
            raise ValueError(f"full_policy must be one of {FULL_POLICIES}, got {full_policy!r}")
        self.store = store
        self.metrics = metrics
        self.max_queue_events = max_queue_events
        self.full_policy: FullPolicy = full_policy
        self.block_timeout_seconds = block_timeout_seconds
        self.flush_max_events = flush_max_events
        self.flush_wait_seconds = flush_wait_seconds
        self._incoming = 0
        self.on_committed = on_committed
        self.tracker = SeqTracker.load(store)
        self._last_stamp: datetime | None = latest_ingested_at(store)
        self._queue: deque[_Item] = deque()
        self._queued_events = 0
        self._cond = threading.Condition()
        self._closed = False
        self._flushing = 0
        metrics.set_ingest_queue_source(lambda: self._queued_events + self._flushing)
        metrics.set_missing_batches_source(self.tracker.missing)
        self._summary_thread = ThreadPoolExecutor(1, thread_name_prefix="kvscope-ingest-summary")
        self._thread = threading.Thread(target=self._run, name="kvscope-ingest", daemon=True)
        self._thread.start()

    @property
    def depth_events(self) -> int:
        """Events queued or being flushed now."""
        return self._queued_events + self._flushing

    def submit(self, batch: PreparedBatch) -> Future[IngestOutcome]:
        """Queue ``batch``; the future resolves after its transaction committed.

        Raises:
            QueueFull: no room (``reject``: at once; ``block``: after the timeout).
            IngestorClosed: :meth:`close` was called.
        """
        future: Future[IngestOutcome] = Future()
        deadline = time.monotonic() + self.block_timeout_seconds
        with self._cond:
            while True:
                if self._closed:
                    raise IngestorClosed("the agent is shutting down")
                if self._queued_events == 0 or self._queued_events + batch.events <= self.max_queue_events:
                    break
                remaining = deadline - time.monotonic()
                if self.full_policy == "reject" or remaining <= 0:
                    raise QueueFull(
                        f"ingest queue full ({self._queued_events} of {self.max_queue_events} "
                        f"events queued); retry later"
                    )
                self._cond.wait(remaining)
            self._queue.append(_Item(batch, future))
            self._queued_events += batch.events
            self._cond.notify_all()
        return future

    @contextmanager
    def incoming(self) -> Iterator[None]:
        """Mark one batch as on its way (received, being decoded) for the block: a flush starting
        meanwhile waits up to ``flush_wait_seconds`` for it (:meth:`submit` or the block's end
        releases the wait)."""
        with self._cond:
            self._incoming += 1
        try:
            yield
        finally:
            with self._cond:
                self._incoming -= 1
                self._cond.notify_all()

    def close(self, timeout_seconds: float | None = 30.0) -> None:
        """Take no more batches, flush the queued ones, stop the thread. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_seconds)
        if not self._thread.is_alive():  # a flusher still running shuts it down itself (_run)
            self._summary_thread.shutdown(wait=True)

    # -- flusher thread ----------------------------------------------------------------------------
    def _stamp(self) -> datetime:
        """``ingested_at`` for the next flush: now, but always after the previous flush's."""
        now = utc_now()
        if self._last_stamp is not None and now <= self._last_stamp:
            now = self._last_stamp + timedelta(microseconds=1)
        self._last_stamp = now
        return now

    def _take(self) -> list[_Item] | None:
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            deadline = time.monotonic() + self.flush_wait_seconds
            while self._incoming and self._queued_events < self.flush_max_events and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            items: list[_Item] = []
            events = 0
            while self._queue and (not items or events + self._queue[0].batch.events <= self.flush_max_events):
                item = self._queue.popleft()
                items.append(item)
                events += item.batch.events
            self._queued_events -= events
            self._flushing = events
            self._cond.notify_all()
            return items

    def _run(self) -> None:
        while True:
            items = self._take()
            if items is None:
                self._summary_thread.shutdown(wait=False)
                return
            try:
                self._flush(items)
            except BaseException as exc:  # never leave a request waiting forever
                for item in items:
                    _settle(item.future, error=exc)
                log.exception("ingest flush failed")
            finally:
                with self._cond:
                    self._flushing = 0

    def _start_summary(self, pending: list[Future[BatchSummary]], tables: dict[str, pa.Table]) -> None:
        pending.append(self._summary_thread.submit(summarize_tables, tables))

    def _summarise(self, pending: list[Future[BatchSummary]], outcomes: Sequence[IngestOutcome]) -> None:
        """Add the flush's summary (computed on the summary thread while DuckDB inserted and
        committed the rows) to the event metrics; a failure here is logged, never turned into a
        refusal of batches already committed."""
        if not pending:
            return
        started = time.perf_counter()
        try:
            self.metrics.observe_summary(pending[0].result(), outcomes[0].committed_at)
        except Exception:
            log.exception("summarising a flush of %d batches for the metrics failed", len(outcomes))
        self.metrics.stages.add("summary", time.perf_counter() - started)

    def _flush(self, items: list[_Item]) -> None:
        groups = [items]
        while groups:
            group = groups.pop(0)
            at = self._stamp()
            try:
                pending: list[Future[BatchSummary]] = []
                flush = write_flush(
                    self.store,
                    self.tracker,
                    [i.batch for i in group],
                    ingested_at=at,
                    on_tables=functools.partial(self._start_summary, pending),
                )
            except Exception as exc:
                if len(group) > 1:
                    log.warning("a flush of %d batches failed (%s); writing them one by one", len(group), exc)
                    groups[:0] = [[item] for item in group]
                    continue
                log.error("batch seq=%d of %s not stored: %s", group[0].batch.seq, group[0].batch.engine_id, exc)
                self.metrics.observe_rejected("store_error")
                _settle(group[0].future, error=exc if isinstance(exc, duckdb.Error | StoreClosedError) else StoreWriteError(str(exc)))
                continue
            outcomes = flush.outcomes
            self.metrics.stages.add("insert", flush.insert_seconds)
            self.metrics.stages.add("commit", flush.commit_seconds)
            self.metrics.stages.flush_batches.observe(len(group))
            self._summarise(pending, outcomes)
            if self.on_committed is not None:
                try:
                    self.on_committed(outcomes)
                except Exception as exc:
                    log.exception("recording the acknowledgement of %d committed batches failed", len(group))
                    for item in group:
                        _settle(item.future, error=StoreWriteError(f"acknowledgement log: {exc}"))
                    continue
            for item, outcome in zip(group, outcomes, strict=True):
                if outcome.gap is not None:
                    self.metrics.seq_gaps.inc()
                    log.warning(
                        "engine %s skipped seqs %d..%d (never received: dropped by its client or still in flight)",
                        outcome.engine_id,
                        *outcome.gap,
                    )
                _settle(item.future, outcome)
