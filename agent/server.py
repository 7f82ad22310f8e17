"""Run the agent: what ``kvscope agent`` calls.

:func:`serve` opens the store, builds the app (its decode workers started), starts the rule
scheduler (:mod:`alerts.rule_scheduler`, the agent's only alert scheduler) and the maintenance
scheduler (:mod:`agent.maintenance`) and runs uvicorn until SIGINT or SIGTERM; then
uvicorn drains in-flight requests and the app's ingest queue is flushed, the schedulers stop
(the rollup runs once more), and the store is checkpointed and closed — in that order, so no
write is lost. It returns normally after a
signal (the caller exits 0).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI

from agent.app import create_app
from agent.config import AgentConfig
from agent.health import Health
from agent.maintenance import MaintenanceScheduler
from agent.metrics import AgentMetrics
from agent.startup import open_guarded_store
from agent.store import Store
from agent.vllm_subscriber import VllmKvEventSubscriber, pipeline_ingest, store_last_stored
from alerts.notifier import Notifier
from alerts.notify_config import DEFAULT_NOTIFY_PATH, load_notify_config
from alerts.rule_scheduler import RuleScheduler
from alerts.rulefile import DEFAULT_RULES_PATH, load_rule_file

log = logging.getLogger(__name__)


def serve(config: AgentConfig, *, log_level: str = "info", parent_pid: int | None = None) -> None:
    """Serve the agent on ``config.host:config.port`` until SIGINT/SIGTERM (blocking), or, with
    ``parent_pid``, until this process's parent is no longer that process (it exited; the agent
    shuts down as on SIGTERM).

    Raises:
        agent.wal_guard.DatabaseUnusableError: the database cannot be opened for a reason other
            than a damaged WAL (a damaged file, a full disk: the message says which).
        duckdb.Error: the store cannot be opened or migrated (another agent holding the file:
            ``duckdb.IOException`` naming its process).
        OSError: the port cannot be bound.
        alerts.rulefile.RuleFileError: ``config.alert_rules_file`` cannot be used.
        alerts.notify_config.NotifyConfigError: ``config.alert_notify_file`` cannot be used.
    """
    rules = load_rule_file(config.alert_rules_file or DEFAULT_RULES_PATH)
    if config.dashboard_url is not None:
        rules = rules.with_dashboard_url(config.dashboard_url)
    notify = load_notify_config(config.alert_notify_file or DEFAULT_NOTIFY_PATH, data_dir=config.data_dir)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    metrics = AgentMetrics(
        label_max_values=config.metric_label_max_values, label_idle_seconds=config.metric_label_idle_seconds
    )
    health = Health()
    guarded = open_guarded_store(
        config.db_path,
        health=health,
        registry=metrics.registry,
        wal_autocheckpoint_bytes=config.checkpoint_wal_bytes,
        memory_limit_bytes=config.duckdb_memory_limit_bytes,
        threads=config.duckdb_threads,
    )
    store, durability = guarded.store, guarded.durability
    try:
        app = create_app(config, store, metrics=metrics, health=health, durability=durability)
        guarded.start()
        app.state.decoder.warm_up()
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                log_level=log_level,
                lifespan="on",
            )
        )
        maintenance = MaintenanceScheduler(store, config, metrics, checkpoint=durability.checkpoint)
        notifier = Notifier(store=store, config=notify, registry=metrics.registry, external_url=config.agent_url)
        rule_scheduler = RuleScheduler(
            store=store,
            rules=rules,
            log_path=config.alert_log_path,
            registry=metrics.registry,
            notifier=notifier,
            lag_seconds=config.alert_ingest_lag_seconds,
            interval_seconds=config.alert_interval_seconds,
            row_limit=config.sql_row_limit,
            timeout_seconds=config.sql_timeout_seconds,
        )
        app.state.active_alerts = rule_scheduler.active_alerts
        app.state.missed_evaluations = rule_scheduler.missed.counts
        app.state.rule_health = lambda: rule_scheduler.health.snapshot(list(rule_scheduler.rules.rules))
        maintenance.start(parent_pid=parent_pid, on_parent_exit=lambda: setattr(server, "should_exit", True))
        vllm = vllm_subscriber(config, app, store, metrics)
        try:
            rule_scheduler.start()
            if vllm is not None:
                vllm.start()
            with _signals_end_quietly():
                server.run()
        finally:
            if vllm is not None:
                vllm.close()
            rule_scheduler.shutdown()
            notifier.close()
            maintenance.shutdown()
            # normally done by the app's shutdown; not when the server never ran
            app.state.ingestor.close()
            app.state.decoder.shutdown()
    finally:
        try:
            durability.checkpoint()
        except Exception:  # the close below checkpoints again and raises what is wrong
            log.exception("the last checkpoint failed")
        durability.ack_log.close()
        if store.close():
            log.info("agent stopped; store %s checkpointed and closed", config.db_path)
        else:  # a query DuckDB cannot stop yet: store.close logged it; the WAL holds every write
            log.warning("agent stopped; store %s checkpointed, its connection left to the process's exit", config.db_path)


def vllm_subscriber(config: AgentConfig, app: FastAPI, store: Store, metrics: AgentMetrics) -> VllmKvEventSubscriber | None:
    """The subscriber to ``config.vllm_kv_events`` (None when it is not set), ingesting through
    the app's pipeline."""
    if config.vllm_kv_events is None:
        return None
    return VllmKvEventSubscriber(
        config.vllm_kv_events,
        ingest=pipeline_ingest(lambda: app.state.ingestor, metrics),
        last_stored=store_last_stored(store),
        replay_endpoint=config.vllm_kv_events_replay,
        engine_id=config.vllm_engine_id,
        model=config.vllm_model,
    )


@contextmanager
def _signals_end_quietly() -> Iterator[None]:
    """uvicorn handles SIGINT/SIGTERM itself, then re-raises the signal once it has shut down,
    which would kill the process (SIGTERM) or raise KeyboardInterrupt (SIGINT) before our
    cleanup. Handlers installed here receive that re-raised signal and do nothing, so
    :func:`serve` can finish its cleanup and return. Only possible on the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(sig: int, frame: FrameType | None) -> None:
        log.info("received %s, shutting down", signal.Signals(sig).name)

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
