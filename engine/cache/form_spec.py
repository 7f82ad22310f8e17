"""One frozen spec per cache form: what it stores, where it can resume and how it recovers.

Like vLLM v1's ``KVCacheSpec`` per attention type, a :class:`FormSpec` is the form's static
description — computed from the model layout alone (:func:`layout_pools`), before any pool is
allocated — so the memory plan (:mod:`engine.cache.what_if`) can size pools without building a
cache first, and every policy that depends on what a block holds reads a :class:`PoolKind`
instead of a ``CacheConfig`` field name.

Block sizes, in bytes (``s`` = element size of the pool's dtype):

* KV page (``full_kv``, ``swa_window``): per KV geometry ``(H_kv, D)``,
  ``n_layers · 2 · U · H_kv · D · s`` (keys and values of U tokens), summed over geometries;
* entry page (``compressed_kv``, indexer keys): ``n_layers · E · D · s``, ``E = max(U, r) / r``;
* boundary slot (tail, indexer pending rows): per compressor group, pending rows
  ``2 · n_layers · max(r − U, 0) · F · s`` and previous-group rows ``2 · n_layers · r · D · s``
  (overlapping compressors only);
* checkpoint slot (``linear_state``): ``n_layers · (|conv| + |recurrent|) · 4`` (fp32).

The live forms (:mod:`engine.cache.forms`, :mod:`engine.cache.compressed`) allocate exactly
these; :class:`engine.cache.form_set.FormSet` checks every pool against its spec at start.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.cache.compressed import INDEXER, MAIN, CompressorGroup, compressor_groups, page_tokens
from engine.cache.config import CacheConfig
from engine.cache.validation import LayoutFingerprint
from engine.events import Form, Reason
from engine.model.base import ModelLayout


class PoolKind(enum.Enum):
    """What one block of a pool holds. The value is the ``CacheConfig`` field that sizes every
    pool of the kind (all entry-page pools share ``compressed_blocks``, both slot pools of the
    compressed forms share ``tail_slots``); the order is the order pools are listed in."""

    KV_PAGE = "full_kv_blocks"
    """U tokens of every full-attention layer; a running request's pages are what it caches."""
    WINDOW_PAGE = "swa_blocks"
    """U tokens of every windowed layer; a running request holds a window beyond what it caches."""
    ENTRY_PAGE = "compressed_blocks"
    """The compressed entries of ``max(U, r)`` tokens of one compressor geometry."""
    BOUNDARY_SLOT = "tail_slots"
    """The pending and previous-group rows of every compressor at one cached boundary."""
    CHECKPOINT_SLOT = "linear_checkpoints"
    """The conv and recurrent state of every linear layer at one checkpoint."""

    @property
    def config_field(self) -> str:
        """The ``CacheConfig`` field holding the block count of this kind's pools."""
        return self.value


class ResumeRule(enum.Enum):
    """Where a form can resume exactly at L (a multiple of U); see docs/cache-forms.md."""

    PREFIX = "every page of [0, L) is cached"
    WINDOW = "the pages covering [L - W + 1, L) are cached"
    ENTRY_PAGES = "the entry pages of [0, floor(L/r)*r) are cached for every geometry"
    BOUNDARY_ROWS = "no compressor keeps rows at L, or a slot stamped for L and [0, b) exists"
    INDEXER = "the indexer's key pages and its pending rows both hold at L"
    CHECKPOINT = "a checkpoint keyed by the hash of [0, L) exists, or L = 0"


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSpec:
    """One pool of a form.

    name: the pool's name (``BlockPool.name``, tier files, memory plan lines).
    bytes_per_block: bytes of one block of the pool (see the module docstring).
    page_tokens: prefix tokens one block covers; 0 for a per-boundary slot, which summarises a
        prefix instead of covering part of it.
    checkpointed: its blocks exist only where a checkpoint was stored (recurrent state, or rows
        some U boundary needs), so its form resumes only at checkpoint positions.
    """

    name: str
    form: Form
    kind: PoolKind
    bytes_per_block: int
    page_tokens: int
    checkpointed: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class FormSpec:
    """What one form stores, where it can resume and how it recovers.

    granularity_tokens: the coarsest spacing (tokens) between positions it can resume at.
    pools: its pools, in the order the form lists them.
    resume_rule: where it can resume exactly.
    missing_reason: the reason it reports when its device copy was missing and a lower tier
        supplied it (a swap-in, outcome ``recovered``).
    replayable: Tail-Replay can rebuild its state from a zero state by recomputing the last R
        tokens, instead of reading a stored object.
    fingerprints: (pool tensor name, layout fingerprint: dtype, block shape, axis order, kernel
        ABI version, model revision) of every tensor it stores.
    """

    form: Form
    granularity_tokens: int
    pools: tuple[PoolSpec, ...]
    resume_rule: ResumeRule
    missing_reason: Reason
    replayable: bool = False
    fingerprints: tuple[tuple[str, LayoutFingerprint], ...] = ()

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of each of its pools together."""
        return sum(p.bytes_per_block for p in self.pools)

    @property
    def checkpointed(self) -> bool:
        """Whether it resumes only at stored checkpoints (some pool is ``checkpointed``)."""
        return any(p.checkpointed for p in self.pools)


_RULES = {
    Form.FULL_KV: (ResumeRule.PREFIX, Reason.KV_EVICTED),
    Form.SWA_WINDOW: (ResumeRule.WINDOW, Reason.SWA_EVICTED),
    Form.COMPRESSED_KV: (ResumeRule.ENTRY_PAGES, Reason.COMPRESSED_EVICTED),
    Form.UNCOMPRESSED_TAIL: (ResumeRule.BOUNDARY_ROWS, Reason.TAIL_MISSING),
    Form.INDEXER_STATE: (ResumeRule.INDEXER, Reason.INDEXER_STALE),
    Form.LINEAR_STATE: (ResumeRule.CHECKPOINT, Reason.LINEAR_CHECKPOINT_MISSING),
}
"""Per form: its resume rule and the reason a missing device copy reports."""


def _kv_pool(form: Form, kind: PoolKind, layout: ModelLayout, layers: Sequence[int], unit_tokens: int, dtype: torch.dtype) -> PoolSpec:
    shapes = [layout.kv_shape(layer) for layer in layers]
    nbytes = sum(shapes.count(shape) * 2 * unit_tokens * math.prod(shape) * dtype.itemsize for shape in dict.fromkeys(shapes))
    return PoolSpec(name=form.value, form=form, kind=kind, bytes_per_block=nbytes, page_tokens=unit_tokens)


def _entry_pools(form: Form, groups: Sequence[CompressorGroup], unit_tokens: int) -> list[PoolSpec]:
    out = []
    for g in groups:
        tokens = page_tokens(unit_tokens, g.spec.ratio)
        nbytes = len(g.layers) * (tokens // g.spec.ratio) * g.spec.head_dim * g.dtype.itemsize
        out.append(PoolSpec(name=f"{form}[r{g.spec.ratio}]", form=form, kind=PoolKind.ENTRY_PAGE, bytes_per_block=nbytes, page_tokens=tokens))
    return out


def _slot_pool(name: str, form: Form, groups: Sequence[CompressorGroup], unit_tokens: int) -> PoolSpec:
    nbytes = 0
    for g in groups:
        page_tokens(unit_tokens, g.spec.ratio)  # refuse ratios that do not tile U
        n, r = len(g.layers), g.spec.ratio
        prev = r if g.spec.overlapping else 0
        nbytes += 2 * n * (max(r - unit_tokens, 0) * g.spec.row_width + prev * g.spec.head_dim) * g.dtype.itemsize
    keeps_rows = any(g.spec.overlapping or g.spec.ratio > unit_tokens for g in groups)
    return PoolSpec(name=name, form=form, kind=PoolKind.BOUNDARY_SLOT, bytes_per_block=nbytes, page_tokens=0, checkpointed=keeps_rows)


def layout_pools(layout: ModelLayout, unit_tokens: int, dtype: torch.dtype) -> dict[Form, tuple[PoolSpec, ...]]:
    """Every form the layout needs, in :class:`Form` order, with its pools (KV pages in
    ``dtype``; compressed state in each layer's own dtype; recurrent state in fp32).

    Raises:
        ValueError: a compression ratio neither divides U nor is a multiple of it.
    """
    out: dict[Form, tuple[PoolSpec, ...]] = {}
    for form, kind, layers in (
        (Form.FULL_KV, PoolKind.KV_PAGE, layout.layers_of("full_attention")),
        (Form.SWA_WINDOW, PoolKind.WINDOW_PAGE, layout.window_layers),
    ):
        if layers:
            out[form] = (_kv_pool(form, kind, layout, layers, unit_tokens, dtype),)
    specs = layout.compressed_state_specs
    if specs:
        main = compressor_groups(specs, MAIN)
        out[Form.COMPRESSED_KV] = tuple(_entry_pools(Form.COMPRESSED_KV, main, unit_tokens))
        out[Form.UNCOMPRESSED_TAIL] = (_slot_pool("uncompressed_tail", Form.UNCOMPRESSED_TAIL, main, unit_tokens),)
        if any(spec.indexer is not None for spec in specs.values()):
            keys = compressor_groups(specs, INDEXER)
            pending = _slot_pool("indexer_state[pending]", Form.INDEXER_STATE, keys, unit_tokens)
            out[Form.INDEXER_STATE] = (*_entry_pools(Form.INDEXER_STATE, keys, unit_tokens), pending)
    linear = layout.layers_of("linear_attention")
    if linear:
        conv, recurrent = layout.linear_state_shapes[linear[0]]
        nbytes = len(linear) * (math.prod(conv) + math.prod(recurrent)) * 4
        out[Form.LINEAR_STATE] = (
            PoolSpec(name=Form.LINEAR_STATE.value, form=Form.LINEAR_STATE, kind=PoolKind.CHECKPOINT_SLOT, bytes_per_block=nbytes, page_tokens=0, checkpointed=True),
        )
    return out


def pools_in_order(pools: Mapping[Form, Sequence[PoolSpec]]) -> list[PoolSpec]:
    """Every pool once, grouped by :class:`PoolKind` (KV pages, window pages, entry pages of
    ``compressed_kv`` then of the indexer, slots of the tail then of the indexer, checkpoints)."""
    kinds = list(PoolKind)
    return sorted((p for ps in pools.values() for p in ps), key=lambda p: kinds.index(p.kind))


def needs_checkpoints(pools: Mapping[Form, Sequence[PoolSpec]]) -> bool:
    """Whether some form resumes only at stored checkpoints: resume points are then the
    checkpoint positions, not every U boundary."""
    return any(p.checkpointed for ps in pools.values() for p in ps)


def form_specs(
    pools: Mapping[Form, Sequence[PoolSpec]],
    config: CacheConfig,
    fingerprints: Mapping[Form, Sequence[tuple[str, LayoutFingerprint]]] | None = None,
) -> dict[Form, FormSpec]:
    """One spec per form of ``pools``, in its order. Granularity: U, except the checkpoint
    interval for a form that resumes only at checkpoints and, when some form does, for the
    window (its pages are kept behind checkpoints only)."""
    checkpoints = needs_checkpoints(pools)
    out = {}
    for form, members in pools.items():
        coarse = any(p.checkpointed for p in members) or (form is Form.SWA_WINDOW and checkpoints)
        rule, missing = _RULES[form]
        out[form] = FormSpec(
            form=form,
            granularity_tokens=config.checkpoint_interval_tokens if coarse else config.unit_tokens,
            pools=tuple(members),
            resume_rule=rule,
            missing_reason=missing,
            replayable=form is Form.LINEAR_STATE,
            fingerprints=tuple((fingerprints or {}).get(form, ())),
        )
    return out
