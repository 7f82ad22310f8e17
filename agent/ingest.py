"""Event batches into the store.

Contract:

* :func:`prepare_batch` turns a decoded :class:`~engine.events.EventBatch` into one Arrow table
  per event kind, typed like the store's tables (the schema's bounds guarantee every value fits
  its column: ``ts`` up to year 9999, integers within BIGINT / INTEGER), plus a digest of its
  events. This is the CPU-heavy part; it runs on the request's thread.
* :func:`write_batches` stores many prepared batches in **one** transaction (a flush of the
  ingest pipeline, :mod:`agent.pipeline`): bulk ``INSERT ... SELECT`` from Arrow tables, never
  row by row; their ``ingest_batches`` rows; the ``cache_minute`` rollup of their lookups; the
  ``ingest_gaps`` they reveal. Idempotent on (engine_id, seq): a batch already stored with the
  same events is acknowledged as ``duplicate`` and stores no event; the same seq with *other*
  events is a ``conflict`` (filed ``rejected``, never stored over the first).
* :func:`agent.rejected.record_rejected` is the best-effort audit row of a batch that failed to
  decode.

* The rollups folded from the stored rows are :mod:`agent.rollups`; the row types and the table
  of each event kind are :mod:`agent.event_tables`.

``ingest_batches.rows`` counts the event rows that batch stored: the event count for ``stored``,
0 for ``duplicate`` and ``rejected``. The batch's ``run_id`` is stored on its event rows and its
``ingest_batches`` row, never in the idempotency key (an engine's seqs continue across its runs:
:mod:`engine.run_seq`).
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

import duckdb
import msgspec
import pyarrow as pa

from agent.event_tables import (
    RECOVERING_OUTCOMES,
    RECOVERING_SQL,
    RECOVERY_BUCKETS,
    TABLE_OF_KIND,
    TABLE_SPECS,
    build_tables,
    with_ingested_at,
)
from agent.seq_tracker import LEGACY_SEQ_FLOOR, SeqTracker, _gap
from agent.store import Store
from engine.events import EventBatch


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedBatch:
    """A decoded, valid batch turned into Arrow tables, ready for a flush.

    ``tables`` maps table name → rows in batch order, without ``ingested_at`` (the flush sets it).
    ``digest`` is a CRC-32 of the events' canonical msgpack encoding: a re-sent batch has the
    same digest whatever its ``sent_at`` or body format, another batch under a reused seq does not.
    """

    engine_id: str
    seq: int
    events: int
    events_by_kind: dict[str, int]
    tables: dict[str, pa.Table]
    digest: int
    run_id: str | None = None


IngestStatus = Literal["stored", "duplicate", "conflict"]


@dataclass(frozen=True, slots=True, kw_only=True)
class IngestOutcome:
    """What a flush did with one batch.

    ``stored``: its events were written; ``duplicate``: the same (engine_id, seq) with the same
    events was stored before, nothing written; ``conflict``: that (engine_id, seq) was stored
    before with *other* events (an engine restarted under the same id without its seq state),
    nothing written, the batch is filed as ``rejected``. ``gap`` is the range of seqs this batch
    skipped over (first, last), when it jumped past seqs never received.
    """

    status: IngestStatus
    engine_id: str
    seq: int
    events: int
    events_by_kind: dict[str, int] = field(default_factory=dict)
    gap: tuple[int, int] | None = None
    committed_at: float = 0.0
    """When the transaction holding this batch committed (unix seconds)."""
    run_id: str | None = None
    """The batch's ``run_id`` (None: its engine gave none)."""


def prepare_batch(batch: EventBatch) -> PreparedBatch:
    """Turn a decoded batch (already checked by :func:`engine.events.decode_batch`) into the
    tables a flush inserts."""
    by_kind = {TABLE_SPECS[cls].kind: n for cls, n in Counter(map(type, batch.events)).items()}
    digest = zlib.crc32(_DIGEST_ENCODER.encode(batch.events))
    return PreparedBatch(
        engine_id=batch.engine_id,
        seq=batch.seq,
        events=len(batch.events),
        events_by_kind=by_kind,
        tables=build_tables(batch),
        digest=digest,
        run_id=batch.run_id,
    )


_DIGEST_ENCODER = msgspec.msgpack.Encoder()

__all__ = [
    "RECOVERING_OUTCOMES",
    "RECOVERING_SQL",
    "RECOVERY_BUCKETS",
    "TABLE_OF_KIND",
    "TABLE_SPECS",
    "Flush",
    "IngestOutcome",
    "PreparedBatch",
    "build_tables",
    "ingest_batch",
    "insert_ingest_rows",
    "latest_ingested_at",
    "prepare_batch",
    "registered",
    "with_ingested_at",
    "write_batches",
    "write_flush",
]


@dataclass(frozen=True, slots=True)
class Flush:
    """What :func:`write_flush` did: the outcomes (in ``items`` order), the rows it stored
    (table name → every stored item's rows, with ``ingested_at``: what the flush's metrics
    summary reads), and the seconds its inserts and its ``COMMIT`` took."""

    outcomes: list[IngestOutcome]
    tables: dict[str, pa.Table]
    insert_seconds: float
    commit_seconds: float


def write_batches(
    store: Store, tracker: SeqTracker, items: Sequence[PreparedBatch], *, ingested_at: datetime
) -> list[IngestOutcome]:
    """:func:`write_flush`'s outcomes."""
    return write_flush(store, tracker, items, ingested_at=ingested_at).outcomes


def write_flush(
    store: Store,
    tracker: SeqTracker,
    items: Sequence[PreparedBatch],
    *,
    ingested_at: datetime,
    on_tables: Callable[[dict[str, pa.Table]], object] | None = None,
) -> Flush:
    """Store ``items`` in **one** transaction, idempotently on (engine_id, seq).

    Per item, in order: a seq already stored (or earlier in ``items``) with the same digest is a
    ``duplicate``; with another digest a ``conflict`` (filed as ``rejected``); otherwise its rows
    are written. All rows of one table go in with one ``INSERT ... SELECT`` from an Arrow table;
    ``ingest_batches`` gets one row per item; a stored seq that jumps past seqs never received
    adds an ``ingest_gaps`` row. ``ingested_at`` (naive UTC) stamps every row; it must increase
    from one call to the next (the ``cache_minute`` rollup folds rows by ``ingested_at``).

    Returns a :class:`Flush`. ``tracker`` is updated only after the commit. ``on_tables`` is
    called with the rows to store (:attr:`Flush.tables`) before they are inserted, so work on
    them (the metrics summary) can run while DuckDB inserts and commits; the rows are stored
    only if this returns.

    Raises:
        duckdb.Error, StoreClosedError: the store failed; the transaction was rolled back and
            nothing of ``items`` is stored or tracked.
    """
    outcomes: list[IngestOutcome] = []
    stored_items: list[PreparedBatch] = []
    batch_rows: list[_BatchRow] = []
    gap_rows: list[tuple[str, int, int]] = []
    in_flush: dict[tuple[str, int], int] = {}
    max_seen: dict[tuple[str, bool], int | None] = {}
    started = time.perf_counter()
    with store.transaction() as cur:
        for item in items:
            key = (item.engine_id, item.seq)
            previous = in_flush.get(key)
            if previous is None and tracker.is_stored(*key):
                previous = _stored_digest(cur, *key)
            if previous is not None:
                same = previous in (item.digest, _UNKNOWN_DIGEST)
                status: IngestStatus = "duplicate" if same else "conflict"
                error = None if same else _conflict_reason(item)
                batch_rows.append((item.engine_id, item.seq, 0, "duplicate" if same else "rejected", error, item.digest, item.run_id))
                outcomes.append(_outcome(item, status))
                continue
            numbering = (item.engine_id, item.seq >= LEGACY_SEQ_FLOOR)
            top = max_seen[numbering] if numbering in max_seen else tracker.top(item.engine_id, item.seq)
            gap = _gap(top, item.seq)
            if gap is not None:
                gap_rows.append((item.engine_id, *gap))
            max_seen[numbering] = item.seq if top is None else max(top, item.seq)
            in_flush[key] = item.digest
            stored_items.append(item)
            batch_rows.append((item.engine_id, item.seq, item.events, "stored", None, item.digest, item.run_id))
            outcomes.append(_outcome(item, "stored", gap))
        tables = _concat_tables(stored_items, ingested_at)
        if on_tables is not None and tables:
            on_tables(tables)
        for spec in TABLE_SPECS.values():
            table = tables.get(spec.table)
            if table is not None:
                # Identifiers come from TABLE_SPECS (code), never from the request.
                _insert(cur, spec.table, spec.column_list, table)
        insert_ingest_rows(cur, batch_rows, gap_rows, ingested_at)
        inserted = time.perf_counter()
    committed = time.perf_counter()
    committed_at = time.time()
    outcomes = [dataclasses.replace(o, committed_at=committed_at) for o in outcomes]
    for row in batch_rows:
        if row[3] != "duplicate":
            tracker.mark(row[0], row[1], stored=row[3] == "stored")
    return Flush(outcomes, tables, inserted - started, committed - inserted)


_UNKNOWN_DIGEST = -1
"""The digest of a batch stored before digests were kept (schema < 3): any re-send matches."""


def _outcome(item: PreparedBatch, status: IngestStatus, gap: tuple[int, int] | None = None) -> IngestOutcome:
    return IngestOutcome(
        status=status,
        engine_id=item.engine_id,
        seq=item.seq,
        events=item.events,
        events_by_kind=item.events_by_kind,
        gap=gap,
        run_id=item.run_id,
    )


def _conflict_reason(item: PreparedBatch) -> str:
    return (
        f"seq {item.seq} of engine {item.engine_id!r} was already stored with other events: two "
        "engines send under this engine_id at once (give each its own), or a client that does not "
        "continue its seqs after a restart (GET /v1/ingest/next-seq) reused one"
    )


def _stored_digest(cur: duckdb.DuckDBPyConnection, engine_id: str, seq: int) -> int | None:
    rows = cur.execute(
        "SELECT coalesce(digest, -1) FROM ingest_batches "
        "WHERE engine_id = $engine_id AND seq = $seq AND status = 'stored' LIMIT 1",
        {"engine_id": engine_id, "seq": seq},
    ).fetchall()
    return int(rows[0][0]) if rows else None


def _concat_tables(items: Sequence[PreparedBatch], ingested_at: datetime) -> dict[str, pa.Table]:
    parts: dict[str, list[pa.Table]] = defaultdict(list)
    for item in items:
        for name, table in item.tables.items():
            parts[name].append(table)
    return {
        name: with_ingested_at(pa.concat_tables(tables) if len(tables) > 1 else tables[0], ingested_at)
        for name, tables in parts.items()
    }


@contextmanager
def registered(cur: duckdb.DuckDBPyConnection, name: str, table: pa.Table) -> Iterator[None]:
    """``table`` visible to SQL on ``cur`` as ``name`` for the block. When the block raises, a
    failure to unregister (the transaction is aborted) does not hide the original error."""
    cur.register(name, table)
    try:
        yield
    except BaseException:
        with suppress(duckdb.Error):
            cur.unregister(name)
        raise
    cur.unregister(name)


def _insert(cur: duckdb.DuckDBPyConnection, table_name: str, columns: str, table: pa.Table) -> None:
    """``INSERT ... SELECT`` from ``table`` registered on ``cur``, the transaction's own cursor
    (:meth:`agent.store.Store.transaction`): the registration ends when that cursor is closed,
    so it is not unregistered here (each register or unregister costs about 0.3 ms)."""
    view = f"_ingest_{table_name}"
    cur.register(view, table)
    cur.execute(f"INSERT INTO {table_name} ({columns}) SELECT {columns} FROM {view}")


_BATCH_ROW_SCHEMA = pa.schema(
    [
        ("engine_id", pa.string()),
        ("seq", pa.int64()),
        ("rows", pa.int64()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("digest", pa.int64()),
        ("run_id", pa.string()),
    ]
)
_BatchRow = tuple[str, int, int, str, str | None, int, str | None]
"""One ``ingest_batches`` row: engine_id, seq, rows, status, error, digest, run_id."""


def insert_ingest_rows(
    cur: duckdb.DuckDBPyConnection,
    batch_rows: list[_BatchRow],
    gap_rows: list[tuple[str, int, int]],
    at: datetime,
) -> None:
    if batch_rows:
        table = pa.Table.from_arrays(
            [pa.array(list(col), f.type) for col, f in zip(zip(*batch_rows, strict=True), _BATCH_ROW_SCHEMA, strict=True)],
            schema=_BATCH_ROW_SCHEMA,
        )
        cur.register("_ingest_rows", table)  # on the transaction's cursor, like _insert's
        cur.execute(
            "INSERT INTO ingest_batches (engine_id, seq, received_at, rows, status, error, digest, run_id) "
            "SELECT engine_id, seq, $at, rows, status, error, digest, run_id FROM _ingest_rows",
            {"at": at},
        )
    for engine_id, first, last in gap_rows:
        cur.execute(
            "INSERT INTO ingest_gaps VALUES ($engine_id, $first, $last, $at)",
            {"engine_id": engine_id, "first": first, "last": last, "at": at},
        )


def ingest_batch(
    store: Store, batch: EventBatch, *, received_at: datetime, tracker: SeqTracker | None = None
) -> IngestOutcome:
    """Store one batch now, in its own transaction (what a flush of one does). Without a
    ``tracker`` the store's own ``ingest_batches`` is read first. ``received_at`` is moved after
    the newest stamp in the store when it is not already (the rollup and the export rely on
    stamps that only increase). Nothing is stored when this raises.

    Raises:
        duckdb.Error: the store failed; the transaction was rolled back.
    """
    tracker = tracker if tracker is not None else SeqTracker.load(store)
    latest = latest_ingested_at(store)
    if latest is not None and received_at <= latest:  # stamps only increase (see fold_cache_minute)
        received_at = latest + timedelta(microseconds=1)
    return write_batches(store, tracker, [prepare_batch(batch)], ingested_at=received_at)[0]


def latest_ingested_at(store: Store) -> datetime | None:
    """The newest ``ingested_at`` the store knows: of any raw table, of the ``cache_minute``
    watermark and of the Parquet export watermarks (None when there is none). A restarted
    flusher stamps after it, so those watermarks stay valid even if the clock went back or
    retention emptied the tables."""
    with store.cursor() as cur:
        ((value,),) = cur.execute(
            """
            SELECT max(v) FROM (
                SELECT max(ingested_at) AS v FROM cache_lookups
                UNION ALL SELECT max(ingested_at) FROM requests
                UNION ALL SELECT max(ingested_at) FROM engine_stats
                UNION ALL SELECT max(ingested_at) FROM block_events
                UNION ALL SELECT max(ingested_at) FROM rollup_watermarks
                UNION ALL SELECT max(exported_through) FROM parquet_exports WHERE table_name <> 'gpu_stats'
            )
            """
        ).fetchall()
    return value if isinstance(value, datetime) else None
