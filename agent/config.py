"""Agent configuration: one frozen dataclass and its YAML loader.

A YAML file holds a flat mapping whose keys are the field names of :class:`AgentConfig`::

    host: 0.0.0.0
    port: 9400
    data_dir: /var/lib/kvscope
    token: s3cret            # or set KVSCOPE_TOKEN in the environment
    sql_row_limit: 10000
    sql_timeout_seconds: 10
    sql_max_concurrent_queries: null  # /v1/sql and /v1/query at once (null: the usable CPUs); more wait, then 429
    sql_queue_timeout_seconds: 2
    duckdb_memory_limit_bytes: null   # null: half of RAM (or of the cgroup limit)
    duckdb_threads: null              # null: one fewer than the CPUs
    alert_rules_file: /etc/kvscope/rules.yaml      # default: the shipped alerts/default_rules.yaml
    alert_notify_file: /etc/kvscope/notify.yaml    # default: the shipped alerts/default_notify.yaml
    ingest_queue_max_events: 200000   # the ingest buffer ...
    ingest_full_policy: reject        # ... and what happens when it is full (reject | block)
    raw_retention_hours: 168          # raw event rows kept a week (null: forever)
    rollup_retention_days: 400        # cache_minute rows (null: forever)
    export_enabled: true              # hourly Parquet export under export_dir
    export_dir: /var/lib/kvscope/export
    checkpoint_interval_seconds: 300

Command-line flags override file values with :func:`dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path

import yaml

from agent.duckdb_settings import usable_cpus
from agent.label_cap import DEFAULT_IDLE_SECONDS, DEFAULT_MAX_VALUES
from agent.pipeline import FULL_POLICIES

MiB = 1024 * 1024


DAY = 86_400
UPPER_BOUNDS: dict[str, float] = {
    "sql_timeout_seconds": DAY,
    "sql_max_concurrent_queries": 1024,
    "sql_queue_timeout_seconds": 3600,
    "duckdb_threads": 1024,
    "alert_interval_seconds": DAY,
    "ingest_block_timeout_seconds": 3600,
    "rollup_interval_seconds": DAY,
    "raw_retention_hours": 100 * 365 * 24,
    "rollup_retention_days": 100 * 365,
    "export_lag_seconds": 7 * DAY,
    "maintenance_interval_seconds": 7 * DAY,
    "checkpoint_interval_seconds": 7 * DAY,
    "gpu_sample_seconds": DAY,
    "metric_label_max_values": 10_000,
    "metric_label_idle_seconds": 365 * DAY,
}
"""Largest accepted values: beyond them a setting makes no sense and would overflow a timer or
a date computation."""


REMOVED_KEYS = {
    name: "the built-in RecoverableHitRateLow rule was replaced by rule files; set thresholds, windows "
    "and minimum volumes in alert_rules_file (see alerts/default_rules.yaml)"
    for name in ("alert_threshold", "alert_window_seconds", "alert_min_prompt_tokens")
}
"""Keys older configs may hold, with what replaced them."""


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file and the key."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    """Everything the agent needs to run.

    Attributes:
        host, port: where the HTTP API listens.
        data_dir: folder holding the DuckDB file (``kvscope.duckdb``), the alert transition log
            (``alerts.log``) and the default log receiver's ``notifications.jsonl``; created on
            start.
        token: bearer token required on every route but ``/healthz``; ``None`` falls back to the
            ``KVSCOPE_TOKEN`` environment variable, and to no authentication when that is unset.
        sql_row_limit: most rows one ``/v1/sql`` or ``/v1/query`` answer carries.
        sql_timeout_seconds: a read query running longer is interrupted (HTTP 408). The answer
            comes at the limit even when DuckDB cannot stop the query at once (one long function
            call); that query keeps its slot until it really ends.
        sql_max_concurrent_queries: ``/v1/sql`` and ``/v1/query`` queries running at once
            (:mod:`agent.query_gate`); ``None``: the CPUs the agent may use (2 on a 2-core
            machine: with 4 heavy queries at once there, ingest p99 latency grew 2.3-4.3x, with 2
            about 1.3-1.4x — benchmarks/query_isolation.py). Alert rule inputs do not count
            against it and are never refused. The limit in force: :attr:`query_concurrency`.
        sql_queue_timeout_seconds: a query finding every slot taken waits this long for one,
            then is answered 429 with ``Retry-After``.
        duckdb_memory_limit_bytes: DuckDB's ``memory_limit`` for the whole instance; ``None``:
            half of RAM, or of the cgroup limit when lower (:mod:`agent.duckdb_settings`).
        duckdb_threads: DuckDB's worker threads for the whole instance; ``None``: one fewer than
            the usable CPUs (at least 1), leaving ingest and the HTTP loop a core.
        max_body_bytes: largest accepted ``POST /v1/events`` body (HTTP 413 above it).
        alert_ingest_lag_seconds: the evaluation runs this many seconds after each minute
            boundary and ends its windows that long before now, so late events are counted.
        alert_interval_seconds: evaluate rule groups without their own ``interval`` every N
            seconds instead of on minute boundaries (tests and demos); ``None`` keeps the minute
            schedule.
        alert_rules_file: the rule file (:mod:`alerts.rulefile`); ``None``: the shipped
            ``alerts/default_rules.yaml``.
        alert_notify_file: the notification file (:mod:`alerts.notify_config`: routes,
            receivers, inhibitions, Alertmanagers); ``None``: the shipped
            ``alerts/default_notify.yaml`` (a JSONL log receiver).
        external_url: the agent's URL as receivers should link to it (``externalURL``,
            ``generatorURL``); ``None``: ``http://{host}:{port}``.
        dashboard_url: the dashboard's URL, for ``{{ $dashboardURL }}`` in alert annotations
            (the shipped rules' ``runbook_url`` opens its Forms page on the alert's form and
            reason); ``None``: the links are relative (``/forms?...``).
        decode_processes: worker processes that decode and prepare event batches (0: two
            threads in the agent's process instead; see :mod:`agent.decode`).
        ingest_queue_max_events: events the ingest queue holds (decoded, waiting for a flush).
        ingest_full_policy: when a batch does not fit: ``reject`` answers 503 with
            ``Retry-After`` at once (the engine's client spools it), ``block`` waits up to
            ``ingest_block_timeout_seconds`` for room, then answers 503.
        flush_max_events: events one ingest transaction takes at most.
        flush_wait_seconds: group commit: while other batches are being decoded, a flush waits
            up to this long for them to join its transaction (one commit's fixed cost shared);
            0 never waits. Nothing waits when no other batch is on its way.
        rollup_interval_seconds: fold newly stored lookups into ``cache_minute`` this often
            (late events included: they land in their own minute).
        raw_retention_hours: raw event rows (``cache_lookups``, ``requests``, ``engine_stats``,
            ``block_events``, ``gpu_stats``) older than this (by ``ts``) are deleted hourly,
            after the export — only rows already exported (and folded into ``cache_minute``);
            ``None`` keeps them.
        rollup_retention_days: the same for ``cache_minute`` rows (by ``minute``).
        export_enabled: write every finished hour of the raw tables to Parquet, partitioned by
            date (and form, where the table has one), under ``export_dir``.
        export_dir: where; ``None`` means ``data_dir / "export"``.
        export_lag_seconds: an hour is exported this long after it ended (late events); rows
            that arrive later are written as a further part of that hour.
        maintenance_interval_seconds: run export + retention every N seconds instead of hourly
            (tests, demos).
        checkpoint_interval_seconds: fold the WAL into the database file this often (a crash
            loses nothing acknowledged either way: commits are in the WAL).
        checkpoint_wal_bytes: DuckDB's ``wal_autocheckpoint``: also checkpoint when the WAL
            reaches this size. 256 MiB, not DuckDB's 16 MiB: each checkpoint recompresses the
            tables' last, partly filled row groups, so at 200,000 events/s a 16 MiB WAL spent
            4.4 µs of CPU per stored row against 2.4 µs at 256 MiB
            (``benchmarks/ingest_load.py``; docs/agent.md, "Ingest throughput").
        gpu_sample_seconds: NVML sampling period (``gpu_stats`` and ``kvscope_gpu_*``); ``None``
            turns the sampler off. Without a GPU it logs once and stays off.
        metric_label_max_values: distinct values each free-form metric label (``engine``,
            ``model``) keeps: the first ones seen (see ``metric_label_idle_seconds``); later
            values are exported as ``other`` and counted in ``kvscope_metric_label_values_folded_total``
            (:mod:`agent.label_cap`). Bounds ``/metrics``; the stored events keep every value.
        metric_label_idle_seconds: when a label is at ``metric_label_max_values`` and a new value
            arrives, the kept value unseen longest is evicted if unseen for this many seconds
            (every series carrying it is removed, counted in
            ``kvscope_metric_label_values_evicted_total``) and the new value takes its slot, so
            engine ids that died (a new ``host-pid-start`` id per engine run) do not hold the
            slots forever. ``None``: never evict (the first values are kept until restart).
        vllm_kv_events / vllm_kv_events_replay: a vLLM engine's ZMQ KV-event PUB address and
            its replay (ROUTER) address, both optional: its block events are stored under
            ``vllm_engine_id`` / ``vllm_model`` (:mod:`agent.vllm_subscriber`; docs/vllm.md).
    """

    host: str = "127.0.0.1"
    port: int = 9400
    data_dir: Path = Path("kvscope-data")
    token: str | None = None
    sql_row_limit: int = 10_000
    sql_timeout_seconds: float = 10.0
    sql_max_concurrent_queries: int | None = None
    sql_queue_timeout_seconds: float = 2.0
    duckdb_memory_limit_bytes: int | None = None
    duckdb_threads: int | None = None
    max_body_bytes: int = 32 * MiB
    alert_ingest_lag_seconds: int = 5
    alert_interval_seconds: float | None = None
    alert_rules_file: Path | None = None
    alert_notify_file: Path | None = None
    external_url: str | None = None
    dashboard_url: str | None = None
    decode_processes: int = 2
    ingest_queue_max_events: int = 200_000
    ingest_full_policy: str = "reject"
    ingest_block_timeout_seconds: float = 5.0
    flush_max_events: int = 50_000
    flush_wait_seconds: float = 0.02
    rollup_interval_seconds: float = 10.0
    raw_retention_hours: float | None = 168.0
    rollup_retention_days: float | None = 400.0
    export_enabled: bool = True
    export_dir: Path | None = None
    export_lag_seconds: int = 60
    maintenance_interval_seconds: float | None = None
    checkpoint_interval_seconds: float = 300.0
    checkpoint_wal_bytes: int = 256 * MiB
    gpu_sample_seconds: float | None = 15.0
    metric_label_max_values: int = DEFAULT_MAX_VALUES
    metric_label_idle_seconds: float | None = DEFAULT_IDLE_SECONDS
    vllm_kv_events: str | None = None
    vllm_kv_events_replay: str | None = None
    vllm_engine_id: str = "vllm"
    vllm_model: str = "vllm"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value}")
            limit = UPPER_BOUNDS.get(f.name)
            if limit is not None and isinstance(value, int | float) and value > limit:
                raise ValueError(f"{f.name} must be at most {limit:g}, got {value:g}")
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not isinstance(self.data_dir, Path):
            object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.token is not None and not self.token:
            raise ValueError("token must not be empty (use null for no token)")
        if self.sql_row_limit < 1:
            raise ValueError(f"sql_row_limit must be >= 1, got {self.sql_row_limit}")
        if not self.sql_timeout_seconds > 0:
            raise ValueError(f"sql_timeout_seconds must be > 0, got {self.sql_timeout_seconds}")
        if self.sql_max_concurrent_queries is not None and self.sql_max_concurrent_queries < 1:
            raise ValueError(f"sql_max_concurrent_queries must be >= 1, got {self.sql_max_concurrent_queries}")
        if self.sql_queue_timeout_seconds < 0:
            raise ValueError(f"sql_queue_timeout_seconds must be >= 0, got {self.sql_queue_timeout_seconds}")
        if self.duckdb_memory_limit_bytes is not None and self.duckdb_memory_limit_bytes < 16 * MiB:
            raise ValueError(f"duckdb_memory_limit_bytes must be >= {16 * MiB} (16 MiB) or null, got {self.duckdb_memory_limit_bytes}")
        if self.duckdb_threads is not None and self.duckdb_threads < 1:
            raise ValueError(f"duckdb_threads must be >= 1 or null, got {self.duckdb_threads}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if not 0 <= self.alert_ingest_lag_seconds <= 59:
            raise ValueError(
                f"alert_ingest_lag_seconds must be in [0, 59], got {self.alert_ingest_lag_seconds}"
            )
        if self.alert_interval_seconds is not None and not self.alert_interval_seconds > 0:
            raise ValueError(
                f"alert_interval_seconds must be > 0 or null, got {self.alert_interval_seconds}"
            )
        if self.decode_processes < 0:
            raise ValueError(f"decode_processes must be >= 0, got {self.decode_processes}")
        if not 0 <= self.flush_wait_seconds <= 1:
            raise ValueError(f"flush_wait_seconds must be between 0 and 1, got {self.flush_wait_seconds}")
        if self.ingest_queue_max_events < 1 or self.flush_max_events < 1:
            raise ValueError("ingest_queue_max_events and flush_max_events must be >= 1")
        if self.ingest_full_policy not in FULL_POLICIES:
            raise ValueError(
                f"ingest_full_policy must be one of {', '.join(FULL_POLICIES)}, got {self.ingest_full_policy!r}"
            )
        for name in ("ingest_block_timeout_seconds", "checkpoint_interval_seconds", "rollup_interval_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "raw_retention_hours",
            "rollup_retention_days",
            "maintenance_interval_seconds",
            "gpu_sample_seconds",
            "metric_label_idle_seconds",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or null, got {value}")
        if self.export_lag_seconds < 0:
            raise ValueError(f"export_lag_seconds must be >= 0, got {self.export_lag_seconds}")
        if self.checkpoint_wal_bytes < 1:
            raise ValueError(f"checkpoint_wal_bytes must be >= 1, got {self.checkpoint_wal_bytes}")
        if self.metric_label_max_values < 1:
            raise ValueError(f"metric_label_max_values must be >= 1, got {self.metric_label_max_values}")
        if self.export_dir is not None and not isinstance(self.export_dir, Path):
            object.__setattr__(self, "export_dir", Path(self.export_dir))
        for name in ("alert_rules_file", "alert_notify_file"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        for name in ("vllm_kv_events", "vllm_kv_events_replay"):  # where to connect: vLLM's bind address '*' is not one
            address = getattr(self, name)
            if address is not None and not re.fullmatch(r"tcp://[^*\s/:]+:\d{1,5}|tcp://\[[0-9a-fA-F:.]+\]:\d{1,5}|(ipc|inproc)://\S+", address):
                raise ValueError(f"{name} must be a ZMQ address to connect to (tcp://HOST:PORT, ipc://PATH), got {address!r}")
        if not 0 < len(self.vllm_engine_id) <= 256 or not 0 < len(self.vllm_model) <= 256:
            raise ValueError("vllm_engine_id and vllm_model must be 1 to 256 characters (the event contract's names)")
        for name in ("external_url", "dashboard_url"):
            url = getattr(self, name)
            if url is not None and (not url.startswith(("http://", "https://")) or "{" in url or "}" in url):
                raise ValueError(f"{name} must be an http(s) URL, got {url!r}")

    @property
    def query_concurrency(self) -> int:
        """``sql_max_concurrent_queries``, or the usable CPUs when it is ``None``."""
        return self.sql_max_concurrent_queries if self.sql_max_concurrent_queries is not None else usable_cpus()

    @property
    def db_path(self) -> Path:
        """The DuckDB file: ``data_dir / "kvscope.duckdb"``."""
        return self.data_dir / "kvscope.duckdb"

    @property
    def parquet_dir(self) -> Path:
        """Where hourly Parquet files go: ``export_dir``, else ``data_dir / "export"``."""
        return self.export_dir if self.export_dir is not None else self.data_dir / "export"

    @property
    def alert_log_path(self) -> Path:
        """The log receiver's file, one JSON notification per line."""
        return self.data_dir / "alerts.log"

    @property
    def agent_url(self) -> str:
        """``external_url``, else ``http://{host}:{port}``."""
        return self.external_url or f"http://{self.host}:{self.port}"


def read_yaml(path: Path, what: str, error: type[ValueError]) -> object:
    """The parsed YAML document at ``path``.

    Raises:
        ``error``: the file cannot be read (``cannot read {what}``) or is not valid YAML; the
            message starts with the path.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise error(f"{path}: cannot read {what}: it is not UTF-8 text") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{path}: invalid YAML: {exc}") from None


def load_config(path: str | Path) -> AgentConfig:
    """Read an :class:`AgentConfig` from a YAML file (a flat mapping of field names).

    Missing keys take their defaults. Raises :class:`ConfigError` (a ``ValueError``) naming the
    file and the key for an unreadable file, bad YAML, an unknown key, a value of the wrong type
    or a value the config rejects.
    """
    path = Path(path)
    raw = read_yaml(path, "config file", ConfigError)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(raw).__name__}")
    return config_from_mapping(raw, source=str(path))


def config_from_mapping(raw: Mapping[object, object], *, source: str = "<config>") -> AgentConfig:
    """Build an :class:`AgentConfig` from a plain mapping (what :func:`load_config` parsed).

    Raises :class:`ConfigError` naming ``source`` and the offending key.
    """
    hints = typing.get_type_hints(AgentConfig)
    known = [f.name for f in dataclasses.fields(AgentConfig)]
    values: dict[str, object] = {}
    for key, value in raw.items():
        if isinstance(key, str) and key in REMOVED_KEYS:
            raise ConfigError(f"{source}: key {key!r} was removed: {REMOVED_KEYS[key]}")
        if not isinstance(key, str) or key not in hints:
            raise ConfigError(f"{source}: unknown key {key!r}; known keys: {', '.join(known)}")
        values[key] = _coerce(source, key, value, hints[key])
    try:
        return AgentConfig(**values)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _coerce(source: str, key: str, value: object, hint: object) -> object:
    """Check ``value`` against the field's type hint; ints are accepted where floats are."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return None
        if option is Path and isinstance(value, str) and value:
            return Path(value)
        if option is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if option is bool and isinstance(value, bool):
            return value
        if option in (int, str) and type(value) is option:
            return value
    expected = " or ".join(
        "null" if o is type(None) else getattr(o, "__name__", str(o)) for o in options
    )
    raise ConfigError(
        f"{source}: key {key!r} must be {expected}, got {type(value).__name__} {value!r}"
    )
