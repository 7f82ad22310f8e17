"""The agent's GPU sampler: NVML readings into ``gpu_stats`` and three Prometheus gauges.

Contract:

* NVML comes from the ``pynvml`` module of the ``nvidia-ml-py`` package, imported lazily by
  :meth:`GpuSampler.start` (a test passes its own module-like object as ``nvml``). Errors are
  caught as ``nvml.NVMLError`` of *that* module.
* **Off** means: NVML could not be initialised (the module is not installed, the NVML library is
  missing, no driver or no GPU). Then :meth:`GpuSampler.start` logs one info line and returns
  False, :meth:`GpuSampler.sample` stores nothing, sets no gauge and returns 0. A missing GPU is
  never an error; the sampler never raises for it.
* One sample reads every device first and writes only when all readings succeeded: one
  ``gpu_stats`` row per GPU, inserted in **one** transaction from an Arrow table (never row by
  row); the gauges are set after the commit. An NVML error during a sample skips that whole
  sample (nothing stored, gauges unchanged) and is logged as a warning once per distinct message,
  so a periodic job (APScheduler) keeps running.
* Units: bytes for memory, a ratio in [0, 1] for utilisation (NVML's percent / 100). A device
  that does not support utilisation (``NVMLError_NotSupported``) stores NULL and has no
  utilisation gauge sample.

Metrics (on the registry given to :class:`GpuSampler`; label ``gpu`` = the NVML index as a
string, kept low-cardinality — the device name is in ``gpu_stats`` only):

* ``kvscope_gpu_memory_used_bytes{gpu}``
* ``kvscope_gpu_memory_total_bytes{gpu}``
* ``kvscope_gpu_utilization_ratio{gpu}``
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
import types
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa
from prometheus_client import CollectorRegistry, Gauge

from agent.ingest import registered
from agent.store import Store, to_timestamp

logger = logging.getLogger(__name__)

_SCHEMA = pa.schema(
    [
        pa.field("ts", pa.timestamp("us"), nullable=False),
        pa.field("gpu_index", pa.int32(), nullable=False),
        pa.field("name", pa.string(), nullable=False),
        pa.field("memory_used_bytes", pa.int64(), nullable=False),
        pa.field("memory_total_bytes", pa.int64(), nullable=False),
        pa.field("utilization_ratio", pa.float64()),
    ]
)
_COLUMNS = ", ".join(_SCHEMA.names)
_VIEW = "_gpu_sample"
_MAX_REMEMBERED_WARNINGS = 64


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One device at one sample: memory in bytes, utilisation as a ratio in [0, 1] (None when
    the device does not support it)."""

    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_ratio: float | None


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an exception; never raises (pynvml's ``__str__`` may call NVML)."""
    try:
        text = str(exc)
    except Exception:
        text = repr(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class GpuSampler:
    """Samples every NVML device into ``gpu_stats`` and the gauges; see the module docstring.

    Thread-safe: :meth:`sample` and :meth:`shutdown` are serialised by a lock.
    """

    def __init__(
        self,
        store: Store,
        registry: CollectorRegistry,
        *,
        nvml: types.ModuleType | None = None,
    ) -> None:
        """Create the gauges on ``registry``; touches no GPU (call :meth:`start`).

        ``nvml`` is the NVML binding to use; None imports ``pynvml`` in :meth:`start`.

        Raises:
            ValueError: the gauges are already registered on ``registry``.
        """
        self._store = store
        self._last_ts: datetime | None = None
        self._nvml: Any = nvml
        self._lock = threading.Lock()
        self._started = False
        self._initialised = False
        self.enabled = False
        """True between a successful :meth:`start` and :meth:`shutdown`."""
        self._warned: set[str] = set()
        self._gpus_seen: set[str] = set()
        self.memory_used = Gauge(
            "kvscope_gpu_memory_used_bytes",
            "GPU memory in use, in bytes (NVML), per GPU index.",
            ("gpu",),
            registry=registry,
        )
        self.memory_total = Gauge(
            "kvscope_gpu_memory_total_bytes",
            "Total GPU memory, in bytes (NVML), per GPU index.",
            ("gpu",),
            registry=registry,
        )
        self.utilization = Gauge(
            "kvscope_gpu_utilization_ratio",
            "GPU utilisation as a ratio 0..1 over NVML's last sample period, per GPU index.",
            ("gpu",),
            registry=registry,
        )

    def start(self) -> bool:
        """Initialise NVML once; True when the sampler is on.

        On failure (``pynvml`` not importable, ``NVMLError`` such as the library not found,
        ``OSError``) logs one info line, leaves the sampler off and returns False. Later calls
        return the first call's result without logging again; after :meth:`shutdown` the
        sampler stays off. Never raises for a missing GPU.
        """
        with self._lock:
            if self._started:
                return self.enabled
            self._started = True
            try:
                if self._nvml is None:
                    self._nvml = importlib.import_module("pynvml")
                self._nvml.nvmlInit()
            except Exception as exc:
                error_type = getattr(self._nvml, "NVMLError", None)
                expected = (ImportError, OSError) + (
                    (error_type,) if isinstance(error_type, type) else ()
                )
                if not isinstance(exc, expected):
                    raise
                logger.info("No GPU/NVML available (%s); the GPU sampler stays off", _describe(exc))
                self.enabled = False
                return False
            self._initialised = True
            self.enabled = True
            return True

    def sample(self, now: float | None = None) -> int:
        """Read every device, store one ``gpu_stats`` row per GPU and set the gauges.

        ``now`` is the sample time in Unix seconds (default: the current time); rows get it as
        a naive UTC ``ts``. Returns the number of rows stored: 0 when the sampler is off or the
        sample was skipped because of an NVML error (logged as a warning, once per distinct
        message).

        Raises:
            duckdb.Error: the store failed; the transaction was rolled back, gauges unchanged.
            agent.store.StoreClosedError: the store is closed.
        """
        with self._lock:
            if not self.enabled:
                return 0
            nvml = self._nvml
            try:
                readings = self._read(nvml)
            except nvml.NVMLError as exc:
                self._warn_once(f"GPU sample skipped: {_describe(exc)}")
                return 0
            ts = to_timestamp(time.time() if now is None else now)
            # strictly increasing even if the clock steps back: the Parquet export orders
            # gpu_stats rows by ts (its stamp), so a row below the last one could be skipped
            if self._last_ts is not None and ts <= self._last_ts:
                ts = self._last_ts + timedelta(microseconds=1)
            if readings:
                self._insert(readings, ts)
                self._last_ts = ts
            self._set_gauges(readings)
            return len(readings)

    def shutdown(self) -> None:
        """Shut NVML down when :meth:`start` initialised it; the sampler is off afterwards.
        Idempotent; an NVML error here is logged, not raised."""
        with self._lock:
            self.enabled = False
            if not self._initialised:
                return
            self._initialised = False
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as exc:
                logger.warning("NVML shutdown failed (%s)", _describe(exc))

    def _read(self, nvml: Any) -> list[GpuReading]:
        not_supported = getattr(nvml, "NVMLError_NotSupported", None)
        readings: list[GpuReading] = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            raw_name = nvml.nvmlDeviceGetName(handle)
            name = (
                raw_name.decode("utf-8", errors="replace")
                if isinstance(raw_name, bytes)
                else str(raw_name)
            )
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            utilization: float | None
            try:
                utilization = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100
            except nvml.NVMLError as exc:
                if not_supported is None or not isinstance(exc, not_supported):
                    raise
                utilization = None
            readings.append(
                GpuReading(
                    index=index,
                    name=name,
                    memory_used_bytes=int(memory.used),
                    memory_total_bytes=int(memory.total),
                    utilization_ratio=utilization,
                )
            )
        return readings

    def _insert(self, readings: list[GpuReading], ts: Any) -> None:
        table = pa.Table.from_pydict(
            {
                "ts": [ts] * len(readings),
                "gpu_index": [r.index for r in readings],
                "name": [r.name for r in readings],
                "memory_used_bytes": [r.memory_used_bytes for r in readings],
                "memory_total_bytes": [r.memory_total_bytes for r in readings],
                "utilization_ratio": [r.utilization_ratio for r in readings],
            },
            schema=_SCHEMA,
        )
        with self._store.transaction() as cur, registered(cur, _VIEW, table):
            cur.execute(f"INSERT INTO gpu_stats ({_COLUMNS}) SELECT {_COLUMNS} FROM {_VIEW}")

    def _set_gauges(self, readings: list[GpuReading]) -> None:
        current = {str(r.index) for r in readings}
        for gone in self._gpus_seen - current:
            for gauge in (self.memory_used, self.memory_total, self.utilization):
                gauge.remove(gone)
        self._gpus_seen = current
        for r in readings:
            gpu = str(r.index)
            self.memory_used.labels(gpu).set(r.memory_used_bytes)
            self.memory_total.labels(gpu).set(r.memory_total_bytes)
            if r.utilization_ratio is None:
                self.utilization.remove(gpu)
            else:
                self.utilization.labels(gpu).set(r.utilization_ratio)

    def _warn_once(self, message: str) -> None:
        if message in self._warned:
            return
        if len(self._warned) < _MAX_REMEMBERED_WARNINGS:
            self._warned.add(message)
        logger.warning(message)
