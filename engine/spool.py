"""The telemetry client's local spool: every batch, kept on disk from before it is sent until
the agent says it is **durable**, and re-sent oldest first (DESIGN.md §5; the persistent-queue
pattern of Vector's disk buffers and the OpenTelemetry Collector's file storage, with Kafka's
"delete only what the broker made durable").

Three positions over the records, oldest first:

* the **durable offset** (saved): every record before it is durable at the agent (a checkpoint
  followed its acknowledgement: the agent's checkpoint epoch, :mod:`agent.durability`, moved past
  the one it was acknowledged at), or was refused for good;
* the **send offset** (in memory): records between the two were acknowledged as committed but
  are not durable yet; they are kept, and :meth:`Spool.rewind` makes them unsent again (the
  agent restarted and may have lost its WAL);
* the end: records after the send offset are not sent yet (a backlog while the agent is down).

File format: an append-only sequence of records ``[u32 length][u32 crc32][u32 events][payload]``
(little endian; ``payload`` = one encoded batch — Arrow IPC, or msgpack from an older engine, told apart by
:func:`engine.events_arrow.sniff_format` when it is sent; the CRC covers the event count and the
payload). A sidecar ``<name>.offset`` holds the durable offset and the spool file's inode (16
bytes; an 8-byte one from an older engine holds the offset alone), replaced atomically; when
every record is durable both files are truncated. Once the durable prefix is at least
:data:`COMPACT_MIN_BYTES` and at least as long as what follows it, the rest is copied to a new
file that replaces the spool (**compaction**): the new inode is saved with offset 0 *before* the
rename, so a crash in between replays the old file from its start — duplicates, which the
agent's idempotent ingest absorbs, never a loss. A second sidecar ``<name>.seq`` holds the
engine's next batch ``seq`` (8 bytes, little endian, rewritten in place before each batch is
sent), so an engine restarted with its spool continues its seq instead of reusing one. A record
cut short by a crash, or one whose CRC fails, ends the readable part: the rest of the file is
dropped and counted (:attr:`Spool.corrupt_records`), loudly.

When the disk budget is reached, records acknowledged but not durable yet are released first
(oldest first, down to three quarters of the budget so one compaction serves many appends;
counted in :attr:`Spool.released_records`, logged): they are committed at the agent and lost only
if its WAL is damaged too. A new batch is refused — releasing nothing — when the unsent backlog
alone leaves no room. A compaction writes the part after the durable offset to a new file before
the old one is removed: for that moment the spool holds up to twice what it keeps.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import zlib
from collections import deque
from pathlib import Path

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<III")
_OFFSET = struct.Struct("<QQ")
COMPACT_MIN_BYTES = 1 << 20
"""The durable prefix is compacted away once it is at least this long (and at least as long as
the rest)."""


class Spool:
    """One engine's spool file.

    Args:
        path: the spool file (created with its directory when missing; an existing one is
            replayed from its saved offset).
        max_bytes: disk budget; :meth:`append` refuses a record that would exceed it.

    Raises:
        ValueError: the path cannot be created or opened, or ``max_bytes`` is not positive.
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"spool budget must be positive, got {max_bytes}")
        self.path = path
        self.max_bytes = max_bytes
        self._offset_path = path.with_name(path.name + ".offset")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a+b")  # noqa: SIM115 - kept open for the client's life
        except OSError as exc:
            raise ValueError(f"telemetry spool {path}: {exc}") from None
        self.corrupt_records = 0
        self.released_records = 0
        """Acknowledged records given up before they were durable, to make room (budget full)."""
        self.path.with_name(path.name + ".compact").unlink(missing_ok=True)  # a compaction cut short
        self._seq_path = path.with_name(path.name + ".seq")
        try:
            self._seq_fd = os.open(self._seq_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ValueError(f"telemetry spool {self._seq_path}: {exc}") from None
        self._offset = self._read_offset()
        self._size = self._file.seek(0, os.SEEK_END)
        if self._offset > self._size:
            log.error("telemetry spool %s: saved offset %d beyond the file (%d bytes); replaying from the start", path, self._offset, self._size)
            self._offset = 0
        self._send_offset = self._offset
        self._resend_end = self._offset
        self._awaiting: deque[list[int]] = deque()
        """[end offset, checkpoint epoch at acknowledgement (-1: durable already)] per record in
        [durable offset, send offset), in file order (epochs never decrease along it)."""

    # -- state -----------------------------------------------------------------------------------
    @property
    def pending_bytes(self) -> int:
        """Bytes of records not durable yet (unsent, or acknowledged and awaiting durability)."""
        return self._size - self._offset

    @property
    def unsent_bytes(self) -> int:
        """Bytes of records not sent (or not acknowledged) yet: the backlog."""
        return self._size - self._send_offset

    @property
    def awaiting_records(self) -> int:
        """Records acknowledged but not durable yet."""
        return len(self._awaiting)

    @property
    def resending(self) -> bool:
        """Whether the next record to send was acknowledged before a :meth:`rewind`."""
        return self._send_offset < self._resend_end

    def __bool__(self) -> bool:
        """Whether anything is left to send."""
        return self.unsent_bytes > 0

    # -- writing -----------------------------------------------------------------------------------
    def append(self, payload: bytes, events: int) -> bool:
        """Append one record (flushed to the OS; not fsynced). When it would exceed the disk
        budget, acknowledged records not durable yet are released (oldest first, logged) and the
        spool compacted to make room; returns False, writing nothing, when that is not enough."""
        record_size = _HEADER.size + len(payload)
        released = self.released_records
        if self._size + record_size > self.max_bytes and not self._make_room(record_size):
            return False
        if self.released_records > released:
            log.warning(
                "telemetry spool %s is full: %d acknowledged batches released before the agent made them durable",
                self.path,
                self.released_records - released,
            )
        crc = zlib.crc32(payload, zlib.crc32(struct.pack("<I", events)))
        self._file.seek(0, os.SEEK_END)
        self._file.write(_HEADER.pack(len(payload), crc, events) + payload)
        self._file.flush()
        self._size += record_size
        return True

    # -- reading -----------------------------------------------------------------------------------
    def peek(self) -> tuple[bytes, int] | None:
        """The oldest record not sent yet: (payload, events), or None when there is none. A
        truncated or corrupted record drops the rest of the file (counted, logged)."""
        if not self.unsent_bytes:
            return None
        self._file.seek(self._send_offset)
        header = self._file.read(_HEADER.size)
        if len(header) == _HEADER.size:
            length, crc, events = _HEADER.unpack(header)
            payload = self._file.read(length)
            if len(payload) == length and zlib.crc32(payload, zlib.crc32(struct.pack("<I", events))) == crc:
                return payload, events
        self.corrupt_records += 1
        log.error(
            "telemetry spool %s: record at byte %d is truncated or corrupted; dropping the %d bytes after it",
            self.path,
            self._send_offset,
            self.unsent_bytes,
        )
        self._file.truncate(self._send_offset)
        self._size = self._send_offset
        self._reset_if_done()
        return None

    def pop(self) -> None:
        """Mark the oldest unsent record delivered for good (durable, or refused by the agent):
        ``sent(seq=None)``.

        Raises:
            RuntimeError: nothing is unsent (a caller bug).
        """
        self.sent(None)

    def sent(self, epoch: int | None) -> None:
        """The oldest unsent record was acknowledged at checkpoint ``epoch``: kept until
        :meth:`release` is given a higher epoch; ``None``: durable already (an agent without
        watermarks, or a refused batch) — dropped once every record before it is durable.

        Raises:
            RuntimeError: nothing is unsent (a caller bug).
        """
        if not self.unsent_bytes:
            raise RuntimeError("telemetry spool: sent() with nothing unsent")
        self._file.seek(self._send_offset)
        (length, _, _) = _HEADER.unpack(self._file.read(_HEADER.size))
        self._send_offset += _HEADER.size + length
        self._awaiting.append([self._send_offset, -1 if epoch is None else epoch])
        self._advance()

    def release(self, epoch: int | None) -> None:
        """The agent's checkpoint epoch now (same agent process): records acknowledged at a
        lower epoch are durable and dropped (oldest first)."""
        if epoch is not None:
            for entry in self._awaiting:
                if entry[1] >= epoch:
                    break
                entry[1] = -1
        self._advance()

    def rewind(self) -> None:
        """Make every acknowledged, not durable record unsent again (to re-send it: the agent
        restarted and may have lost what it had not made durable)."""
        self._resend_end = max(self._resend_end, self._send_offset)
        self._send_offset = self._offset
        self._awaiting.clear()

    # -- the engine's seq ---------------------------------------------------------------------------
    @property
    def next_seq(self) -> int:
        """The seq the next batch takes: what was saved, 0 for a new spool."""
        data = os.pread(self._seq_fd, 8, 0)
        if len(data) != 8:
            if data:
                log.error("telemetry spool %s: unreadable seq file; starting at seq 0", self.path)
            return 0
        return int.from_bytes(data, "little")

    def save_next_seq(self, seq: int) -> None:
        """Record that ``seq`` is the next one to use (before the batch before it is sent)."""
        os.pwrite(self._seq_fd, seq.to_bytes(8, "little"), 0)

    def close(self) -> None:
        self._file.close()
        os.close(self._seq_fd)

    # -- internals ---------------------------------------------------------------------------------
    def _make_room(self, record_size: int) -> bool:
        """Give up acknowledged, not yet durable records (oldest first) so that ``record_size``
        more bytes fit — and a quarter of the budget besides, so that one compaction serves
        many appends; False, giving up nothing, when even releasing all of them is not enough."""
        unsent = self._size - self._send_offset
        if unsent + record_size > self.max_bytes:
            return False
        goal = max(self.max_bytes - record_size - self.max_bytes // 4, unsent)
        start = self._offset
        for entry in self._awaiting:
            if self._size - start <= goal:
                break
            if entry[1] >= 0:
                entry[1] = -1
                self.released_records += 1
            start = entry[0]
        self._advance()
        self._compact(force=True)
        return self._size + record_size <= self.max_bytes

    def _advance(self) -> None:
        """Move the durable offset over the durable records at the front; save it; compact."""
        moved = False
        while self._awaiting and self._awaiting[0][1] < 0:
            self._offset = self._awaiting.popleft()[0]
            moved = True
        if not moved or self._reset_if_done():
            return
        self._write_offset()
        self._compact()

    def _reset_if_done(self) -> bool:
        if self._offset < self._size:
            return False
        self._file.truncate(0)
        self._offset = self._size = self._send_offset = self._resend_end = 0
        self._awaiting.clear()
        self._write_offset()
        return True

    def _compact(self, *, force: bool = False) -> None:
        """Copy the records after the durable offset into a new file replacing the spool (see
        the module docstring for the crash order)."""
        start = self._offset
        if start == 0 or (not force and (start < COMPACT_MIN_BYTES or start < self._size - start)):
            return
        tmp = self.path.with_name(self.path.name + ".compact")
        with open(tmp, "wb") as out:
            self._file.seek(start)
            shutil.copyfileobj(self._file, out)
            out.flush()
            os.fsync(out.fileno())
        self._write_offset(0, os.stat(tmp).st_ino)
        os.replace(tmp, self.path)
        self._file.close()
        self._file = open(self.path, "a+b")  # noqa: SIM115 - kept open for the client's life
        self._offset = 0
        self._size -= start
        self._send_offset -= start
        self._resend_end = max(self._resend_end - start, 0)
        for entry in self._awaiting:
            entry[0] -= start

    def _read_offset(self) -> int:
        try:
            data = self._offset_path.read_bytes()
        except FileNotFoundError:
            return 0
        if len(data) == 8:  # an older engine's: the offset alone
            return int.from_bytes(data, "little")
        if len(data) != _OFFSET.size:
            log.error("telemetry spool %s: unreadable offset file; replaying from the start", self.path)
            return 0
        offset, inode = _OFFSET.unpack(data)
        if inode != os.fstat(self._file.fileno()).st_ino:
            log.warning("telemetry spool %s: its offset belongs to another file (a compaction was cut short); replaying it from the start", self.path)
            return 0
        return int(offset)

    def _write_offset(self, offset: int | None = None, inode: int | None = None) -> None:
        tmp = self._offset_path.with_name(self._offset_path.name + ".tmp")
        value = self._offset if offset is None else offset
        ino = os.fstat(self._file.fileno()).st_ino if inode is None else inode
        tmp.write_bytes(_OFFSET.pack(value, ino))
        os.replace(tmp, self._offset_path)
