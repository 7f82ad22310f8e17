"""The telemetry client's local spool: batches the agent could not take yet, kept on disk and
re-sent oldest first (DESIGN.md §5; the persistent-queue pattern of Vector's disk buffers and the
OpenTelemetry Collector's file storage).

File format: an append-only sequence of records ``[u32 length][u32 crc32][u32 events][payload]``
(little endian; ``payload`` = one encoded batch; the CRC covers the event count and the
payload). A sidecar ``<name>.offset`` holds how far the records were delivered, replaced
atomically after each delivery; when every record is delivered both files are truncated. A
second sidecar ``<name>.seq`` holds the engine's next batch ``seq`` (8 bytes, little endian,
rewritten in place before each batch is sent), so an engine restarted with its spool continues
its seq instead of reusing one. A
record cut short by a crash, or one whose CRC fails, ends the readable part: the rest of the file
is dropped and counted (:attr:`Spool.corrupt_records`), loudly.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<III")


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

    # -- state -----------------------------------------------------------------------------------
    @property
    def pending_bytes(self) -> int:
        """Bytes of records not yet delivered."""
        return self._size - self._offset

    def __bool__(self) -> bool:
        return self.pending_bytes > 0

    # -- writing -----------------------------------------------------------------------------------
    def append(self, payload: bytes, events: int) -> bool:
        """Append one record (flushed to the OS; not fsynced). Returns False, writing nothing,
        when it would exceed the disk budget."""
        record_size = _HEADER.size + len(payload)
        if self._size + record_size > self.max_bytes:
            return False
        crc = zlib.crc32(payload, zlib.crc32(struct.pack("<I", events)))
        self._file.seek(0, os.SEEK_END)
        self._file.write(_HEADER.pack(len(payload), crc, events) + payload)
        self._file.flush()
        self._size += record_size
        return True

    # -- reading -----------------------------------------------------------------------------------
    def peek(self) -> tuple[bytes, int] | None:
        """The oldest undelivered record: (payload, events), or None when there is none. A
        truncated or corrupted record drops the rest of the file (counted, logged)."""
        if not self.pending_bytes:
            return None
        self._file.seek(self._offset)
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
            self._offset,
            self.pending_bytes,
        )
        self._file.truncate(self._offset)
        self._size = self._offset
        self._reset_if_done()
        return None

    def pop(self) -> None:
        """Mark the oldest record delivered (the saved offset moves past it).

        Raises:
            RuntimeError: nothing is pending (a caller bug).
        """
        if not self.pending_bytes:
            raise RuntimeError("telemetry spool: pop with nothing pending")
        self._file.seek(self._offset)
        (length, _, _) = _HEADER.unpack(self._file.read(_HEADER.size))
        self._offset += _HEADER.size + length
        if not self._reset_if_done():
            self._write_offset()

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
    def _reset_if_done(self) -> bool:
        if self._offset < self._size:
            return False
        self._file.truncate(0)
        self._offset = self._size = 0
        self._write_offset()
        return True

    def _read_offset(self) -> int:
        try:
            data = self._offset_path.read_bytes()
        except FileNotFoundError:
            return 0
        if len(data) != 8:
            log.error("telemetry spool %s: unreadable offset file; replaying from the start", self.path)
            return 0
        return int.from_bytes(data, "little")

    def _write_offset(self) -> None:
        tmp = self._offset_path.with_name(self._offset_path.name + ".tmp")
        tmp.write_bytes(self._offset.to_bytes(8, "little"))
        os.replace(tmp, self._offset_path)
