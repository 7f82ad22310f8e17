"""One memory plan for every cache form: per-pool block counts from one byte budget.

A hybrid model keeps one prefix as several kinds of state whose cost per token differs by orders
of magnitude (a full-KV page per U tokens, a compressed entry page per ``max(U, r)`` tokens, a
tail slot or recurrent checkpoint per checkpoint interval, a window per cached boundary). Sizing
each pool by hand makes one form run out long before the others, and the prefix is then lost in
all of them. The plan instead gives every form the blocks it needs to hold the *same* number of
prefix tokens C (the cached capacity), after reserving **headroom** that caching may never use:

* ``swa_window`` — the window pages one running request holds while its window slides (the
  window behind its last checkpoint, one prefill chunk and one checkpoint interval), so window
  eviction never has to take a cached boundary's tail to make progress;
* tail, indexer pending and ``linear_state`` slots — one slot, for the checkpoint the running
  request stores;
* ``full_kv`` and compressed entry pages — none: the pages a running request holds are the
  prefix it caches.

A cached boundary keeps its window tail, so the window pool's cached share is ``C / interval``
boundaries × the window's pages. Source of the idea: vLLM's ``KVCacheConfig`` (one budget split
into per-group pools of equal block counts); here the split is by tokens held, not by blocks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from engine.cache.config import CacheConfig
from engine.cache.form_spec import PoolKind
from engine.events import Form


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolPlan:
    """One pool: what its blocks hold (``kind``, which names the ``CacheConfig`` count sizing
    it), its blocks (sentinel excluded), bytes per block, how many tokens of a prefix one block
    holds, and the blocks reserved as headroom for running requests."""

    name: str
    form: Form
    kind: PoolKind
    blocks: int
    bytes_per_block: int
    tokens_per_block: int
    headroom_blocks: int

    @property
    def bytes(self) -> int:
        return self.blocks * self.bytes_per_block


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPlan:
    """Every pool of a cache and the resume granularity of every form.

    ``budget_bytes`` is the budget the plan was sized for (None when the block counts came from
    the config); ``capacity_tokens`` is the prefix length every form can hold beyond headroom.
    """

    pools: tuple[PoolPlan, ...]
    granularity: dict[Form, int]
    budget_bytes: int | None
    capacity_tokens: int

    @property
    def total_bytes(self) -> int:
        return sum(p.bytes for p in self.pools)

    def form_bytes(self) -> dict[Form, int]:
        out: dict[Form, int] = {}
        for p in self.pools:
            out[p.form] = out.get(p.form, 0) + p.bytes
        return out

    def render(self) -> str:
        """A plain-text table: one line per pool, then per form its bytes and granularity."""
        lines = [
            f"cache memory plan: {self.total_bytes / 2**20:.1f} MiB"
            + (f" of a {self.budget_bytes / 2**20:.1f} MiB budget" if self.budget_bytes is not None else "")
            + f", every form holds ≥ {self.capacity_tokens} prefix tokens beyond headroom",
            f"  {'pool':<34} {'blocks':>8} {'headroom':>8} {'B/block':>10} {'tok/block':>9} {'MiB':>8}",
        ]
        for p in self.pools:
            lines.append(
                f"  {p.name:<34} {p.blocks:>8} {p.headroom_blocks:>8} {p.bytes_per_block:>10} "
                f"{p.tokens_per_block:>9} {p.bytes / 2**20:>8.2f}"
            )
        sizes = self.form_bytes()
        for form, spacing in self.granularity.items():
            lines.append(f"  form {form:<18} {sizes.get(form, 0) / 2**20:>8.2f} MiB, resumes every {spacing} tokens")
        return "\n".join(lines)


def window_pages_needed(config: CacheConfig, window_tokens: int, max_tokens: int) -> int:
    """Most pages one request can hold in a window pool of ``window_tokens``: the window behind
    its last checkpoint (up to one interval back), one prefill chunk, and its ``max_tokens``
    decoded tokens."""
    span = window_tokens + config.max_prefill_chunk_tokens + config.checkpoint_interval_tokens + max_tokens
    return -(-span // config.unit_tokens) + 2


def headroom(kind: PoolKind, window_pages: int) -> int:
    """Blocks of a pool of ``kind`` that one running request may hold beyond what it caches
    (see module docstring)."""
    if kind is PoolKind.WINDOW_PAGE:
        return window_pages
    if kind in (PoolKind.KV_PAGE, PoolKind.ENTRY_PAGE):
        return 0  # a running request's pages are the prefix it caches
    return 1


def capacity_tokens(pools: list[PoolPlan], budget_bytes: int) -> int:
    """The largest C (a multiple of the coarsest block, at least one of it) such that every
    pool holding C tokens beyond its headroom — ⌈C / tokens per block⌉ + headroom + the sentinel
    blocks — fits in ``budget_bytes``.

    Raises:
        ValueError: the budget cannot hold the headroom and one coarsest block of every pool.
    """
    step = max(p.tokens_per_block for p in pools)

    def cost(tokens: int) -> int:
        return sum((-(-tokens // p.tokens_per_block) + p.headroom_blocks + 1) * p.bytes_per_block for p in pools)

    per_token = sum(p.bytes_per_block / p.tokens_per_block for p in pools)
    tokens = int((budget_bytes - cost(0)) / per_token) if per_token > 0 else 0
    tokens -= tokens % step
    while tokens >= step and cost(tokens) > budget_bytes:  # ceilings can add a block per pool
        tokens -= step
    if tokens < step:
        raise ValueError(
            f"a cache budget of {budget_bytes / 2**20:.2f} MiB cannot hold the headroom of every pool plus "
            f"{step} tokens of prefix (needs {cost(step) / 2**20:.2f} MiB); raise the budget"
        )
    return tokens


def sized_config(config: CacheConfig, pools: list[PoolPlan]) -> tuple[CacheConfig, int]:
    """``config`` with every pool's block count derived from ``config.memory_bytes``. Pools of
    one :class:`PoolKind` (e.g. every compressed entry-page pool) share one config count: they
    get the same, the largest any of them needs, and are budgeted as such. Returns the new
    config and C.

    Raises:
        ValueError: ``config.memory_bytes`` is unset or too small for the headroom.
    """
    if config.memory_bytes is None:
        raise ValueError("sized_config needs CacheConfig.memory_bytes")
    by_kind: dict[PoolKind, list[PoolPlan]] = {}
    for p in pools:
        by_kind.setdefault(p.kind, []).append(p)
    merged = [
        PoolPlan(
            name=kind.config_field,
            form=members[0].form,
            kind=kind,
            blocks=0,
            bytes_per_block=sum(p.bytes_per_block for p in members),
            tokens_per_block=min(p.tokens_per_block for p in members),
            headroom_blocks=max(p.headroom_blocks for p in members),
        )
        for kind, members in by_kind.items()
    ]
    tokens = capacity_tokens(merged, config.memory_bytes)
    counts = {
        m.kind.config_field: math.ceil(tokens / m.tokens_per_block) + m.headroom_blocks + 1  # + the sentinel
        for m in merged
    }
    fields: dict[str, object] = {**dataclasses.asdict(config), **counts}
    return CacheConfig(**fields), tokens  # type: ignore[arg-type]
