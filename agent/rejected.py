"""The audit row of a batch that failed to decode (:func:`record_rejected`)."""

from __future__ import annotations

from datetime import datetime

import msgspec

from agent.ingest import insert_ingest_rows
from agent.seq_tracker import SeqTracker, _gap
from agent.store import Store
from engine.batch_scan import batch_header
from engine.events import EventError
from engine.events_arrow import WireFormat, header_of


class _BatchHeader(msgspec.Struct):
    """The two fields a rejected batch is filed under (:func:`engine.batch_scan.batch_header`
    reads them); every other field is ignored."""

    engine_id: str
    seq: int


MAX_ERROR_CHARS = 2000


def record_rejected(
    store: Store,
    body: bytes,
    fmt: WireFormat,
    error: EventError,
    *,
    received_at: datetime,
    tracker: SeqTracker | None = None,
) -> tuple[int, int] | bool | None:
    """Best effort: file a ``rejected`` row in ``ingest_batches`` when the body's ``engine_id``
    and ``seq`` are readable, and mark that seq received in ``tracker`` (a rejected batch is not
    a gap: its loss is counted as a rejection). If its seq jumps past seqs never received, the
    gap is recorded in ``ingest_gaps`` like a stored batch's.

    Returns False when no row was written, else the gap it revealed (first, last) or None.
    Stores no event."""
    read = header_of(body) if fmt == "arrow" else batch_header(body, fmt)  # never recursive: a value nested 1,000 deep cannot stop the audit
    if read is None:
        return False
    header = _BatchHeader(*read)
    if not 0 < len(header.engine_id) <= 256 or not 0 <= header.seq < 2**63:
        return False
    gap = _gap(tracker.top(header.engine_id, header.seq), header.seq) if tracker is not None else None
    with store.transaction() as cur:
        if gap is not None:
            insert_ingest_rows(cur, [], [(header.engine_id, *gap)], received_at)
        cur.execute(
            "INSERT INTO ingest_batches (engine_id, seq, received_at, rows, status, error) "
            "VALUES ($engine_id, $seq, $received_at, 0, 'rejected', $error)",
            {
                "engine_id": header.engine_id,
                "seq": header.seq,
                "received_at": received_at,
                "error": str(error)[:MAX_ERROR_CHARS],
            },
        )
    if tracker is not None:
        tracker.mark(header.engine_id, header.seq, stored=False)
    return gap
