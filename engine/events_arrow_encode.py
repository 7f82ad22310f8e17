"""Encoding Arrow bodies (:mod:`engine.events_arrow` defines the format): engine event structs to
one wire table per kind, built column by column, and those tables to the body of
``POST /v1/events``. What the telemetry client runs on its sender thread."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from engine.events import SCHEMA_VERSION, Event, EventBatch, encode_batch
from engine.events_arrow import KIND_OF_CLASS, WIRE_COLUMNS, WIRE_SCHEMAS, WireColumn, WireFormat


@functools.cache
def _enum_dictionary(values: tuple[str, ...]) -> tuple[pa.Array, dict[str, int]]:
    return pa.array(values, pa.utf8()), {v: i for i, v in enumerate(values)}


def enum_array(values: Sequence[str | None], enum_values: tuple[str, ...]) -> pa.DictionaryArray:
    """``values`` as an :data:`ENUM_TYPE` array over the enum's own values in their order (the
    canonical dictionary: every batch's column then has the same one, so a flush's tables
    concatenate and group without unifying dictionaries). ``None`` is a null.

    Raises:
        KeyError: a value not in ``enum_values``.
    """
    dictionary, index = _enum_dictionary(enum_values)
    codes = pa.array([None if v is None else index[v] for v in values], pa.int8())
    return pa.DictionaryArray.from_arrays(codes, dictionary)


def _header_metadata(kind: str, engine_id: str, seq: int, sent_at: float, run_id: str | None) -> dict[bytes, bytes]:
    meta = {
        b"kind": kind.encode(),
        b"schema_version": str(SCHEMA_VERSION).encode(),
        b"engine_id": engine_id.encode(),
        b"seq": str(seq).encode(),
        b"sent_at": repr(float(sent_at)).encode(),
    }
    if run_id is not None:
        meta[b"run_id"] = run_id.encode()
    return meta


def encode_tables(
    tables: dict[str, pa.Table], *, engine_id: str, seq: int, sent_at: float, run_id: str | None = None
) -> bytes:
    """The Arrow body of one batch whose events are ``tables`` (kind → rows with that kind's
    wire columns, :data:`WIRE_SCHEMAS`). An empty ``tables`` gives one stream of zero
    ``request`` rows.

    Raises:
        KeyError: an unknown kind.
    """
    if not tables:
        tables = {"request": WIRE_SCHEMAS["request"].empty_table()}
    sink = pa.BufferOutputStream()
    for kind, table in tables.items():
        schema = table.schema.with_metadata(_header_metadata(kind, engine_id, seq, sent_at, run_id))
        with ipc.new_stream(sink, schema) as writer:
            writer.write_table(table.replace_schema_metadata(schema.metadata))
    return sink.getvalue().to_pybytes()


_NUMPY_TYPES = {pa.int64(): np.int64, pa.int32(): np.int32, pa.float64(): np.float64, pa.bool_(): np.bool_}


def _array(column: WireColumn, values: tuple[object, ...]) -> pa.Array:
    """One column from its values: numbers through ``numpy.fromiter`` (cheaper than
    ``pyarrow.array`` on Python objects), a string the same on every row as one repeated value."""
    numpy_type, text = _BUILDERS[column]
    if numpy_type is not None:
        return pa.array(np.fromiter(values, numpy_type, len(values)))
    if text and values and values.count(values[0]) == len(values) and isinstance(values[0], str):
        return pa.repeat(pa.scalar(values[0], pa.utf8()), len(values))
    return pa.array(values, column.type)


_BUILDERS: dict[WireColumn, tuple[Any, bool]] = {
    c: (None if c.nullable else _NUMPY_TYPES.get(c.type), c.type == pa.utf8())
    for columns in WIRE_COLUMNS.values()
    for c in columns
}


def event_tables(events: Sequence[Event]) -> dict[str, pa.Table]:
    """The events as one wire table per kind (rows in order), built column by column: each
    event struct becomes a tuple (``msgspec.structs.astuple``), the tuples are transposed, and
    each column is one array call (no per-event dict).

    Raises:
        TypeError, ValueError, OverflowError, pyarrow.ArrowException: a value that does not fit
            its column (an event built with a wrong type).
    """
    rows = list(map(msgspec.structs.astuple, events))
    classes = list(map(type, events))
    grouped: dict[str, list[tuple[object, ...]]] = {}
    for cls in dict.fromkeys(classes):  # the kinds present, in order of first appearance
        kind = KIND_OF_CLASS[cls]
        grouped[kind] = rows if len(grouped) == 0 and classes.count(cls) == len(classes) else [r for r, c in zip(rows, classes, strict=True) if c is cls]
    tables: dict[str, pa.Table] = {}
    for kind, rows in grouped.items():
        columns = WIRE_COLUMNS[kind]
        arrays = [_array(c, values) for c, values in zip(columns, zip(*rows, strict=True), strict=True)]
        tables[kind] = pa.Table.from_arrays(arrays, schema=WIRE_SCHEMAS[kind])
    return tables


def encode_events(
    events: Sequence[Event], *, engine_id: str, seq: int, sent_at: float, run_id: str | None = None
) -> bytes:
    """The Arrow body of one batch of ``events`` (:func:`event_tables`, :func:`encode_tables`)."""
    return encode_tables(event_tables(events), engine_id=engine_id, seq=seq, sent_at=sent_at, run_id=run_id)


def encode_body(
    fmt: WireFormat, events: Sequence[Event], *, engine_id: str, seq: int, sent_at: float, run_id: str | None = None
) -> bytes:
    """One batch of ``events`` in ``fmt``: what the telemetry client sends (Arrow by default)."""
    if fmt == "arrow":
        return encode_events(events, engine_id=engine_id, seq=seq, sent_at=sent_at, run_id=run_id)
    batch = EventBatch(schema_version=SCHEMA_VERSION, engine_id=engine_id, seq=seq, sent_at=sent_at, events=list(events), run_id=run_id)
    return encode_batch(batch, fmt)
