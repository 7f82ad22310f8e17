"""The capacity what-if: how many blocks each pool gets from one byte budget, before any pool
exists.

:func:`pool_plans` turns pool specs (:mod:`engine.cache.form_spec`) into
:class:`~engine.cache.memory_plan.PoolPlan` rows — bytes per block, the prefix tokens one block
holds and the headroom running requests need; :func:`planned_config` sizes every pool from
``CacheConfig.memory_bytes`` with them (:func:`~engine.cache.memory_plan.sized_config`). Both
read only the model layout and the config, so answering "what would this budget hold" builds no
cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.cache.config import CacheConfig
from engine.cache.form_spec import (
    PoolKind,
    PoolSpec,
    layout_pools,
    needs_checkpoints,
    pools_in_order,
)
from engine.cache.memory_plan import PoolPlan, headroom, sized_config, window_pages_needed
from engine.model.base import ModelLayout


def pool_plans(
    pools: Sequence[tuple[PoolSpec, int]],
    config: CacheConfig,
    window_tokens: int | None,
    has_checkpoint_forms: bool,
) -> list[PoolPlan]:
    """One plan per ``(pool spec, blocks without the sentinel)``: the prefix tokens one block
    holds — a page its tokens; a checkpoint slot one checkpoint interval; a tail or indexer
    slot one interval when some form resumes only at checkpoints, else U; a window page, when
    windows are kept behind checkpoints, its share of the windows of the cached boundaries —
    and its headroom (:func:`~engine.cache.memory_plan.headroom`).

    Args:
        window_tokens: W of the windowed layers (None: the model has none).
        has_checkpoint_forms: some form resumes only at stored checkpoints.
    """
    u = config.unit_tokens
    interval = config.checkpoint_interval_tokens if has_checkpoint_forms else u
    window_pages = window_pages_needed(config, window_tokens, 0) if window_tokens is not None else 0
    out: list[PoolPlan] = []
    for spec, blocks in pools:
        tokens = spec.page_tokens
        if spec.kind is PoolKind.CHECKPOINT_SLOT:
            tokens = config.checkpoint_interval_tokens
        elif spec.kind is PoolKind.BOUNDARY_SLOT:
            tokens = interval
        elif spec.kind is PoolKind.WINDOW_PAGE and window_tokens is not None and has_checkpoint_forms:
            # a cached boundary keeps the pages of its window; windows wider than the
            # interval overlap, so the pool then keeps every page of the prefix
            tail_pages = -(-(window_tokens - 1) // u) + 1
            tokens = interval // min(interval // u, tail_pages)
        out.append(
            PoolPlan(
                name=spec.name,
                form=spec.form,
                kind=spec.kind,
                blocks=blocks,
                bytes_per_block=spec.bytes_per_block,
                tokens_per_block=max(1, tokens),
                headroom_blocks=headroom(spec.kind, window_pages),
            )
        )
    return out


def planned_config(layout: ModelLayout, config: CacheConfig, dtype: torch.dtype) -> tuple[CacheConfig, int]:
    """``config`` with every pool's block count sized from ``config.memory_bytes`` (one memory
    plan for every form of ``layout``, KV pages in ``dtype``), and the prefix length C every
    form holds beyond headroom.

    Raises:
        ValueError: ``memory_bytes`` is unset, or the budget cannot hold the headroom of every
            pool; a compression ratio of the layout does not tile U.
    """
    specs = layout_pools(layout, config.unit_tokens, dtype)
    plans = pool_plans([(p, 0) for p in pools_in_order(specs)], config, layout.sliding_window, needs_checkpoints(specs))
    return sized_config(config, plans)
