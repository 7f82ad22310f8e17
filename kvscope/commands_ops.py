"""The operators' subcommands: ``agent``, ``dashboard``, ``sql`` and ``alerts``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

from agent.client import AgentError, default_agent_url
from kvscope.cli_args import UserError


def cmd_agent(args: argparse.Namespace) -> int:
    parent_pid = os.getppid() if args.exit_with_parent else None  # before the slow start-up: see serve
    import duckdb

    from agent.config import AgentConfig, ConfigError, load_config
    from agent.server import serve
    from agent.store import SchemaTooNewError, lock_holder
    from agent.wal_guard import DatabaseUnusableError

    try:
        config = load_config(args.config) if args.config else AgentConfig()
        overrides = {
            k: v
            for k, v in {
                "host": args.host,
                "port": args.port,
                "data_dir": args.data_dir,
                "token": args.token,
                "alert_interval_seconds": args.alert_interval_seconds,
                "alert_rules_file": args.alert_rules,
                "alert_notify_file": args.alert_notify,
                "dashboard_url": args.dashboard_url,
                "vllm_kv_events": args.vllm_kv_events,
                "vllm_kv_events_replay": args.vllm_kv_events_replay,
                "vllm_engine_id": args.vllm_engine_id,
                "vllm_model": args.vllm_model,
            }.items()
            if v is not None
        }
        config = dataclasses.replace(config, **overrides)
    except (ConfigError, ValueError) as exc:
        raise UserError(str(exc)) from None
    from alerts.notify_config import DEFAULT_NOTIFY_PATH, NotifyConfigError, load_notify_config
    from alerts.rulefile import DEFAULT_RULES_PATH, RuleFileError, load_rule_file

    try:
        load_rule_file(config.alert_rules_file or DEFAULT_RULES_PATH)
        load_notify_config(config.alert_notify_file or DEFAULT_NOTIFY_PATH, data_dir=config.data_dir)
    except (RuleFileError, NotifyConfigError) as exc:
        raise UserError(str(exc)) from None
    from kvscope.services import port_is_free

    if not port_is_free(config.host, config.port):
        raise UserError(f"port {config.port} on {config.host} is in use (another agent?): stop it, or choose another --port")
    print(
        f"kvscope agent: http://{config.host}:{config.port}, data in {config.data_dir} "
        f"(ingest queue {config.ingest_queue_max_events} events, full policy "
        f"{config.ingest_full_policy}; raw rows kept "
        f"{'forever' if config.raw_retention_hours is None else f'{config.raw_retention_hours:g} h'}; "
        f"Parquet export {'to ' + str(config.parquet_dir) if config.export_enabled else 'off'}; "
        f"alert rules {config.alert_rules_file or 'shipped default'}, notifications "
        f"{config.alert_notify_file or 'shipped default (JSONL log)'})",
        file=sys.stderr,
        flush=True,
    )
    try:
        serve(config, parent_pid=parent_pid)
    except (SchemaTooNewError, DatabaseUnusableError) as exc:
        raise UserError(f"{config.db_path}: {exc}") from None
    except duckdb.IOException as exc:
        holder = lock_holder(exc)
        if holder is None:
            raise
        raise UserError(
            f"{config.db_path} is open in another process ({holder}); stop that agent or choose another --data-dir"
        ) from None
    print(f"kvscope agent: stopped; {config.db_path} checkpointed and closed", file=sys.stderr, flush=True)
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Run Streamlit in the foreground: SIGTERM/SIGINT are forwarded to it (SIGKILL 10 s later if
    it is still there), and it dies with this process, SIGKILLed included."""
    from dashboard.launch import run_dashboard

    return run_dashboard(args.agent or default_agent_url(), args.port, args.host)


def cmd_sql(args: argparse.Namespace) -> int:
    from kvscope.sql import run_sql

    try:
        sys.stdout.write(run_sql(args.query, db=args.db, agent=args.agent or (None if args.db else default_agent_url()), fmt=args.format))
    except (AgentError, ValueError) as exc:
        raise UserError(str(exc)) from None
    return 0


def cmd_alerts(args: argparse.Namespace) -> int:
    from alerts.rulefile import RuleFileError, load_rule_file

    if args.alerts_command == "silence":
        return _silence(args)
    if args.alerts_command == "test":
        from rich.console import Console

        from alerts.golden import GoldenError, load_series, render_notifications, run_golden
        from kvscope.progress import ProgressLines

        if not args.verbose:  # the transitions are the output; the scheduler's log lines would repeat them
            logging.getLogger("alerts.rule_scheduler").setLevel(logging.ERROR)
        try:
            rules = load_rule_file(args.file)
            series = load_series(args.series)
            lines = ProgressLines(Console(stderr=True), "alerts test", 0, unit="evaluation times", final=False)

            def progress(done: int, total: int) -> None:
                lines.total, lines.done = total, done

            with lines:
                result = run_golden(rules, series, on_evaluation=progress)
        except (RuleFileError, GoldenError) as exc:
            raise UserError(str(exc)) from None
        sys.stdout.write(render_notifications(result, as_json=args.json))
        for problem in result.mismatches:
            print(f"FAILED: {problem}", file=sys.stderr)
        return 1 if result.mismatches else 0
    if args.alerts_command == "export-prometheus":
        from alerts.prometheus_export import export_prometheus

        try:
            text = export_prometheus(load_rule_file(args.file), dashboard_url=args.dashboard_url or "")
        except RuleFileError as exc:
            raise UserError(str(exc)) from None
        if args.output is None:
            sys.stdout.write(text)
        else:
            args.output.write_text(text, encoding="utf-8")
        return 0
    import yaml

    from alerts.notify_config import NOTIFY_KEYS, NotifyConfigError, load_notify_config

    failed = 0
    for path in args.files:
        try:
            try:
                document = yaml.safe_load(path.read_text(encoding="utf-8"))
            except OSError as exc:
                print(f"FAILED: {path}: cannot read: {exc.strerror or exc}", file=sys.stderr)
                failed += 1
                continue
            except (yaml.YAMLError, UnicodeDecodeError):
                document = None  # the rule loader reports it
            # a notification file has only its own top-level keys; anything else is read as rules
            notify_file = isinstance(document, dict) and bool(document) and set(document) <= NOTIFY_KEYS
            if notify_file:
                config = load_notify_config(path, data_dir=Path("kvscope-data"))
                counts = ((len(config.receivers), "receiver"), (len(config.inhibit_rules), "inhibit rule"), (len(config.alertmanagers), "Alertmanager"))
                print(f"{path}: SUCCESS: notification file, " + ", ".join(f"{n} {what}{'' if n == 1 else 's'}" for n, what in counts))
            else:
                rules = load_rule_file(path)
                print(f"{path}: SUCCESS: {len(rules.groups)} groups, {len(rules.rules)} rules found")
        except (RuleFileError, NotifyConfigError) as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def _silence(args: argparse.Namespace) -> int:
    import getpass

    from agent.client import AgentClient

    try:
        client = AgentClient(base_url=args.agent or default_agent_url(), timeout_seconds=10)
        if args.silence_command == "add":
            created = client.create_silence(
                matchers=args.matchers, duration=args.duration, comment=args.comment, created_by=args.author or getpass.getuser()
            )
            print(created["id"])
            return 0
        if args.silence_command == "expire":
            failed = 0
            for silence_id in args.ids:
                try:
                    client.expire_silence(silence_id)
                except AgentError as exc:
                    print(f"kvscope alerts silence: {silence_id}: {exc}", file=sys.stderr)
                    failed += 1
                    continue
                print(f"expired {silence_id}")
            return 1 if failed else 0
        found = client.silences()
    except (AgentError, ValueError) as exc:
        raise UserError(str(exc)) from None
    from datetime import UTC, datetime

    def when(unix: float) -> str:
        try:
            return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%d %H:%M:%S")
        except (OverflowError, OSError, ValueError):
            return f"{unix:.0f}"

    print(f"{'ID':36}  {'STATE':8}  {'ENDS (UTC)':19}  {'CREATED BY':12}  MATCHERS  COMMENT")
    for s in found:
        comment = "".join(ch if ch.isprintable() else " " for ch in s["comment"])
        print(f"{s['id']:36}  {s['state']:8}  {when(s['ends_at']):19}  {s['created_by'][:12]:12}  {' '.join(s['matchers'])}  {comment}")
    return 0
