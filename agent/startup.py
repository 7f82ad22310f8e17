"""How :func:`agent.server.serve` opens its store: pre-flight, quarantine, the check of what was
acknowledged, the durable watermarks, and what is reported when something was lost.

Order (see :mod:`agent.wal_guard` and :mod:`agent.durability`):

1. :func:`agent.wal_guard.preflight` — the WAL replayed in a child; one that fails (or is not
   recognised) is quarantined.
2. :meth:`agent.store.Store.open`.
3. :func:`agent.wal_guard.missing_acknowledged` — acknowledged batches not in the database.
4. The WAL's kept copy is dropped, or quarantined when batches were missing.
5. The acknowledgement log is opened and a :class:`~agent.durability.Durability` made; the caller
   attaches the ingest pipeline's tracker and calls :meth:`GuardedStore.start`, which
   checkpoints (epoch 1: everything now in the file is durable).

Metrics (on the agent's registry): ``kvscope_store_wal_quarantined_total`` (WALs moved aside at
start), ``kvscope_store_acknowledged_batches_missing_total`` (batches found acknowledged but not
stored at start), ``kvscope_store_batches_awaiting_resend`` (of those, not stored again yet).
The watermarks and the checkpoint epoch are :class:`~agent.durability.Durability`'s.
Each finding also adds a degraded condition (:mod:`agent.health`) and an ERROR log line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.durability import AckLog, Durability, ack_log_path
from agent.health import Health
from agent.store import Store
from agent.wal_guard import (
    DatabaseUnusableError,
    describe_missing,
    finish,
    missing_acknowledged,
    preflight,
)

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class GuardedStore:
    """The opened store, its durability state and what the start found."""

    store: Store
    durability: Durability
    missing: dict[str, list[int]] = field(default_factory=dict)
    quarantined: list[Path] = field(default_factory=list)

    def start(self) -> None:
        """Checkpoint once and set the watermarks (after the tracker is attached)."""
        self.durability.start(self.missing)


def open_guarded_store(
    db_path: Path,
    *,
    health: Health,
    registry: CollectorRegistry,
    wal_autocheckpoint_bytes: int | None = None,
    memory_limit_bytes: int | None = None,
    threads: int | None = None,
) -> GuardedStore:
    """Open ``db_path`` as described in the module docstring (``wal_autocheckpoint_bytes``,
    ``memory_limit_bytes``, ``threads``: as :meth:`agent.store.Store.open`).

    Raises:
        agent.wal_guard.DatabaseUnusableError: the database cannot be opened for a reason that is
            not a damaged WAL (a damaged file, a full disk, an unwritable quarantine folder or
            acknowledgement log).
        duckdb.Error, agent.store.SchemaTooNewError: as :meth:`agent.store.Store.open` (another
            process holding the file: ``duckdb.IOException`` naming it).
    """
    quarantined_total = Counter(
        "kvscope_store_wal_quarantined_total",
        "WAL files moved aside at start because they could not be replayed (or replayed short).",
        registry=registry,
    )
    missing_total = Counter(
        "kvscope_store_acknowledged_batches_missing_total",
        "Batches acknowledged as stored but found missing from the database at start.",
        registry=registry,
    )
    report = preflight(db_path)
    store = Store.open(
        db_path, wal_autocheckpoint_bytes=wal_autocheckpoint_bytes, memory_limit_bytes=memory_limit_bytes, threads=threads
    )
    try:
        ack_file = ack_log_path(db_path)
        missing = missing_acknowledged(store, ack_file)
        evidence = finish(db_path, report, lost=bool(missing))
        try:
            ack_log = AckLog(ack_file)
        except OSError as exc:
            raise DatabaseUnusableError(f"cannot open the acknowledgement log {ack_file}: {exc}") from None
        durability = Durability(store, ack_log)
    except BaseException:
        store.close()
        raise
    guarded = GuardedStore(store=store, durability=durability, missing=missing)
    Gauge(
        "kvscope_store_batches_awaiting_resend",
        "Batches found missing at start (acknowledged, lost with the WAL) not stored again yet.",
        registry=registry,
    ).set_function(lambda: float(durability.awaiting_resend()))
    if report.quarantined is not None:
        guarded.quarantined.append(report.quarantined)
        quarantined_total.inc()
        health.degrade(
            "wal_quarantined",
            f"the WAL could not be replayed ({report.error}); moved to {report.quarantined}; the "
            "database opened at its last checkpoint",
        )
    if missing:
        if evidence is not None:
            guarded.quarantined.append(evidence)
            quarantined_total.inc()
        text = describe_missing(missing)
        total = sum(len(s) for s in missing.values())
        missing_total.inc(total)
        where = f"; the WAL as it was is kept at {evidence}" if evidence is not None else ""
        log.error("STORE DEGRADED: %s%s; engines with a spool re-send them", text, where)
        health.degrade("acknowledged_batches_missing", f"{text}{where}; engines with a spool re-send them")
    return guarded
