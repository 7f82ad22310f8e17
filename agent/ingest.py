"""Event batches into the store.

Contract:

* :func:`build_tables` turns a decoded :class:`~engine.events.EventBatch` into one Arrow table per
  event kind, typed like the store's tables (the schema's bounds guarantee every value fits its
  column: ``ts`` up to year 9999, integers within BIGINT / INTEGER).
* :func:`ingest_batch` stores the tables and the batch's ``ingest_batches`` row in **one**
  transaction (bulk ``INSERT ... SELECT`` from the registered Arrow tables, never row by row).
  It is idempotent on (engine_id, seq): a batch already stored is acknowledged as ``duplicate``
  and stores no event (only its ``duplicate`` row in ``ingest_batches``).
* :func:`record_rejected` is the best-effort audit row of a batch that failed to decode.

``ingest_batches.rows`` counts the event rows that batch stored: the event count for ``stored``,
0 for ``duplicate`` and ``rejected``.
"""

from __future__ import annotations

import enum
import types
import typing
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

import msgspec
import pyarrow as pa

from agent.store import Store
from engine.events import (
    BlockEvent,
    CacheLookup,
    ContentFormat,
    EngineStats,
    Event,
    EventBatch,
    EventError,
    RequestEvent,
)

_TS = pa.timestamp("us")


@dataclass(frozen=True, slots=True)
class _TableSpec:
    """Where one event kind is stored: the table and its columns (event field names, except
    ``ingested_at`` which the agent sets), with their Arrow types."""

    kind: str
    table: str
    columns: tuple[tuple[str, pa.DataType], ...]

    @property
    def column_list(self) -> str:
        return ", ".join(name for name, _ in self.columns)


TABLE_OF_KIND = {
    "cache_lookup": "cache_lookups",
    "request": "requests",
    "engine_stats": "engine_stats",
    "block": "block_events",
}
"""Event kind (the ``kind`` tag) → the table its events go to."""


def _arrow_type(name: str, hint: object) -> pa.DataType:
    """The column type of one event field, read off its annotation in ``engine.events``."""
    if name == "ts":
        return _TS
    base: object = hint
    metas: tuple[object, ...] = ()
    if typing.get_origin(hint) is typing.Annotated:
        base, *rest = typing.get_args(hint)
        metas = tuple(rest)
    if base is bool:
        return pa.bool_()
    if base is int:
        small = any(getattr(m, "le", None) == 2**31 - 1 for m in metas)
        return pa.int32() if small else pa.int64()
    if base is float:
        return pa.float64()
    options = typing.get_args(base) if isinstance(base, types.UnionType) else (base,)
    if all(o is str or o is type(None) or (isinstance(o, type) and issubclass(o, enum.StrEnum)) for o in options):
        return pa.string()
    raise TypeError(f"event field {name}: no column type for {hint!r}")


def _spec(cls: type[msgspec.Struct]) -> _TableSpec:
    kind = cls.__struct_config__.tag
    assert isinstance(kind, str)
    hints = typing.get_type_hints(cls, include_extras=True)
    columns = tuple((f.name, _arrow_type(f.name, hints[f.name])) for f in msgspec.structs.fields(cls))
    return _TableSpec(kind, TABLE_OF_KIND[kind], (*columns, ("ingested_at", _TS)))


TABLE_SPECS: dict[type[Event], _TableSpec] = {cls: _spec(cls) for cls in (CacheLookup, RequestEvent, EngineStats, BlockEvent)}
"""Event class → its table. Keys of :func:`build_tables`'s result are the ``table`` names."""


@dataclass(frozen=True, slots=True, kw_only=True)
class IngestOutcome:
    """What :func:`ingest_batch` did. ``tables`` holds the stored tables (empty for a
    duplicate), keyed by table name, for the caller's metrics."""

    status: Literal["stored", "duplicate"]
    engine_id: str
    seq: int
    events: int
    events_by_kind: dict[str, int] = field(default_factory=dict)
    tables: dict[str, pa.Table] = field(default_factory=dict)


def build_tables(batch: EventBatch, *, ingested_at: datetime) -> dict[str, pa.Table]:
    """One Arrow table per event kind present in ``batch`` (table name → table), rows in batch
    order. ``ingested_at`` is a naive UTC datetime."""
    grouped: dict[type[Event], list[tuple[int, Event]]] = defaultdict(list)
    for index, event in enumerate(batch.events):
        grouped[type(event)].append((index, event))
    tables: dict[str, pa.Table] = {}
    for cls, items in grouped.items():
        spec = TABLE_SPECS[cls]
        arrays = [_column(items, name, dtype, ingested_at) for name, dtype in spec.columns]
        tables[spec.table] = pa.Table.from_arrays(
            arrays, schema=pa.schema([pa.field(name, dtype) for name, dtype in spec.columns])
        )
    return tables


def _column(
    items: list[tuple[int, Event]], name: str, dtype: pa.DataType, ingested_at: datetime
) -> pa.Array:
    if name == "ingested_at":
        return pa.array([ingested_at] * len(items), dtype)
    if name == "ts":
        return pa.array([round(event.ts * 1_000_000) for _, event in items], pa.int64()).cast(dtype)
    return pa.array([getattr(event, name) for _, event in items], dtype)


def ingest_batch(store: Store, batch: EventBatch, *, received_at: datetime) -> IngestOutcome:
    """Store ``batch`` in one transaction, idempotently on (engine_id, seq).

    ``received_at`` (naive UTC) becomes every row's ``ingested_at`` and the batch's
    ``received_at``. Nothing is stored when this raises.

    Raises:
        duckdb.Error: the store failed; the transaction was rolled back.
    """
    tables = build_tables(batch, ingested_at=received_at)
    by_kind = {TABLE_SPECS[cls].kind: n for cls, n in Counter(map(type, batch.events)).items()}
    key = {"engine_id": batch.engine_id, "seq": batch.seq, "received_at": received_at}
    with store.transaction() as cur:
        ((already_stored,),) = cur.execute(
            "SELECT count(*) FROM ingest_batches "
            "WHERE engine_id = $engine_id AND seq = $seq AND status = 'stored'",
            {"engine_id": batch.engine_id, "seq": batch.seq},
        ).fetchall()
        if already_stored > 0:
            cur.execute(
                "INSERT INTO ingest_batches VALUES "
                "($engine_id, $seq, $received_at, 0, 'duplicate', NULL)",
                key,
            )
            return IngestOutcome(
                status="duplicate",
                engine_id=batch.engine_id,
                seq=batch.seq,
                events=len(batch.events),
                events_by_kind=by_kind,
            )
        for spec in TABLE_SPECS.values():
            table = tables.get(spec.table)
            if table is None:
                continue
            view = f"_ingest_{spec.table}"
            cur.register(view, table)
            try:
                # Identifiers come from TABLE_SPECS (code), never from the request.
                cur.execute(
                    f"INSERT INTO {spec.table} ({spec.column_list}) "
                    f"SELECT {spec.column_list} FROM {view}"
                )
            finally:
                cur.unregister(view)
        cur.execute(
            "INSERT INTO ingest_batches VALUES "
            "($engine_id, $seq, $received_at, $rows, 'stored', NULL)",
            {**key, "rows": len(batch.events)},
        )
    return IngestOutcome(
        status="stored",
        engine_id=batch.engine_id,
        seq=batch.seq,
        events=len(batch.events),
        events_by_kind=by_kind,
        tables=tables,
    )


class _BatchHeader(msgspec.Struct):
    """The two fields a rejected batch is filed under; every other field is ignored."""

    engine_id: str
    seq: int


MAX_ERROR_CHARS = 2000


def record_rejected(
    store: Store, body: bytes, fmt: ContentFormat, error: EventError, *, received_at: datetime
) -> bool:
    """Best effort: file a ``rejected`` row in ``ingest_batches`` when the body's ``engine_id``
    and ``seq`` are readable. Returns whether a row was written. Stores no event."""
    try:
        header = (
            msgspec.json.decode(body, type=_BatchHeader)
            if fmt == "json"
            else msgspec.msgpack.decode(body, type=_BatchHeader)
        )
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    if not 0 < len(header.engine_id) <= 256 or not 0 <= header.seq < 2**63:
        return False
    with store.transaction() as cur:
        cur.execute(
            "INSERT INTO ingest_batches VALUES "
            "($engine_id, $seq, $received_at, 0, 'rejected', $error)",
            {
                "engine_id": header.engine_id,
                "seq": header.seq,
                "received_at": received_at,
                "error": str(error)[:MAX_ERROR_CHARS],
            },
        )
    return True
