"""How events become rows: one Arrow table per event kind, typed like the store's tables (the
types read off the annotations of ``engine.events``; an enum is a dictionary-encoded string
column, :data:`engine.events_arrow.ENUM_TYPE`, as on the Arrow wire; a ``tuple[Form, ...]``
field is a ``VARCHAR[]`` list column), and the outcome sets the recovery-latency buckets count. :mod:`agent.ingest` builds and writes batches with them."""

from __future__ import annotations

import enum
import operator
import types
import typing
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

import msgspec
import numpy as np
import pyarrow as pa

from agent.migrations import RECOVERY_BUCKETS_V3
from engine.events import BlockEvent, CacheLookup, EngineStats, Event, EventBatch, RequestEvent
from engine.events_arrow import ENUM_TYPE, WIRE_COLUMNS
from engine.events_arrow_encode import enum_array

_TS = pa.timestamp("us")


@dataclass(frozen=True, slots=True)
class _TableSpec:
    """Where one event kind is stored: the table and its columns (event field names, then
    :data:`BATCH_COLUMNS` from the batch and ``ingested_at`` which the agent sets), with their
    Arrow types."""

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

BATCH_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (("run_id", pa.string()),)
"""Columns every row of a batch takes from the batch's envelope (``EventBatch.run_id``: the
engine process that sent it, NULL when the engine gave none)."""


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
    items = typing.get_args(base) if typing.get_origin(base) is tuple else ()
    if len(items) == 2 and items[1] is Ellipsis:  # ``tuple[Form, ...]``: a list column
        return pa.list_(pa.string())
    nullable = typing.get_args(base) if typing.get_origin(base) in (typing.Union, types.UnionType) else ()
    if len(nullable) == 2 and type(None) in nullable:  # ``Annotated[int, ...] | None``: the column is nullable
        inner = next(o for o in nullable if o is not type(None))
        if typing.get_origin(inner) is typing.Annotated or inner in (int, float, bool):
            return _arrow_type(name, inner)
    if base is int:
        small = any(getattr(m, "le", None) == 2**31 - 1 for m in metas)
        return pa.int32() if small else pa.int64()
    if base is float:
        return pa.float64()
    options = typing.get_args(base) if isinstance(base, types.UnionType) else (base,)
    if any(isinstance(o, type) and issubclass(o, enum.StrEnum) for o in options):
        return ENUM_TYPE  # dictionary-encoded: what the Arrow wire carries, and DuckDB inserts it faster
    if all(o is str or o is type(None) for o in options):
        return pa.string()
    raise TypeError(f"event field {name}: no column type for {hint!r}")


def _spec(cls: type[msgspec.Struct]) -> _TableSpec:
    kind = cls.__struct_config__.tag
    assert isinstance(kind, str)
    hints = typing.get_type_hints(cls, include_extras=True)
    columns = tuple((f.name, _arrow_type(f.name, hints[f.name])) for f in msgspec.structs.fields(cls))
    return _TableSpec(kind, TABLE_OF_KIND[kind], (*columns, *BATCH_COLUMNS, ("ingested_at", _TS)))


TABLE_SPECS: dict[type[Event], _TableSpec] = {cls: _spec(cls) for cls in (CacheLookup, RequestEvent, EngineStats, BlockEvent)}
"""Event class → its table. Keys of :func:`build_tables`'s result are the ``table`` names."""


RECOVERING_OUTCOMES = ("recovered", "replayed")
"""Lookup outcomes that recovered state (a swap-in, a rebuild, Tail-Replay): the ones the
recovery-latency histograms and buckets count."""
RECOVERING_SQL = "outcome IN (" + ", ".join(f"'{o}'" for o in RECOVERING_OUTCOMES) + ")"
"""The SQL condition for :data:`RECOVERING_OUTCOMES` (constants, not user input)."""

RECOVERY_BUCKETS = RECOVERY_BUCKETS_V3
"""Upper bounds (seconds) of the recovery-latency histogram: ``cache_minute``'s cumulative
``recovery_le_*`` columns and the ``kvscope_recovery_seconds`` Prometheus histogram."""


def _spec_columns(spec: _TableSpec) -> tuple[tuple[str, pa.DataType], ...]:
    """The columns read off the events (neither the batch's nor ``ingested_at``)."""
    return tuple(c for c in spec.columns if c[0] != "ingested_at" and c not in BATCH_COLUMNS)


def build_tables(batch: EventBatch, *, ingested_at: datetime | None = None) -> dict[str, pa.Table]:
    """One Arrow table per event kind present in ``batch`` (table name → table), rows in batch
    order, typed like the store's tables, with the batch's ``run_id`` on every row.
    ``ingested_at`` (naive UTC) adds that column; ``None`` leaves it out (a flush adds it)."""
    grouped: dict[type[Event], list[Event]] = defaultdict(list)
    for event in batch.events:
        grouped[type(event)].append(event)
    tables: dict[str, pa.Table] = {}
    for cls, items in grouped.items():
        spec = TABLE_SPECS[cls]
        columns = _spec_columns(spec)
        enums = {c.name: c.enum_values for c in WIRE_COLUMNS[spec.kind] if c.enum_values is not None and c.type == ENUM_TYPE}
        arrays = []
        for name, dtype in columns:
            column = list(map(operator.attrgetter(name), items))
            if name == "ts":
                micros = np.rint(np.asarray(column, dtype=np.float64) * 1e6).astype(np.int64)
                arrays.append(pa.array(micros).cast(dtype))
            elif name in enums:
                arrays.append(enum_array(column, enums[name]))
            else:
                arrays.append(pa.array(column, dtype))
        arrays.extend(pa.array([getattr(batch, name)] * len(items), dtype) for name, dtype in BATCH_COLUMNS)
        fields = [pa.field(n, t) for n, t in (*columns, *BATCH_COLUMNS)]
        table = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
        tables[spec.table] = table if ingested_at is None else with_ingested_at(table, ingested_at)
    return tables


def with_ingested_at(table: pa.Table, ingested_at: datetime) -> pa.Table:
    """``table`` plus a constant ``ingested_at`` column (naive UTC)."""
    micros = round((ingested_at - _EPOCH).total_seconds() * 1e6)
    column = pa.array(np.full(table.num_rows, micros, dtype=np.int64)).cast(_TS)
    return table.append_column(pa.field("ingested_at", _TS), column)


_EPOCH = datetime(1970, 1, 1)
