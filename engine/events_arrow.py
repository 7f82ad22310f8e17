"""The Arrow IPC wire format of ``POST /v1/events`` (``application/vnd.apache.arrow.stream``),
schema version 1, generated from :mod:`engine.events` (the one schema module).

**One body, several event kinds.** An Arrow IPC stream has one schema, so a body is a
concatenation of complete IPC streams (each one schema message, its dictionary and record batch
messages and the end-of-stream marker), **one stream per event kind present**, at most one per
kind. Any Arrow reader reads them one after another from the same buffer
(``pyarrow.ipc.open_stream`` leaves the position after a stream's end marker). Every stream's
schema metadata holds the batch header, the same in each: ``kind`` (``cache_lookup``,
``request``, ``engine_stats``, ``block``), ``schema_version``, ``engine_id``, ``seq``,
``sent_at`` (unix seconds) and, when the engine gave one, ``run_id`` (all UTF-8 text). A batch of
no events is one stream of zero rows (its kind does not matter). The body starts with the IPC
continuation marker ``ff ff ff ff``, which no JSON or msgpack batch does (a spool tells its
records apart by it: :func:`sniff_format`).

Encoding (the engine's side) is :mod:`engine.events_arrow_encode`.

**Columns** (:data:`WIRE_SCHEMAS`): one per field of the kind's event struct, in its order and
with its name: integers ``int64`` (``int32`` for a layer group and a tensor-parallel rank),
durations and ``ts`` ``float64`` (unix seconds), flags ``bool``, names ``utf8``, enums
dictionary-encoded ``utf8`` (plain ``utf8`` is accepted too), ``limiting_forms`` a list of
``utf8``. Only the fields typed ``... | None`` are nullable. A column whose field has a default may
be left out (the default fills it); an unknown column is refused. The checks are
:mod:`engine.events_arrow_check`.

The **digest** of an Arrow batch (what tells a re-send from another batch under the same seq) is
a CRC-32 over each stream's kind and the bytes after its schema message: the events, not the
header, so a re-send with another ``sent_at`` is still the same batch.

Peers: the Arrow Flight and ADBC bulk-ingest paths ship record batches with their schema the same
way; https://arrow.apache.org/docs/format/Columnar.html#ipc-streaming-format for the framing.
"""

from __future__ import annotations

import enum
import types
import typing
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import pyarrow as pa
import pyarrow.ipc as ipc

from engine.events import (
    MAX_EVENTS_PER_BATCH,
    SCHEMA_VERSION,
    BlockEvent,
    CacheLookup,
    EngineStats,
    EventError,
    RequestEvent,
)

ARROW_MEDIA_TYPE = "application/vnd.apache.arrow.stream"
CONTINUATION = b"\xff\xff\xff\xff"
"""The first four bytes of every Arrow IPC stream message."""

EVENT_CLASSES: dict[str, type[msgspec.Struct]] = {
    "cache_lookup": CacheLookup,
    "request": RequestEvent,
    "engine_stats": EngineStats,
    "block": BlockEvent,
}
"""Event kind → its struct, in the order an encoder writes the streams."""

WireFormat = Literal["json", "msgpack", "arrow"]
"""The body formats ``POST /v1/events`` takes (:data:`engine.events.ContentFormat` and Arrow)."""

ENUM_TYPE = pa.dictionary(pa.int8(), pa.utf8())
_NO_DEFAULT: Any = msgspec.NODEFAULT


@dataclass(frozen=True, slots=True)
class WireColumn:
    """One column of a kind's stream: its Arrow type and the rules read off the field's
    annotation (``ge``/``le`` bounds, string lengths, enum values)."""

    name: str
    type: pa.DataType
    nullable: bool
    default: Any
    """The field's default (``msgspec.NODEFAULT``: the column is required)."""
    enum_values: tuple[str, ...] | None = None
    """Allowed values of an enum column (or of a list column's items)."""
    ge: float | None = None
    le: float | None = None
    min_length: int | None = None
    max_length: int | None = None

    @property
    def required(self) -> bool:
        return self.default is _NO_DEFAULT


def _column(name: str, hint: object, default: Any) -> WireColumn:
    base: object = hint
    nullable = False
    options = typing.get_args(base) if typing.get_origin(base) in (typing.Union, types.UnionType) else ()
    if len(options) == 2 and type(None) in options:
        nullable = True
        base = next(o for o in options if o is not type(None))
    metas: tuple[object, ...] = ()
    if typing.get_origin(base) is typing.Annotated:
        base, *rest = typing.get_args(base)
        metas = tuple(rest)
    bounds: dict[str, Any] = {}
    for meta in metas:
        for key in ("ge", "le", "min_length", "max_length"):
            if getattr(meta, key, None) is not None:
                bounds[key] = getattr(meta, key)
    if base is bool:
        dtype: pa.DataType = pa.bool_()
    elif base is int:
        dtype = pa.int32() if bounds.get("le") == 2**31 - 1 else pa.int64()
    elif base is float:
        dtype = pa.float64()
    elif base is str:
        dtype = pa.utf8()
    elif isinstance(base, type) and issubclass(base, enum.StrEnum):
        return WireColumn(name, ENUM_TYPE, nullable, default, tuple(m.value for m in base))
    elif typing.get_origin(base) is tuple and typing.get_args(base)[1:] == (Ellipsis,):
        (item,) = typing.get_args(base)[:1]
        assert isinstance(item, type) and issubclass(item, enum.StrEnum), hint
        return WireColumn(name, pa.list_(pa.utf8()), nullable, default, tuple(m.value for m in item))
    else:
        raise TypeError(f"event field {name}: no wire type for {hint!r}")
    return WireColumn(name, dtype, nullable, default, **bounds)


def _columns(cls: type[msgspec.Struct]) -> tuple[WireColumn, ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return tuple(_column(f.name, hints[f.name], f.default) for f in msgspec.structs.fields(cls))


WIRE_COLUMNS: dict[str, tuple[WireColumn, ...]] = {kind: _columns(cls) for kind, cls in EVENT_CLASSES.items()}
"""Event kind → its columns, in field order."""

WIRE_SCHEMAS: dict[str, pa.Schema] = {
    kind: pa.schema([pa.field(c.name, c.type, nullable=c.nullable) for c in columns])
    for kind, columns in WIRE_COLUMNS.items()
}
"""Event kind → the Arrow schema of its stream (without the header metadata)."""

KIND_OF_CLASS: dict[type, str] = {cls: kind for kind, cls in EVENT_CLASSES.items()}


HEADER_KEYS = ("kind", "schema_version", "engine_id", "seq", "sent_at", "run_id")


@dataclass(frozen=True, slots=True)
class ArrowBatch:
    """A decoded Arrow body, before the checks of :mod:`engine.events_arrow_check`.

    ``tables``: event kind → its rows as they came (wire types); ``digest``: see the module
    docstring."""

    schema_version: int
    engine_id: str
    seq: int
    sent_at: float
    run_id: str | None
    tables: dict[str, pa.Table]
    digest: int

    @property
    def events(self) -> int:
        return sum(t.num_rows for t in self.tables.values())


def sniff_format(body: bytes) -> WireFormat:
    """``arrow`` for a body starting with the IPC continuation marker, ``json`` for one starting
    with ``{`` (after white space), else ``msgpack`` (what an older engine's spool records hold)."""
    if body[:4] == CONTINUATION:
        return "arrow"
    return "json" if body.lstrip()[:1] == b"{" else "msgpack"


_MEDIA_TYPES: dict[str, str] = {"arrow": ARROW_MEDIA_TYPE, "json": "application/json", "msgpack": "application/msgpack"}


def media_type(body: bytes) -> str:
    """The ``Content-Type`` of an encoded batch, by :func:`sniff_format`."""
    return _MEDIA_TYPES[sniff_format(body)]


def header_of(body: bytes) -> tuple[str, int] | None:
    """``(engine_id, seq)`` from the first stream's schema metadata, without reading any record
    batch (what a rejected Arrow batch is filed under); None when they cannot be read."""
    if body[:4] != CONTINUATION:
        return None
    try:
        meta = ipc.open_stream(pa.BufferReader(pa.py_buffer(body))).schema.metadata or {}
        return meta[b"engine_id"].decode(), int(meta[b"seq"])
    except (pa.ArrowException, KeyError, ValueError, UnicodeDecodeError, OSError):
        return None


def _text(meta: dict[bytes, bytes], key: str, at: str) -> str:
    value = meta.get(key.encode())
    if value is None:
        raise EventError(f"{at}.{key}", "missing from the stream's schema metadata (the batch header)")
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise EventError(f"{at}.{key}", "is not UTF-8 text") from None


def _header(meta: dict[bytes, bytes], at: str) -> dict[str, object]:
    """The header fields of one stream's metadata, typed and range-checked."""
    version_text = _text(meta, "schema_version", at)
    if version_text != str(SCHEMA_VERSION):
        raise EventError(
            "$.schema_version",
            f"unsupported schema_version {version_text[:40]}; this agent accepts {SCHEMA_VERSION}",
        )
    engine_id = _text(meta, "engine_id", at)
    if not 1 <= len(engine_id) <= 256:
        raise EventError("$.engine_id", "must be 1 to 256 characters")
    try:
        seq = int(_text(meta, "seq", at))
        sent_at = float(_text(meta, "sent_at", at))
    except ValueError as exc:
        raise EventError(f"{at}.seq", f"seq and sent_at must be numbers: {exc}") from None
    if not 0 <= seq <= 2**63 - 1:
        raise EventError("$.seq", "must be between 0 and 2**63 - 1")
    if not 0.0 <= sent_at <= 253_402_300_799.0:  # also refuses nan
        raise EventError("$.sent_at", "must be unix seconds between 0 and 253402300799")
    run_id = meta.get(b"run_id")
    run_text = None
    if run_id is not None:
        run_text = _text(meta, "run_id", at)
        if not 1 <= len(run_text) <= 64 or not all(ch.isascii() and (ch.isalnum() or ch in "._-") for ch in run_text):
            raise EventError("$.run_id", "must be 1 to 64 letters, digits, '.', '_' or '-'")
    return {"schema_version": SCHEMA_VERSION, "engine_id": engine_id, "seq": seq, "sent_at": sent_at, "run_id": run_text}


def decode_body(body: bytes) -> ArrowBatch:
    """Read an Arrow body into its header and one table per kind (not yet checked beyond the
    framing, the header and full Arrow validation of every array).

    Raises:
        EventError: not a sequence of Arrow IPC streams, a stream cut short or malformed, a
            stream without a known ``kind``, a kind twice, headers that differ between streams,
            a header field missing or out of range, another ``schema_version``, or more than
            :data:`engine.events.MAX_EVENTS_PER_BATCH` events.
    """
    if body[:4] != CONTINUATION:
        raise EventError("$", "not an Arrow IPC stream (it must start with the continuation marker ff ff ff ff)")
    buffer = pa.py_buffer(body)
    source = pa.BufferReader(buffer)
    header: dict[str, object] | None = None
    tables: dict[str, pa.Table] = {}
    digest = 0
    index = 0
    while source.tell() < len(body):
        at = f"$.streams[{index}]"
        try:
            reader = ipc.open_stream(source)
            start = source.tell()
            table = reader.read_all()
            table.validate(full=True)
            table.schema.names  # noqa: B018 - field names must be UTF-8, which validation does not check
        except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:  # any of pyarrow's, a dictionary id unknown too
            raise EventError(at, f"malformed Arrow IPC stream: {exc}") from None
        end = source.tell()
        meta = dict(table.schema.metadata or {})
        this = _header(meta, at)
        kind = _text(meta, "kind", at)
        if kind not in EVENT_CLASSES:
            raise EventError(f"{at}.kind", f"unknown event kind {kind[:60]!r}; expected one of {', '.join(EVENT_CLASSES)}")
        if kind in tables:
            raise EventError(f"{at}.kind", f"a second {kind} stream: each kind comes once per batch")
        if header is None:
            header = this
        elif this != header:
            differs = next(k for k in this if this[k] != header[k])
            raise EventError(f"{at}.{differs}", "differs from the first stream's header: one batch has one header")
        digest = zlib.crc32(kind.encode(), digest)
        digest = zlib.crc32(memoryview(body)[start:end], digest)
        tables[kind] = table
        index += 1
    assert header is not None  # the body is not empty: its first four bytes were read
    events = sum(t.num_rows for t in tables.values())
    if events > MAX_EVENTS_PER_BATCH:
        raise EventError("$.events", f"{events} events exceed the limit of {MAX_EVENTS_PER_BATCH}")
    return ArrowBatch(
        schema_version=SCHEMA_VERSION,
        engine_id=str(header["engine_id"]),
        seq=int(typing.cast(int, header["seq"])),
        sent_at=float(typing.cast(float, header["sent_at"])),
        run_id=typing.cast("str | None", header["run_id"]),
        tables=tables,
        digest=digest,
    )
