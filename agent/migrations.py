"""The agent's schema, as ordered, versioned migrations.

A migration is never edited once released: a schema change is a new migration with the next
version. :class:`agent.store.Store` applies the ones a database lacks, each in its own
transaction together with its ``schema_migrations`` row.

Column conventions: ``ts`` is the event's time (unix seconds) as a naive UTC ``TIMESTAMP`` with
microsecond precision; ``ingested_at`` is when the agent stored the row (naive UTC); enum-valued
columns (form, tier, outcome, reason, admission, action) hold the ``engine.events`` enum values as
``VARCHAR`` (a tuple of them, such as ``requests.limiting_forms``, as ``VARCHAR[]``), so a new enum
member (``tier_incomplete``) needs no migration.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Migration:
    """One schema step: ``statements`` run in order inside one transaction."""

    version: int
    name: str
    statements: tuple[str, ...]


_V1_TABLES = (
    """
    CREATE TABLE cache_lookups (
        ts TIMESTAMP NOT NULL,
        engine_id VARCHAR NOT NULL,
        request_id VARCHAR NOT NULL,
        model VARCHAR NOT NULL,
        form VARCHAR NOT NULL,
        tier VARCHAR NOT NULL,
        outcome VARCHAR NOT NULL,
        reason VARCHAR NOT NULL,
        hash_hit_tokens BIGINT NOT NULL,
        usable_tokens BIGINT NOT NULL,
        recoverable_tokens BIGINT NOT NULL,
        replayed_tokens BIGINT NOT NULL,
        approximate BOOLEAN NOT NULL,
        recovery_seconds DOUBLE NOT NULL,
        bytes_moved BIGINT NOT NULL,
        layer_group INTEGER NOT NULL,
        tp_rank INTEGER NOT NULL,
        epoch BIGINT NOT NULL,
        ingested_at TIMESTAMP NOT NULL
    )
    """,
    """
    CREATE TABLE requests (
        ts TIMESTAMP NOT NULL,
        engine_id VARCHAR NOT NULL,
        request_id VARCHAR NOT NULL,
        model VARCHAR NOT NULL,
        prompt_tokens BIGINT NOT NULL,
        output_tokens BIGINT NOT NULL,
        hash_hit_tokens BIGINT NOT NULL,
        resume_tokens BIGINT NOT NULL,
        recoverable_tokens BIGINT NOT NULL,
        replayed_tokens BIGINT NOT NULL,
        recomputed_tokens BIGINT NOT NULL,
        approximate BOOLEAN NOT NULL,
        limiting_form VARCHAR,
        limiting_reason VARCHAR NOT NULL,
        admission VARCHAR NOT NULL,
        ttft_seconds DOUBLE NOT NULL,
        e2e_seconds DOUBLE NOT NULL,
        ingested_at TIMESTAMP NOT NULL
    )
    """,
    """
    CREATE TABLE engine_stats (
        ts TIMESTAMP NOT NULL,
        engine_id VARCHAR NOT NULL,
        model VARCHAR NOT NULL,
        form VARCHAR NOT NULL,
        tier VARCHAR NOT NULL,
        used_bytes BIGINT NOT NULL,
        used_blocks BIGINT NOT NULL,
        cached_blocks BIGINT NOT NULL,
        free_blocks BIGINT NOT NULL,
        total_blocks BIGINT NOT NULL,
        running_requests BIGINT NOT NULL,
        waiting_requests BIGINT NOT NULL,
        recoveries_in_flight BIGINT NOT NULL,
        ingested_at TIMESTAMP NOT NULL
    )
    """,
    """
    CREATE TABLE block_events (
        ts TIMESTAMP NOT NULL,
        engine_id VARCHAR NOT NULL,
        model VARCHAR NOT NULL,
        form VARCHAR NOT NULL,
        tier VARCHAR NOT NULL,
        action VARCHAR NOT NULL,
        block_hash VARCHAR NOT NULL,
        block_id BIGINT NOT NULL,
        num_tokens BIGINT NOT NULL,
        ingested_at TIMESTAMP NOT NULL
    )
    """,
    """
    CREATE TABLE gpu_stats (
        ts TIMESTAMP NOT NULL,
        gpu_index INTEGER NOT NULL,
        name VARCHAR NOT NULL,
        memory_used_bytes BIGINT NOT NULL,
        memory_total_bytes BIGINT NOT NULL,
        utilization_ratio DOUBLE
    )
    """,
    """
    CREATE TABLE alerts (
        ts TIMESTAMP NOT NULL,
        alert VARCHAR NOT NULL,
        fingerprint VARCHAR NOT NULL,
        state VARCHAR NOT NULL,
        value DOUBLE,
        labels VARCHAR NOT NULL,
        summary VARCHAR NOT NULL,
        description VARCHAR NOT NULL
    )
    """,
    """
    CREATE TABLE ingest_batches (
        engine_id VARCHAR NOT NULL,
        seq BIGINT NOT NULL,
        received_at TIMESTAMP NOT NULL,
        rows BIGINT NOT NULL,
        status VARCHAR NOT NULL CHECK (status IN ('stored', 'duplicate', 'rejected')),
        error VARCHAR
    )
    """,
    "CREATE INDEX ingest_batches_engine_seq ON ingest_batches (engine_id, seq)",
)

RECOVERY_BUCKETS_V3 = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of ``cache_minute``'s recovery-latency buckets, as migration 3 created
them. Never edit: a change of buckets is a new migration (and :data:`agent.rollup.RECOVERY_BUCKETS`)."""


def bucket_column(bound: float) -> str:
    """The ``cache_minute`` column counting lookups with ``recovery_seconds <= bound``."""
    return "recovery_le_" + repr(float(bound)).replace(".", "_")


_V3_STATEMENTS = (
    f"""
    CREATE TABLE cache_minute (
        minute TIMESTAMP NOT NULL,
        engine_id VARCHAR NOT NULL,
        model VARCHAR NOT NULL,
        form VARCHAR NOT NULL,
        tier VARCHAR NOT NULL,
        outcome VARCHAR NOT NULL,
        reason VARCHAR NOT NULL,
        lookups BIGINT NOT NULL,
        approximate_lookups BIGINT NOT NULL,
        -- sums are HUGEINT: a minute's sum of 64-bit values can exceed BIGINT
        hash_hit_tokens HUGEINT NOT NULL,
        usable_tokens HUGEINT NOT NULL,
        recoverable_tokens HUGEINT NOT NULL,
        replayed_tokens HUGEINT NOT NULL,
        bytes_moved HUGEINT NOT NULL,
        recovery_seconds_sum DOUBLE NOT NULL,
        {", ".join(f"{bucket_column(b)} BIGINT NOT NULL" for b in RECOVERY_BUCKETS_V3)},
        PRIMARY KEY (minute, engine_id, model, form, tier, outcome, reason)
    )
    """,
    "ALTER TABLE ingest_batches ADD COLUMN digest BIGINT",
    """
    CREATE TABLE ingest_gaps (
        engine_id VARCHAR NOT NULL,
        first_missing BIGINT NOT NULL,
        last_missing BIGINT NOT NULL,
        detected_at TIMESTAMP NOT NULL
    )
    """,
    """
    CREATE TABLE rollup_watermarks (
        name VARCHAR PRIMARY KEY,
        ingested_at TIMESTAMP NOT NULL
    )
    """,
    """
    CREATE TABLE parquet_exports (
        table_name VARCHAR NOT NULL,
        hour TIMESTAMP NOT NULL,
        rows BIGINT NOT NULL,
        parts INTEGER NOT NULL,
        exported_through TIMESTAMP NOT NULL,
        exported_at TIMESTAMP NOT NULL,
        PRIMARY KEY (table_name, hour)
    )
    """,
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(version=1, name="create event, alert and ingest tables", statements=_V1_TABLES),
    Migration(
        version=2,
        name="requests: the admission's predicted and actual seconds",
        statements=(
            "ALTER TABLE requests ADD COLUMN predicted_seconds DOUBLE DEFAULT 0",
            "ALTER TABLE requests ADD COLUMN actual_seconds DOUBLE DEFAULT 0",
        ),
    ),
    Migration(
        version=3,
        name="cache_minute rollups and their watermark, batch digests, seq gaps, Parquet export log",
        statements=_V3_STATEMENTS,
    ),
    Migration(
        version=4,
        name="alert_state: the rule-file evaluator's state (pending time survives a restart)",
        statements=(
            """
            CREATE TABLE alert_state (
                fingerprint VARCHAR PRIMARY KEY,
                alert VARCHAR NOT NULL,
                labels VARCHAR NOT NULL,
                series VARCHAR NOT NULL,
                status VARCHAR NOT NULL,
                active_since DOUBLE,
                firing_since DOUBLE,
                inactive_since DOUBLE,
                resolved_at DOUBLE,
                evaluated_at DOUBLE,
                value DOUBLE,
                updated_at TIMESTAMP NOT NULL
            )
            """,
        ),
    ),
    Migration(
        version=5,
        name="alert notifications: delivery rows in alerts, the notification log, silences",
        statements=(
            "ALTER TABLE alerts ADD COLUMN event VARCHAR DEFAULT 'transition'",
            "ALTER TABLE alerts ADD COLUMN receiver VARCHAR",
            "ALTER TABLE alerts ADD COLUMN error VARCHAR",
            """
            CREATE TABLE alert_groups (
                group_key VARCHAR PRIMARY KEY,
                receiver VARCHAR NOT NULL,
                group_labels VARCHAR NOT NULL,
                created_at DOUBLE NOT NULL,
                last_sent_at DOUBLE,
                last_firing VARCHAR NOT NULL,
                delivered VARCHAR NOT NULL,
                updated_at TIMESTAMP NOT NULL
            )
            """,
            """
            CREATE TABLE alert_silences (
                id VARCHAR PRIMARY KEY,
                matchers VARCHAR NOT NULL,
                starts_at DOUBLE NOT NULL,
                ends_at DOUBLE NOT NULL,
                created_by VARCHAR NOT NULL,
                comment VARCHAR NOT NULL,
                created_at TIMESTAMP NOT NULL,
                updated_at TIMESTAMP NOT NULL
            )
            """,
        ),
    ),
    Migration(
        version=6,
        name="form_usable_minute: per minute and form, the usable and prompt tokens of the requests",
        statements=(
            # folded by agent.rollups.fold_form_usable_minute (watermark 'form_usable_minute'); the
            # first fold after this migration takes every stored request
            """
            CREATE TABLE form_usable_minute (
                minute TIMESTAMP NOT NULL,
                engine_id VARCHAR NOT NULL,
                model VARCHAR NOT NULL,
                form VARCHAR NOT NULL,
                requests BIGINT NOT NULL,
                usable_tokens HUGEINT NOT NULL,
                prompt_tokens HUGEINT NOT NULL,
                PRIMARY KEY (minute, engine_id, model, form)
            )
            """,
        ),
    ),
    Migration(
        version=7,
        name="cache_lookups: the ghost resume point and the memory it needed (the Capacity what-if)",
        statements=(
            "ALTER TABLE cache_lookups ADD COLUMN ghost_tokens BIGINT DEFAULT 0",
            "ALTER TABLE cache_lookups ADD COLUMN ghost_bytes BIGINT",
        ),
    ),
    Migration(
        version=8,
        name="cache_lookups: the spare memory of a resuming lookup (the Capacity what-if, less memory)",
        statements=("ALTER TABLE cache_lookups ADD COLUMN spare_bytes BIGINT",),
    ),
    Migration(
        version=9,
        name="requests: every form tied as limiting the resume point (limiting_form is one of them)",
        # rows stored before read [] (no ties recorded), like a request no form limited
        statements=("ALTER TABLE requests ADD COLUMN limiting_forms VARCHAR[] DEFAULT []",),
    ),
    Migration(
        version=10,
        name="cache_lookups: the indexer's sync delay behind the compressed KV boundary (tokens, seconds)",
        # rows stored before read 0: in sync (the engines that sent them did not measure it)
        statements=(
            "ALTER TABLE cache_lookups ADD COLUMN indexer_sync_delay_tokens BIGINT DEFAULT 0",
            "ALTER TABLE cache_lookups ADD COLUMN indexer_sync_delay_seconds DOUBLE DEFAULT 0",
        ),
    ),
    Migration(
        version=11,
        name="run_id: the engine process that sent each batch and row (engine ids now stay across restarts)",
        # from EventBatch.run_id; NULL for rows stored before and for batches of older engines
        statements=tuple(
            f"ALTER TABLE {table} ADD COLUMN run_id VARCHAR"
            for table in ("ingest_batches", "cache_lookups", "requests", "engine_stats", "block_events")
        ),
    ),
)
"""Every migration, in version order (versions 1, 2, ... without gaps)."""

SCHEMA_VERSION = MIGRATIONS[-1].version
"""The schema version this code expects."""
