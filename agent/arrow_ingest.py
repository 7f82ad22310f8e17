"""Arrow bodies into prepared batches: an ``application/vnd.apache.arrow.stream`` body
(:mod:`engine.events_arrow`), checked column by column (:mod:`engine.events_arrow_check`), becomes
the same :class:`~agent.ingest.PreparedBatch` a JSON or msgpack body does — tables typed like the
store's (``ts`` as a timestamp, the batch's ``run_id`` on every row) — without a Python object per
event."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from agent.event_tables import BATCH_COLUMNS, TABLE_OF_KIND, TABLE_SPECS
from agent.ingest import PreparedBatch
from engine.events_arrow import ArrowBatch, decode_body
from engine.events_arrow_check import check_arrow_batch
from engine.events_arrow_rules import Columns

assert [name for name, _ in BATCH_COLUMNS] == ["run_id"], "a new envelope column needs its value in _store_table"

_STORE_SCHEMAS: dict[str, pa.Schema] = {
    spec.kind: pa.schema([pa.field(name, dtype) for name, dtype in spec.columns if name != "ingested_at"])
    for spec in TABLE_SPECS.values()
}
"""Event kind → the schema :func:`agent.event_tables.build_tables` gives its table (so tables of
both paths concatenate in one flush)."""


def _store_table(kind: str, columns: Columns, run_id: str | None) -> pa.Table:
    schema = _STORE_SCHEMAS[kind]
    rows = columns.rows
    arrays: list[pa.Array] = []
    for field in schema:
        if field.name == "ts":  # unix seconds → microseconds, as build_tables rounds them
            micros = np.rint(columns.numbers["ts"] * 1e6).astype(np.int64)
            arrays.append(pa.array(micros, pa.int64()).cast(field.type))
        elif field.name == "run_id":
            arrays.append(pa.nulls(rows, field.type) if run_id is None else pa.repeat(pa.scalar(run_id, field.type), rows))
        else:
            arrays.append(columns.arrays[field.name])
    return pa.Table.from_arrays(arrays, schema=schema)


def prepare_arrow(batch: ArrowBatch) -> PreparedBatch:
    """Check ``batch`` and turn it into the tables a flush inserts.

    Raises:
        engine.events.EventError: a rule of the contract is broken (nothing of it is stored).
    """
    checked = check_arrow_batch(batch)
    return PreparedBatch(
        engine_id=batch.engine_id,
        seq=batch.seq,
        events=batch.events,
        events_by_kind={kind: c.rows for kind, c in checked.items() if c.rows},
        tables={TABLE_OF_KIND[kind]: _store_table(kind, c, batch.run_id) for kind, c in checked.items() if c.rows},
        digest=batch.digest,
        run_id=batch.run_id,
    )


def decode_arrow(body: bytes) -> PreparedBatch:
    """:func:`engine.events_arrow.decode_body`, then :func:`prepare_arrow`.

    Raises:
        engine.events.EventError: a malformed body or a broken rule.
    """
    return prepare_arrow(decode_body(body))


__all__ = ["decode_arrow", "prepare_arrow"]
