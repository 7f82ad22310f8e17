"""The agent process's own resource gauges: process memory and start time, DuckDB's memory.

* ``process_resident_memory_bytes``, ``process_virtual_memory_bytes``,
  ``process_start_time_seconds`` (unix s), ``process_cpu_seconds_total``, ``process_open_fds``,
  ``process_max_fds``: prometheus_client's :class:`~prometheus_client.ProcessCollector` (read
  from ``/proc`` at scrape time; absent where there is no ``/proc``), under the standard names
  every Prometheus client library exports, so the usual dashboards and restart alerts
  (``changes(process_start_time_seconds[1h])``) work unchanged.
* ``kvscope_duckdb_memory_bytes``: the memory DuckDB's buffer manager holds now, the sum of
  ``memory_usage_bytes`` over DuckDB's ``duckdb_memory()`` table function, read at scrape time
  through a source the app sets (:func:`duckdb_memory_bytes` over its store). Absent while no
  store is open or when the read fails: a scrape never raises for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import duckdb
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.store import Store, StoreClosedError

log = logging.getLogger(__name__)

Source = Callable[[], float | None]
"""A scrape-time reading: a number, or ``None`` for absent."""


def register_process_collector(registry: CollectorRegistry) -> ProcessCollector:
    """Add prometheus_client's ``process_*`` metrics of this process to ``registry``."""
    return ProcessCollector(registry=registry)


class SourcedGauge(Collector):
    """A gauge read from a callable at every scrape, exported only when it returns a number.

    Unlike ``Gauge.set_function`` (which exports whatever the function returns and lets its
    exception fail the whole scrape), ``None`` or an exception from the source means the series
    is absent from this scrape (an exception is logged). No source set: absent.
    """

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self._source: Source | None = None
        registry.register(self)

    def set_source(self, source: Source | None) -> None:
        """Read the gauge from ``source`` from now on (``None``: absent)."""
        self._source = source

    def collect(self) -> Iterator[Metric]:
        source = self._source
        if source is None:
            return
        try:
            value = source()
        except Exception:
            log.warning(
                "metric %s: its source raised; left out of this scrape", self.name, exc_info=True
            )
            return
        if value is not None:
            yield GaugeMetricFamily(self.name, self.documentation, value=float(value))

    def describe(self) -> Iterator[Metric]:
        # registering must not call the source (the store may not be open yet)
        return iter(())


def duckdb_memory_bytes(store: Store | None) -> float | None:
    """Bytes DuckDB's buffer manager holds now (``sum(memory_usage_bytes)`` of
    ``duckdb_memory()``) on ``store``'s database; ``None`` when ``store`` is ``None``, closed,
    or the read fails (never raises)."""
    if store is None or not store.is_open:
        return None
    try:
        with store.cursor() as cur:
            row = cur.execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchone()
    except (duckdb.Error, StoreClosedError):
        return None
    if row is None or row[0] is None:
        return None
    return float(row[0])
