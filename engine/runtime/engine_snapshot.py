"""What the server's stats line and cache gauges read from the runtime: requests running and
waiting, preemptions, and how full every cache form's device pools are (:class:`EngineSnapshot`).

:func:`take_snapshot` reads the prefix cache's pools, which only the engine thread changes, so
it runs there between steps (:meth:`~engine.runtime.engine_loop.EngineLoop.inspect`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.events import Form
from engine.runtime.runtime import Runtime


@dataclass(frozen=True, slots=True, kw_only=True)
class FormUsage:
    """One cache form's device pool, the fullest of its pools (as ``engine_stats`` events report
    it: :meth:`~engine.cache.accounting.Accounting.occupancy`), in blocks (sentinel excluded).

    ``leased_blocks`` are held by running requests (an allocation cannot take them);
    ``used_blocks`` hold state (leased, or cached and not yet evicted).
    """

    form: Form
    leased_blocks: int
    used_blocks: int
    total_blocks: int

    def __post_init__(self) -> None:
        if not 0 <= self.leased_blocks <= self.total_blocks or not 0 <= self.used_blocks <= self.total_blocks:
            raise ValueError(f"{self.form}: {self.leased_blocks} leased / {self.used_blocks} used blocks of {self.total_blocks}")

    @property
    def usage_ratio(self) -> float:
        """Leased blocks / blocks, 0..1: vLLM's ``kv_cache_usage_perc`` (1 − free / total, where
        evictable cached blocks count as free)."""
        return self.leased_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def occupancy_ratio(self) -> float:
        """Blocks holding state (leased or cached) / blocks, 0..1: how much of the pool the
        prefix cache fills (near 1 once it has warmed up; eviction keeps it there)."""
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSnapshot:
    """The runtime at one moment: requests running (holding leases) and waiting, preemptions
    since start, and every cache form's device usage in the cache's form order."""

    running: int
    waiting: int
    preemptions: int
    forms: tuple[FormUsage, ...]


def take_snapshot(runtime: Runtime) -> EngineSnapshot:
    """Read ``runtime`` and its cache now. Call it on the engine thread (it scans the pools the
    engine thread changes); with tensor parallelism it reads rank 0's shard of the pools."""
    forms = tuple(
        FormUsage(form=o.form, leased_blocks=o.leased_blocks, used_blocks=o.used_blocks, total_blocks=o.total_blocks)
        for o in runtime.llm.cache.occupancy()
    )
    return EngineSnapshot(running=len(runtime.running), waiting=len(runtime.waiting), preemptions=runtime.num_preemptions, forms=forms)
