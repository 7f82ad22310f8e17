"""End-to-end acknowledgement: the acknowledgement log, the checkpoint epoch and the durable
watermarks.

An agent's answer to a batch says *committed*: DuckDB wrote and synced its WAL. A WAL can still
be damaged afterwards (a flipped byte, a truncation), and then batches the agent acknowledged
are gone. So the agent also tells, with every answer, when a batch is **durable** — in a
*checkpointed* database file, not only in the WAL: the answer carries the **checkpoint epoch**
read after the batch's commit, and the batch is durable once a later answer or poll shows a
higher epoch from the same agent process (:class:`Durability`). Per engine it also publishes a
**durable watermark** ``durable_seq``: the highest seq stored in the last checkpoint. The
engine's telemetry client keeps each spooled batch until it is durable, and re-sends every batch
not yet durable whenever it meets a new agent process (a new ``agent_instance``): batches lost
with a damaged WAL are sent again and stored once (the agent is idempotent on (engine_id, seq)).
This is the contract of the OpenTelemetry Collector's persistent queue and of Kafka's ``acks``:
a sender deletes only what the receiver has made durable. The protocol is written down in
``docs/agent.md``.

* :class:`AckLog` — ``<database>.acks`` beside the database: one record per flush listing the
  (engine_id, seq) of the batches it stored, appended after the commit and before any answer is
  sent, emptied after each checkpoint. At start the agent compares it with ``ingest_batches``
  (:func:`agent.wal_guard.missing_acknowledged`): a batch in the log but not in the database was
  acknowledged and lost — the silent WAL damages (a WAL that replays short) become visible.
  Records are ``[u32 length][u32 crc32][msgpack [[engine_id, seq], ...]]``; a torn or corrupt
  record ends the readable part (it belongs to a flush whose answers were never sent). Writes
  reach the OS (not fsynced): they survive any crash of the agent process, and the epoch, not
  this log, is what keeps data — the log only makes a loss visible.
* :class:`Durability` — the checkpoint epoch, the watermarks and the agent instance id.
  :meth:`Durability.checkpoint` runs ``CHECKPOINT`` under the store's writer lock, then advances
  the epoch, moves every engine's watermark to its highest stored seq and empties the log.

Raises nothing a user can cause; file errors on the log raise ``OSError`` to the flusher, which
then answers 503 (the batch is committed and will be a duplicate when re-sent).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import msgspec

from agent.ingest import IngestOutcome
from agent.seq_tracker import SeqTracker
from agent.store import Store

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[tuple[str, int]])


def ack_log_path(db_path: Path) -> Path:
    """Where the acknowledgement log of the database ``db_path`` lives."""
    return db_path.with_name(db_path.name + ".acks")


class AckLog:
    """The append-only acknowledgement log (see the module docstring). Thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")  # noqa: SIM115 - kept open for the agent's life

    def append(self, stored: Iterable[tuple[str, int]]) -> None:
        """Record one flush's stored batches (engine_id, seq); nothing for an empty flush."""
        pairs = list(stored)
        if not pairs:
            return
        payload = _ENCODER.encode(pairs)
        record = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        with self._lock:
            self._file.write(record)
            self._file.flush()

    def clear(self) -> None:
        """Empty the log (everything it listed is in a checkpointed file)."""
        with self._lock:
            self._file.truncate(0)
            self._file.seek(0)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    @staticmethod
    def read(path: Path) -> tuple[list[tuple[str, int]], int]:
        """Every (engine_id, seq) the log at ``path`` lists, and how many bytes at its end were
        unreadable (a torn last record). A missing file lists nothing."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return [], 0
        pairs: list[tuple[str, int]] = []
        at = 0
        while at + _HEADER.size <= len(data):
            length, crc = _HEADER.unpack_from(data, at)
            payload = data[at + _HEADER.size : at + _HEADER.size + length]
            if len(payload) != length or zlib.crc32(payload) != crc:
                break
            try:
                pairs.extend(_DECODER.decode(payload))
            except msgspec.DecodeError:
                break
            at += _HEADER.size + length
        return pairs, len(data) - at


class Durability:
    """The checkpoint epoch, per-engine durable watermarks, the acknowledgement log and this
    process's instance id.

    Args:
        store: the open store.
        ack_log: where flushes record their stored batches (:meth:`record`).

    :meth:`attach` gives it the ingest pipeline's seq tracker (what was stored) before the first
    checkpoint.

    The **checkpoint epoch** counts the checkpoints this process completed. Each answer carries
    it, read after the batch's commit: a batch acknowledged at epoch ``e`` is in every checkpoint
    numbered above ``e`` (checkpoints and commits both hold the writer lock, so a checkpoint that
    completes after the epoch was read started after the commit). A client deletes a batch once
    it sees an epoch above the one it was acknowledged at, from the same ``instance`` — which
    stays true whatever order batches arrived in and whatever was lost. ``durable_seq`` per
    engine (the highest seq of the 0-based numbering stored in the last checkpoint) is published
    for operators and tools.
    """

    def __init__(self, store: Store, ack_log: AckLog) -> None:
        self.store = store
        self.ack_log = ack_log
        self.instance = uuid.uuid4().hex
        """Changes with every agent process: a client that sees a new one re-sends every batch
        not yet durable."""
        self._tracker: SeqTracker | None = None
        self._lock = threading.Lock()
        self._durable: dict[str, int] = {}
        self._missing: dict[str, set[int]] = {}
        self._epoch = 0
        self._sync_lock = threading.Lock()
        self._checkpoint_started = 0.0

    def attach(self, tracker: SeqTracker) -> None:
        """Read stored seqs from ``tracker`` (the ingest pipeline's)."""
        self._tracker = tracker

    def record(self, outcomes: Sequence[IngestOutcome]) -> None:
        """The pipeline's ``on_committed`` hook: log the flush's stored batches."""
        self.ack_log.append((o.engine_id, o.seq) for o in outcomes if o.status == "stored")

    def _is_stored(self, engine_id: str, seq: int) -> bool:
        return self._tracker is not None and self._tracker.is_stored(engine_id, seq)

    @property
    def epoch(self) -> int:
        """Checkpoints this process completed (0 before the one at start)."""
        with self._lock:
            return self._epoch

    def durable_seq(self, engine_id: str) -> int | None:
        """The highest seq of ``engine_id`` (0-based numbering) stored in a checkpointed file as
        of the last checkpoint; None before its first."""
        with self._lock:
            return self._durable.get(engine_id)

    def awaiting_resend(self) -> int:
        """Batches found missing at start that are not stored again yet."""
        with self._lock:
            missing = [(e, s) for e, seqs in self._missing.items() for s in seqs]
        return sum(1 for e, s in missing if not self._is_stored(e, s))

    def start(self, missing: Mapping[str, Iterable[int]]) -> None:
        """At start, after the missing batches were found (counted by :meth:`awaiting_resend`
        until stored again): checkpoint, so everything in the file is durable at epoch 1."""
        with self._lock:
            for engine_id, seqs in missing.items():
                self._missing.setdefault(engine_id, set()).update(seqs)
        self.checkpoint()

    def checkpoint(self) -> None:
        """``CHECKPOINT`` the store, then advance the epoch, update the watermarks and empty the
        acknowledgement log — under the writer lock, so no flush commits in between.

        Raises:
            duckdb.Error, StoreClosedError: the checkpoint failed; epoch, watermarks and log
                unchanged.
        """
        started = time.monotonic()
        self.store.checkpoint(after=self._checkpointed)
        with self._lock:
            self._checkpoint_started = max(self._checkpoint_started, started)

    def sync(self, requested_at: float) -> None:
        """Checkpoint unless one started after ``requested_at`` (``time.monotonic()``): what a
        client closing its spool asks for (``POST /v1/ingest/checkpoint``). Concurrent calls
        wait for one checkpoint instead of running one each.

        Raises:
            duckdb.Error, StoreClosedError: as :meth:`checkpoint`.
        """
        with self._sync_lock:
            with self._lock:
                if self._checkpoint_started > requested_at:
                    return
            self.checkpoint()

    def _checkpointed(self) -> None:
        if self._tracker is None:
            raise RuntimeError("Durability.checkpoint before attach(): no seq tracker")
        tops = self._tracker.stored_tops()
        self.ack_log.clear()
        with self._lock:
            self._durable.update(tops)
            self._epoch += 1
            for engine_id in list(self._missing):
                self._missing[engine_id] = {s for s in self._missing[engine_id] if not self._is_stored(engine_id, s)}
                if not self._missing[engine_id]:
                    del self._missing[engine_id]


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename or a new file in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
