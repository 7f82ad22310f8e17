"""Naive UTC timestamps made explicit for files other tools read.

Every ``TIMESTAMP`` column of the store holds naive UTC (:func:`agent.store.utc_now`). Written to
Parquet as they are, they carry ``isAdjustedToUTC = false`` ("local time, zone unknown"), so
Spark, pandas or DuckDB in another session may read them in their own time zone. Marking the
Arrow type ``timestamp(unit, tz="UTC")`` changes no stored value (Arrow timestamps count from the
UTC epoch either way) and makes ``pyarrow.parquet`` write ``isAdjustedToUTC = true`` (Parquet
format, LogicalTypes.md: "Instant semantics").
"""

from __future__ import annotations

import pyarrow as pa

UTC = "UTC"


def utc_adjusted(table: pa.Table) -> pa.Table:
    """``table`` with every top-level timestamp column that has no time zone marked as UTC
    (same values, same unit); other columns, and columns already zoned, are unchanged."""
    fields = [
        pa.field(f.name, pa.timestamp(f.type.unit, tz=UTC), f.nullable, f.metadata)
        if pa.types.is_timestamp(f.type) and f.type.tz is None
        else f
        for f in table.schema
    ]
    schema = pa.schema(fields, metadata=table.schema.metadata)
    return table if schema.equals(table.schema) else table.cast(schema)
