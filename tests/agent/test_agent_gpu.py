"""The GPU sampler: off without NVML, exact rows and gauges with a fake NVML, skipped samples."""

from __future__ import annotations

import logging
import types
from datetime import datetime
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.gpu import GpuSampler
from agent.store import Store

GIB = 1024**3
T0 = 1_700_000_000.25  # 2023-11-14 22:13:20.25 UTC
T1 = T0 + 5


class FakeNVMLError(Exception):
    pass


class FakeNotSupported(FakeNVMLError):
    pass


class FakeNVML(types.ModuleType):
    """Two GPUs: 0 (bytes name, utilisation 37 %), 1 (str name, utilisation not supported)."""

    NVMLError = FakeNVMLError
    NVMLError_NotSupported = FakeNotSupported

    def __init__(self) -> None:
        super().__init__("fake_nvml")
        self.calls: list[str] = []
        self.used = [1 * GIB, 512 * 1024**2]
        self.total = [80 * GIB, 24 * GIB]
        self.util = 37
        self.fail_memory_of: int | None = None

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> tuple[str, int]:
        return ("handle", index)

    def nvmlDeviceGetName(self, handle: tuple[str, int]) -> bytes | str:
        return b"NVIDIA H100 80GB HBM3" if handle[1] == 0 else "NVIDIA L4"

    def nvmlDeviceGetMemoryInfo(self, handle: tuple[str, int]) -> Any:
        index = handle[1]
        if self.fail_memory_of == index:
            raise FakeNVMLError("GPU is lost")
        return types.SimpleNamespace(
            used=self.used[index],
            total=self.total[index],
            free=self.total[index] - self.used[index],
        )

    def nvmlDeviceGetUtilizationRates(self, handle: tuple[str, int]) -> Any:
        if handle[1] == 1:
            raise FakeNotSupported("Not Supported")
        return types.SimpleNamespace(gpu=self.util, memory=5)


def gpu_rows(store: Store) -> list[tuple[Any, ...]]:
    with store.cursor() as cur:
        return cur.execute(
            "SELECT ts, gpu_index, name, memory_used_bytes, memory_total_bytes, utilization_ratio "
            "FROM gpu_stats ORDER BY ts, gpu_index"
        ).fetchall()


def gpu_lines(registry: CollectorRegistry) -> list[str]:
    """The sample lines (not HELP/TYPE) of the GPU gauges."""
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if line.startswith("kvscope_gpu_")]


def test_no_gpu_here_sampler_stays_off(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML")
    registry = CollectorRegistry()
    sampler = GpuSampler(store, registry)
    with caplog.at_level(logging.DEBUG, logger="agent.gpu"):
        assert sampler.start() is False
        assert sampler.enabled is False
        records = [r for r in caplog.records if r.name == "agent.gpu"]
        assert len(records) == 1
        assert records[0].levelno == logging.INFO
        message = records[0].getMessage()
        assert "No GPU/NVML available" in message
        assert "NVMLError" in message
        assert "the GPU sampler stays off" in message
        assert sampler.sample() == 0
        assert sampler.sample(now=T0) == 0
        assert sampler.start() is False
        sampler.shutdown()
        assert len([r for r in caplog.records if r.name == "agent.gpu"]) == 1
    assert gpu_rows(store) == []
    assert gpu_lines(registry) == []
    text = generate_latest(registry).decode()
    assert "# TYPE kvscope_gpu_memory_used_bytes gauge" in text
    assert "# TYPE kvscope_gpu_utilization_ratio gauge" in text


def test_import_error_means_off(
    store: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    sampler = GpuSampler(store, CollectorRegistry())
    with caplog.at_level(logging.INFO, logger="agent.gpu"):
        assert sampler.start() is False
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.INFO,
            "No GPU/NVML available (ModuleNotFoundError: import of pynvml halted; "
            "None in sys.modules); the GPU sampler stays off",
        )
    ]
    assert sampler.sample(now=T0) == 0


def test_fake_nvml_rows_and_gauges(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNVML()
    registry = CollectorRegistry()
    sampler = GpuSampler(store, registry, nvml=nvml)
    with caplog.at_level(logging.DEBUG, logger="agent.gpu"):
        assert sampler.start() is True
        assert sampler.start() is True
    assert nvml.calls == ["init"]
    assert caplog.records == []

    assert sampler.sample(now=T0) == 2
    ts0 = datetime(2023, 11, 14, 22, 13, 20, 250000)
    assert gpu_rows(store) == [
        (ts0, 0, "NVIDIA H100 80GB HBM3", 1073741824, 85899345920, 0.37),
        (ts0, 1, "NVIDIA L4", 536870912, 25769803776, None),
    ]
    assert gpu_lines(registry) == [
        'kvscope_gpu_memory_used_bytes{gpu="0"} 1.073741824e+09',
        'kvscope_gpu_memory_used_bytes{gpu="1"} 5.36870912e+08',
        'kvscope_gpu_memory_total_bytes{gpu="0"} 8.589934592e+10',
        'kvscope_gpu_memory_total_bytes{gpu="1"} 2.5769803776e+10',
        'kvscope_gpu_utilization_ratio{gpu="0"} 0.37',
    ]

    nvml.used = [2 * GIB, 0]
    nvml.util = 100
    assert sampler.sample(now=T1) == 2
    ts1 = datetime(2023, 11, 14, 22, 13, 25, 250000)
    rows = gpu_rows(store)
    assert len(rows) == 4
    assert rows[2:] == [
        (ts1, 0, "NVIDIA H100 80GB HBM3", 2147483648, 85899345920, 1.0),
        (ts1, 1, "NVIDIA L4", 0, 25769803776, None),
    ]
    assert gpu_lines(registry) == [
        'kvscope_gpu_memory_used_bytes{gpu="0"} 2.147483648e+09',
        'kvscope_gpu_memory_used_bytes{gpu="1"} 0.0',
        'kvscope_gpu_memory_total_bytes{gpu="0"} 8.589934592e+10',
        'kvscope_gpu_memory_total_bytes{gpu="1"} 2.5769803776e+10',
        'kvscope_gpu_utilization_ratio{gpu="0"} 1.0',
    ]

    sampler.shutdown()
    sampler.shutdown()
    assert nvml.calls == ["init", "shutdown"]
    assert sampler.sample(now=T1 + 5) == 0
    assert len(gpu_rows(store)) == 4


def test_nvml_error_mid_sample_skips_it(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNVML()
    nvml.fail_memory_of = 1  # GPU 0 reads fine, GPU 1 fails: the whole sample is skipped
    registry = CollectorRegistry()
    sampler = GpuSampler(store, registry, nvml=nvml)
    assert sampler.start() is True
    with caplog.at_level(logging.DEBUG, logger="agent.gpu"):
        assert sampler.sample(now=T0) == 0
        assert sampler.sample(now=T0 + 1) == 0  # same message: not logged again
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "GPU sample skipped: FakeNVMLError: GPU is lost")
    ]
    assert gpu_rows(store) == []
    assert gpu_lines(registry) == []

    nvml.fail_memory_of = None
    assert sampler.sample(now=T1) == 2
    rows = gpu_rows(store)
    assert [(r[1], r[3], r[5]) for r in rows] == [(0, GIB, 0.37), (1, 512 * 1024**2, None)]
    assert 'kvscope_gpu_utilization_ratio{gpu="0"} 0.37' in gpu_lines(registry)


def test_sample_times_only_increase_even_when_the_clock_steps_back(store: Store) -> None:
    """The Parquet export orders gpu_stats rows by ts: a sample taken after the clock stepped
    back is stamped just after the previous one instead of before it."""
    sampler = GpuSampler(store, CollectorRegistry(), nvml=FakeNVML())
    assert sampler.start() is True
    assert sampler.sample(now=T0) == 2
    assert sampler.sample(now=T0 - 3600) == 2
    stamps = sorted({row[0] for row in gpu_rows(store)})
    assert stamps == [datetime(2023, 11, 14, 22, 13, 20, 250000), datetime(2023, 11, 14, 22, 13, 20, 250001)]
