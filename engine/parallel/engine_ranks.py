"""Starting the ranks of one tensor-parallel engine and the checks they make together at start.

:func:`start` runs inside ``LLM.__init__`` on every rank, between loading the whole model and
building its prefix cache: rank 0 refuses a model whose heads do not divide by N (before any
process starts), spawns the workers and every rank joins the group and cuts its model to its
shard. :func:`check_geometry` runs once the cache exists: the ranks compare a fingerprint of
their pools, so ranks that would hold different block geometries never serve.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.cache import CacheConfig, PrefixCache
from engine.cache.rank_agreement import RankAgreement
from engine.events import Tier
from engine.parallel.executor import RankProcesses, RankSpec
from engine.parallel.group import TensorParallelGroup, free_port
from engine.parallel.sharding import check_shardable, shard_model

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineRanks:
    """One rank's part in a tensor-parallel engine: its group, and on rank 0 the workers."""

    group: TensorParallelGroup
    workers: RankProcesses | None

    def status(self) -> list[dict[str, Any]]:
        """Per rank: ``rank``, ``pid`` and whether its process is ``alive`` (rank 0: this
        process; a worker's only as rank 0 sees it)."""
        out: list[dict[str, Any]] = [{"rank": self.group.rank, "pid": os.getpid(), "alive": True}]
        if self.workers is not None:
            out += [{"rank": rank, "pid": proc.pid, "alive": proc.is_alive()} for rank, proc, _ in self.workers.processes]
        return out

    def close(self) -> None:
        """Stop the workers (rank 0), then leave the group."""
        try:
            if self.workers is not None:
                self.workers.close()
        finally:
            self.group.close()


def start(
    model: nn.Module, device: torch.device, size: int, timeout_seconds: float, spec: RankSpec | None,
    factory: Callable[..., Any], llm_kwargs: dict[str, Any],
) -> EngineRanks:  # fmt: skip
    """Join (``spec``: a worker) or start (rank 0: spawn ranks 1 … N − 1, each building
    ``factory(**llm_kwargs)``) the group, then cut ``model`` to this rank's shard.

    Raises:
        ValueError: N < 1, or a head count that does not divide by N (naming the config field).
        RankFailed: a worker died before joining.
    """
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be ≥ 1, got {size}")
    check_shardable(model, size)
    workers: RankProcesses | None = None
    if spec is None:
        port = free_port()
        workers = RankProcesses(size, port, timeout_seconds, factory, llm_kwargs)
        rank = 0
    else:
        port, rank = spec.port, spec.rank
    try:
        alive = None if workers is None else workers.check_alive
        group = TensorParallelGroup(rank, size, port, timeout_seconds=timeout_seconds, device=device, peers_alive=alive)
        shard_model(model, group)
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    return EngineRanks(group, workers)


def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """The device of one rank: on CUDA GPU ``rank`` (made current), elsewhere ``device``.

    Raises:
        ValueError: fewer CUDA GPUs than ranks.
    """
    if size <= 1 or device.type != "cuda":
        return device
    if torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size = {size} needs {size} CUDA GPUs; {torch.cuda.device_count()} are visible")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def rank_cache_config(config: CacheConfig, rank: int) -> CacheConfig:
    """``config`` for one rank: its disk tier in its own ``rank<r>`` subdirectory (each rank
    offloads and swaps in its own shards)."""
    if config.disk_tier_dir is None:
        return config
    return dataclasses.replace(config, disk_tier_dir=str(Path(config.disk_tier_dir) / f"rank{rank}"))


def join_cache(ranks: EngineRanks, cache: PrefixCache) -> None:
    """A rank's cache joins the engine: compare the ranks' pool geometry (:func:`check_geometry`),
    keep only the disk-tier objects an earlier run left on every rank (:func:`intersect_disk_tier`)
    and run every lookup and lease through the cross-rank agreement.

    Raises:
        ValueError: the ranks' geometries differ.
    """
    check_geometry(ranks.group, cache)
    intersect_disk_tier(ranks.group, cache)
    cache.agreement = RankAgreement(ranks.group)


def intersect_disk_tier(group: TensorParallelGroup, cache: PrefixCache) -> int:
    """After a restart, an object of the disk tier is restorable only if every rank found its
    shard intact: the ranks exchange what each indexed, and each drops (and counts in
    ``tiers.skipped["tp_incomplete"]``) what some other rank lacks. Returns the objects dropped
    here."""
    tiers = cache.tiers
    mine = [] if tiers is None else sorted((pool, h) for (pool, h), e in tiers.entries.items() if e.tier is Tier.DISK)
    everyone = group.startup_gather_objects(mine)
    common = set.intersection(*(set(keys) for keys in everyone if isinstance(keys, list)))
    dropped = [key for key in mine if key not in common]
    for pool, h in dropped:
        assert tiers is not None
        tiers.drop(pool, h)
        tiers.skipped["tp_incomplete"] += 1
    if dropped:
        log.warning("disk tier: %d objects skipped, not intact on every tensor-parallel rank", len(dropped))
    return len(dropped)


def geometry_fingerprint(cache: PrefixCache) -> int:
    """A 63-bit hash of every pool's name, blocks and bytes per block, and of the layout's
    per-layer state shapes: equal on every rank of a well-formed engine."""
    layout = cache.layout
    parts = [repr((p.name, p.blocks, p.bytes_per_block, p.tokens_per_block)) for p in cache.pool_plans()]
    parts.append(repr((layout.num_kv_heads, layout.kv_head_dim, sorted(layout.linear_state_shapes.items()), sorted(layout.kv_geometry.items()))))
    return int.from_bytes(hashlib.sha256("|".join(parts).encode()).digest()[:8], "big") >> 1


def check_geometry(group: TensorParallelGroup, cache: PrefixCache) -> None:
    """Compare the ranks' :func:`geometry_fingerprint` (on the startup group).

    Raises:
        ValueError: naming the ranks whose geometry differs from rank 0's.
    """
    prints = [row[0] for row in group.startup_gather([geometry_fingerprint(cache)])]
    differ = [r for r, p in enumerate(prints) if p != prints[0]]
    if differ:
        raise ValueError(
            f"tensor-parallel ranks {differ} hold another cache geometry than rank 0 "
            f"(pool blocks, block bytes or state shapes differ; fingerprints {[hex(p) for p in prints]})"
        )
