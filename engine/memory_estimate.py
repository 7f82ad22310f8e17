"""What a model needs in memory before anything is allocated: its weights in the dtype they will
run in, plus the prefix cache's pools per form as the cache configuration sizes them, against
what the device has free. ``LLM`` logs it before loading the weights and refuses, naming the
settings to change, when it cannot fit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cache.config import CacheConfig
from engine.cache.form_spec import layout_pools
from engine.cache.what_if import planned_config
from engine.events import Form
from engine.model.base import ModelLayout

log = logging.getLogger(__name__)

MIB = 2**20


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes the weights and each form's pools take (sentinel blocks included), and what the
    device has free (None: unknown)."""

    device: str
    weights_bytes: int
    cache_bytes: Mapping[Form, int]
    available_bytes: int | None

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + sum(self.cache_bytes.values())

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.total_bytes <= self.available_bytes

    def render(self) -> str:
        forms = ", ".join(f"{form} {n / MIB:.1f}" for form, n in self.cache_bytes.items())
        free = "unknown" if self.available_bytes is None else f"{self.available_bytes / MIB:.0f} MiB"
        return (
            f"memory estimate on {self.device}: weights {self.weights_bytes / MIB:.1f} MiB + prefix cache "
            f"{sum(self.cache_bytes.values()) / MIB:.1f} MiB ({forms or 'no pools'}) = {self.total_bytes / MIB:.1f} MiB; free: {free}"
        )

    def refusal(self) -> str:
        """Why it cannot load, and what to change."""
        return (
            f"{self.render()} — it does not fit. Lower the prefix cache (CacheConfig.memory_bytes or the pool "
            "block counts; kvscope: --cache-memory-mib), the weights' dtype (LLM(dtype='bfloat16'); "
            "kvscope generate / serve: --dtype bfloat16), or use a device with more free memory (LLM(device=...); "
            "kvscope generate / serve: --device)"
        )


def cache_bytes(layout: ModelLayout, config: CacheConfig, dtype: torch.dtype) -> dict[Form, int]:
    """Bytes of every pool the cache of ``config`` allocates for ``layout``, per form (the block
    counts of ``config``, or those its ``memory_bytes`` plan gives; one sentinel block each).

    Raises:
        ValueError: as :func:`engine.cache.what_if.planned_config` (a budget too small for the
            headroom).
    """
    sized = planned_config(layout, config, dtype)[0] if config.memory_bytes is not None else config
    out: dict[Form, int] = {}
    for form, specs in layout_pools(layout, config.unit_tokens, dtype).items():
        counts = [int(getattr(sized, s.kind.config_field)) for s in specs]
        if form is Form.LINEAR_STATE and config.tail_replay == "only":
            counts = [2] * len(specs)  # the sentinel and one slot: no checkpoints are kept
        out[form] = sum(n * s.bytes_per_block for n, s in zip(counts, specs, strict=True))
    return out


def available_bytes(device: torch.device) -> int | None:
    """Free memory of ``device``: CUDA's free bytes, or the host's ``MemAvailable`` (Linux)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    meminfo = Path("/proc/meminfo")
    if device.type == "cpu" and meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def estimate(layout: ModelLayout, weights_bytes: int, config: CacheConfig, dtype: torch.dtype, device: torch.device) -> MemoryEstimate:
    return MemoryEstimate(str(device), weights_bytes, cache_bytes(layout, config, dtype), available_bytes(device))


def check_memory(config: CacheConfig, device: torch.device, layout: ModelLayout, weights_bytes: int, dtype: torch.dtype) -> None:
    """The loader's precheck, before the weights are loaded: log what the weights and the cache
    will take, and refuse when the device has not that much free.

    Raises:
        ValueError: naming the settings to change.
    """
    est = estimate(layout, weights_bytes, config, dtype, device)
    log.info("%s", est.render())
    if not est.fits:
        raise ValueError(est.refusal())
