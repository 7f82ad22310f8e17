"""The disk tier's file format and directory (DESIGN.md §3 "Tiers").

One file per object under the tier directory, in the safetensors format: the object's tensors by
name, and a header carrying the format (:data:`FILE_FORMAT`), the pool, the prefix hash, the
object's stamp, the layout fingerprint of every tensor and a SHA-256 over the header fields that
name the object (:data:`HEADER_FIELDS`) and the tensor bytes. A file is written atomically (a
temporary file renamed into place); a read verifies fingerprints and checksum and names the
reason a file is refused: ``offload_corrupt`` (unreadable, truncated, checksum mismatch) or
``layout_mismatch`` (written for another layout). One engine uses a directory at a time
(:class:`DirectoryLock`).

The tier store (:class:`engine.cache.tiers.TierStore`) decides what is written and read; this
module only knows the bytes on disk. File format: safetensors.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import safetensors
import safetensors.torch
import torch
from torch import Tensor

from engine.cache.forms import Stamp
from engine.cache.hashing import BlockHash
from engine.cache.layout_contract import LayoutFingerprint
from engine.events import Reason

FILE_FORMAT = "kvscope-tier-object/1"
"""``format`` in every tier file's header; files of another format are skipped."""

FILE_SUFFIX = ".safetensors"

LOCK_FILE = ".lock"
"""Held (``flock``) by the engine using a disk tier directory: one engine per directory."""

HEADER_FIELDS = ("pool", "hash", "stamp", "fingerprints")
"""Header fields the checksum covers besides the tensor bytes."""


def fingerprint_text(fp: LayoutFingerprint) -> str:
    """A layout fingerprint as written into a tier file's header."""
    return json.dumps([str(fp.dtype), list(fp.block_shape), list(fp.axis_order), fp.kernel_abi, fp.model_revision])


def stamp_to_json(stamp: Stamp) -> str:
    """A stamp as written into a tier file's header (hashes as hex strings)."""
    return json.dumps([s.hex() if isinstance(s, bytes) else s for s in stamp])


def stamp_from_json(text: str) -> Stamp:
    """Inverse of :func:`stamp_to_json` (hex strings are hashes).

    Raises:
        ValueError: not a JSON list of integers, nulls and hex strings.
    """
    values = json.loads(text)
    if not isinstance(values, list):
        raise ValueError("stamp is not a list")
    out: list[int | bytes | None] = []
    for v in values:
        if v is None or isinstance(v, int):
            out.append(v)
        elif isinstance(v, str):
            out.append(bytes.fromhex(v))
        else:
            raise ValueError(f"stamp value {v!r}")
    return tuple(out)


def checksum(tensors: dict[str, Tensor], metadata: dict[str, str]) -> str:
    """SHA-256 (hex) over the header fields that name the object and the tensors' bytes in name
    order."""
    h = hashlib.sha256()
    for key in HEADER_FIELDS:
        h.update(f"{key}={metadata.get(key, '')}\n".encode())
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def file_path(directory: Path, pool: str, h: BlockHash) -> Path:
    """Where the object of ``pool`` under ``h`` is written: the same path for the same object."""
    return directory / f"{hashlib.sha1(pool.encode()).hexdigest()[:10]}-{h.hex()}{FILE_SUFFIX}"


def file_metadata(pool: str, h: BlockHash, stamp: Stamp, fingerprints: dict[str, str]) -> dict[str, str]:
    """The header of an object's file (the checksum is added when it is written)."""
    return {
        "format": FILE_FORMAT,
        "pool": pool,
        "hash": h.hex(),
        "stamp": stamp_to_json(stamp),
        "fingerprints": json.dumps(fingerprints, sort_keys=True),
    }


def write_file(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str], corrupt: bool) -> None:
    """Write one tier file atomically (a temporary file renamed into place); ``corrupt``: fault
    injection, flip the last byte of the tensor data. Runs on a worker thread.

    Raises:
        OSError: the file cannot be written.
    """
    meta = {**metadata, "checksum": checksum(tensors, metadata)}
    data = safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if corrupt:  # fault injection: flip the last byte of the tensor data
            f.seek(len(data) - 1)
            f.write(bytes([data[-1] ^ 0xFF]))
    os.replace(tmp, path)


def read_file(path: Path, fingerprints: dict[str, str]) -> tuple[dict[str, Tensor], dict[str, str]] | Reason:
    """Load and verify one tier file: ``(tensors, header metadata)``, or the reason it is
    refused (``offload_corrupt``: unreadable, truncated or a checksum mismatch;
    ``layout_mismatch``: written for another layout than ``fingerprints``)."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception:
        return Reason.OFFLOAD_CORRUPT
    try:
        stored = json.loads(meta.get("fingerprints", "null"))
    except ValueError:
        return Reason.OFFLOAD_CORRUPT
    if stored != fingerprints:
        return Reason.LAYOUT_MISMATCH
    if meta.get("checksum") != checksum(tensors, meta):
        return Reason.OFFLOAD_CORRUPT
    return tensors, meta


# -- a directory left by an earlier run ----------------------------------------------------------
class StoredObject(NamedTuple):
    """What a verified tier file holds: the object's hash and stamp, and its size in bytes."""

    block_hash: BlockHash
    stamp: Stamp
    nbytes: int


def leftover_files(directory: Path) -> list[Path]:
    """The tier files in ``directory``, oldest first (by modification time); partial writes (a
    write cut short by a crash) are deleted first."""
    for partial in directory.glob("*.tmp"):
        partial.unlink(missing_ok=True)
    stamped = []
    for path in directory.glob(f"*{FILE_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile
            stamped.append((path.stat().st_mtime, path))
    return [path for _, path in sorted(stamped)]


def load_object(path: Path, fingerprints: dict[str, str]) -> StoredObject | Reason:
    """Verify a tier file (:func:`read_file`) and read the object it names from its header, or
    the reason it is refused (``offload_corrupt`` also for a header whose hash or stamp does not
    parse, or whose stamp does not start with a boundary in tokens)."""
    loaded = read_file(path, fingerprints)
    if isinstance(loaded, Reason):
        return loaded
    tensors, meta = loaded
    try:
        h = bytes.fromhex(meta["hash"])
        stamp = stamp_from_json(meta["stamp"])
        if stamp and not isinstance(stamp[0], int):
            raise ValueError("a stamp starts with its boundary in tokens")
    except (KeyError, ValueError):
        return Reason.OFFLOAD_CORRUPT
    return StoredObject(h, stamp, sum(t.numel() * t.element_size() for t in tensors.values()))


class Leftover(NamedTuple):
    """One file of a tier directory left by an earlier run, as :func:`recover` found it."""

    path: Path
    pool: str | None
    """The pool its header names (None: unreadable, another format, or no pool)."""
    found: StoredObject | Reason | None
    """The object it holds, the reason it is refused, or None: another format or a pool not in
    the ``fingerprints`` given (left alone: it may belong to another model)."""


def recover(directory: Path, fingerprints: Mapping[str, dict[str, str]]) -> Iterator[Leftover]:
    """The tier files in ``directory`` (:func:`leftover_files`, oldest first), each read and
    verified (:func:`load_object`) against the fingerprints of the pool its header names; an
    unreadable header is ``offload_corrupt``. Lazy: one file at a time."""
    for path in leftover_files(directory):
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception:
            yield Leftover(path, None, Reason.OFFLOAD_CORRUPT)
            continue
        pool = meta.get("pool")
        if meta.get("format") != FILE_FORMAT or pool is None or pool not in fingerprints:
            yield Leftover(path, pool, None)
            continue
        yield Leftover(path, pool, load_object(path, fingerprints[pool]))


class DirectoryLock:
    """An exclusive ``flock`` on :data:`LOCK_FILE` in a disk tier directory (created if needed),
    held until :meth:`release` or until the lock is garbage-collected (an engine dropped without
    closing gives the directory back).

    Raises:
        ValueError: the directory cannot be created, or another engine holds it.
    """

    def __init__(self, directory: Path) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ValueError(f"disk tier directory {directory}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ValueError(
                f"disk tier directory {directory} is in use by another engine; give each engine its own "
                "CacheConfig.disk_tier_dir"
            ) from None
        self._close = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        """Close the descriptor, which releases the lock (again: nothing)."""
        self._close()
