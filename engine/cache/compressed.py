"""The three cache forms of DeepSeek-V4 compressed layers (CSA / HCA), DESIGN.md §3.

A compressed layer's state after L tokens (:class:`~engine.model.state.CompressedLayerState`)
splits into objects with different lifetimes, each its own form:

* ``compressed_kv`` — the compressed entries of ``[0, b)``, ``b = ⌊L/r⌋·r``. An entry never
  changes once its group of r tokens is complete, so entries are stored once, in pages of
  ``E = P / r`` entries covering ``P = max(U, r)`` tokens (:class:`EntryPages`), shared by every
  longer prefix; a page is keyed by the prefix hash at its end and stamped with the boundary it
  ends at (its version; the hash root carries the model revision). Resuming at any multiple of
  U needs the pages covering ``[0, b)``: downward closed, scanned left to right.
* ``uncompressed_tail`` — the compressor's pending rows ``[b, L)`` and, for overlapping (CSA)
  compressors, the previous group's rows, which the next entry pools too. They depend on L, so
  they are stored per cached boundary (:class:`BoundarySlots`, at checkpoint positions), stamped
  with L and the hash of ``[0, b)`` — the version of the entries they continue.
* ``indexer_state`` — the CSA indexer's own compressed keys (entry pages, like
  ``compressed_kv``) and its own pending rows (boundary slots, like the tail), at the same
  boundary version as the layer's compressed KV.

The window rows of these layers are ``swa_window`` pages (:class:`~engine.cache.forms.PagedKVForm`).

Stamps: on the device a hash names its whole prefix, so a page or slot found under the right
hash always carries the right boundary; the stamps (``page_end``, ``slot_tokens``,
``slot_boundaries``) are checked anyway because objects restored from host or disk are matched by
stamp as well as by hash (``compressed_version_mismatch`` / ``tail_version_mismatch``).

Page size and ratio: a compression ratio r must divide U or be a multiple of it, so that
``b`` always falls on a page edge and the tail is at most ``r − U`` rows; other ratios are
refused (no least-common-multiple page, case C4).

Source of the state's math: DeepSeek-V4 paper §2.3 and transformers'
``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` / ``DeepseekV4Indexer``.

This module owns the three forms (:class:`CompressedKVForm`, :class:`UncompressedTailForm`,
:class:`IndexerStateForm`) and :func:`restore_states`; their building blocks live in their own
modules and are re-exported here: the compressor geometry in
:mod:`engine.cache.compressor_geometry`, the entry pages in :mod:`engine.cache.entry_pages`,
the boundary slots in :mod:`engine.cache.boundary_slots`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from engine.cache.block_pool import BlockPool
from engine.cache.boundary_slots import BoundarySlots
from engine.cache.compressor_geometry import (
    INDEXER,
    MAIN,
    CompressorGroup,
    boundary,
    compressor_groups,
    compressor_state,
    page_tokens,
    tail_rows,
)
from engine.cache.entry_pages import EntryPages
from engine.cache.forms import ObjectStore, StoredTensor
from engine.cache.hashing import BlockHash, PrefixIndex
from engine.cache.validation import intersect_groups
from engine.events import Form, Reason
from engine.model.state import CompressedLayerSpec, CompressedLayerState

__all__ = [
    "INDEXER",
    "MAIN",
    "BoundarySlots",
    "CompressedKVForm",
    "CompressorGroup",
    "EntryPages",
    "IndexerStateForm",
    "UncompressedTailForm",
    "boundary",
    "compressor_groups",
    "page_tokens",
    "restore_states",
    "tail_rows",
]


class CompressedKVForm:
    """``compressed_kv``: entry pages of every main compressor group. Resumes where every group
    does (group intersection: the minimum over groups, e.g. CSA ratio 4 and HCA ratio 128)."""

    form = Form.COMPRESSED_KV
    downward_closed = True  # entry pages of a prefix: the same loss reason at every point

    def __init__(self, specs: Mapping[int, CompressedLayerSpec], num_blocks: int, unit_tokens: int, index: PrefixIndex, device: torch.device) -> None:
        self.unit_tokens = unit_tokens
        self.groups = [
            EntryPages(f"compressed_kv[r{g.spec.ratio}]", g, num_blocks, unit_tokens, index, device)
            for g in compressor_groups(specs, MAIN)
        ]
        self.pools = tuple(g.pool for g in self.groups)

    @property
    def bytes_per_block(self) -> int:
        return sum(g.bytes_per_block for g in self.groups)

    def stored_tensors(self) -> list[StoredTensor]:
        return [t for g in self.groups for t in g.stored_tensors()]

    def needed_keys(self, hashes: Sequence[BlockHash], resume_tokens: int) -> list[tuple[BlockPool, BlockHash]]:
        return [k for g in self.groups for k in g.needed_keys(hashes, resume_tokens)]

    def stores(self) -> list[ObjectStore]:
        return [s for g in self.groups for s in g.stores()]

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        # layer 3 of validation: the point every compressor group can serve
        return intersect_groups({g.pool.name: g.resume_at_most(hashes, limit_tokens) for g in self.groups}).resume_tokens

    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int) -> Reason:
        """When a group never stored its page there: ``group_disagree`` if another group holds
        its own, else ``below_granularity`` (the point was never servable, whatever became of the
        other groups' pages) — also when no group holds all its pages and some group never
        stored a later one; otherwise the first group's reason."""
        reasons = [
            g.loss_reason(hashes, resume_tokens, Reason.COMPRESSED_EVICTED, Reason.COMPRESSED_VERSION_MISMATCH)
            for g in self.groups
        ]
        if Reason.BELOW_GRANULARITY in reasons:
            return Reason.GROUP_DISAGREE if Reason.NONE in reasons else Reason.BELOW_GRANULARITY
        if Reason.NONE not in reasons and any(g.never_stored(hashes, resume_tokens) for g in self.groups):
            return Reason.BELOW_GRANULARITY  # a later page never stored: the point never was servable
        for reason in reasons:
            if reason != Reason.NONE:
                return reason
        raise RuntimeError(f"compressed_kv: asked why it cannot resume at {resume_tokens}, where it can")

    def epoch_at(self, hashes: Sequence[BlockHash], resume_tokens: int) -> int:
        epochs = [0]
        for g in self.groups:
            n = g.pages_needed(resume_tokens)
            block = g.block_of(hashes, n - 1) if n else None
            if block is not None:
                epochs.append(g.pool.epoch[block])
        return max(epochs)


class UncompressedTailForm:
    """``uncompressed_tail``: per-boundary pending and previous-group rows of every main
    compressor, stored at checkpoint positions."""

    form = Form.UNCOMPRESSED_TAIL
    downward_closed = False  # one boundary slot per point

    def __init__(self, specs: Mapping[int, CompressedLayerSpec], num_slots: int, unit_tokens: int, index: PrefixIndex, device: torch.device) -> None:
        self.slots = BoundarySlots("uncompressed_tail", compressor_groups(specs, MAIN), num_slots, unit_tokens, index, device)
        self.pools = (self.slots.pool,)

    @property
    def bytes_per_block(self) -> int:
        return self.slots.bytes_per_block

    def stored_tensors(self) -> list[StoredTensor]:
        return self.slots.stored_tensors()

    def needed_keys(self, hashes: Sequence[BlockHash], resume_tokens: int) -> list[tuple[BlockPool, BlockHash]]:
        return self.slots.needed_keys(hashes, resume_tokens)

    def stores(self) -> list[ObjectStore]:
        return self.slots.stores()

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        return self.slots.resume_at_most(hashes, limit_tokens)

    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int) -> Reason:
        return self.slots.loss_reason(hashes, resume_tokens, Reason.TAIL_MISSING, Reason.TAIL_VERSION_MISMATCH)

    def epoch_at(self, hashes: Sequence[BlockHash], resume_tokens: int) -> int:
        return self.slots.epoch_at(hashes, resume_tokens)


class IndexerStateForm:
    """``indexer_state``: the CSA indexers' key pages and their per-boundary pending rows; both
    must hold at L (same boundary version as the layer's compressed KV)."""

    form = Form.INDEXER_STATE
    downward_closed = False  # key pages and the boundary slot of one point

    def __init__(self, specs: Mapping[int, CompressedLayerSpec], num_blocks: int, num_slots: int, unit_tokens: int, index: PrefixIndex, device: torch.device) -> None:
        groups = compressor_groups(specs, INDEXER)
        self.keys = [
            EntryPages(f"indexer_state[r{g.spec.ratio}]", g, num_blocks, unit_tokens, index, device) for g in groups
        ]
        self.slots = BoundarySlots("indexer_state[pending]", groups, num_slots, unit_tokens, index, device)
        self.pools = (*(k.pool for k in self.keys), self.slots.pool)

    @property
    def bytes_per_block(self) -> int:
        return sum(k.bytes_per_block for k in self.keys) + self.slots.bytes_per_block

    def stored_tensors(self) -> list[StoredTensor]:
        return [t for k in self.keys for t in k.stored_tensors()] + self.slots.stored_tensors()

    def needed_keys(self, hashes: Sequence[BlockHash], resume_tokens: int) -> list[tuple[BlockPool, BlockHash]]:
        """Key pages and pending rows together: the indexer state is one unit (case C9)."""
        return [k for g in self.keys for k in g.needed_keys(hashes, resume_tokens)] + self.slots.needed_keys(hashes, resume_tokens)

    def stores(self) -> list[ObjectStore]:
        return [s for k in self.keys for s in k.stores()] + self.slots.stores()

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        # key pages are downward closed, so a slot below their limit is valid for both
        keys = intersect_groups({k.pool.name: k.resume_at_most(hashes, limit_tokens) for k in self.keys}).resume_tokens
        return self.slots.resume_at_most(hashes, keys)

    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int) -> Reason:
        """``indexer_stale`` when keys or pending rows there were evicted or carry another
        version (the index would lag the compressed KV), else ``below_granularity`` — also when
        the point needs pending rows or key pages that were never stored there (whatever became
        of the rest, it was never a point the indexer could serve)."""
        slots = self.slots.loss_reason(hashes, resume_tokens, Reason.INDEXER_STALE, Reason.INDEXER_STALE)
        if slots == Reason.BELOW_GRANULARITY and not self.slots.usable_at(hashes, resume_tokens):
            return slots
        if any(k.never_stored(hashes, resume_tokens) for k in self.keys):
            return Reason.BELOW_GRANULARITY
        for k in self.keys:
            reason = k.loss_reason(hashes, resume_tokens, Reason.INDEXER_STALE, Reason.INDEXER_STALE)
            if reason != Reason.NONE:
                return reason
        return slots

    def epoch_at(self, hashes: Sequence[BlockHash], resume_tokens: int) -> int:
        return self.slots.epoch_at(hashes, resume_tokens)


def restore_states(
    specs: Mapping[int, CompressedLayerSpec],
    resume_tokens: int,
    entries: Iterable[tuple[str, Mapping[int, Tensor]]],
    device: torch.device,
) -> dict[int, CompressedLayerState]:
    """Working states at ``resume_tokens`` with their entries set (rows set separately by
    :meth:`BoundarySlots.read_into`)."""
    states = {layer: CompressedLayerState.empty(spec, device) for layer, spec in specs.items()}
    for which, per_layer in entries:
        for layer, rows in per_layer.items():
            compressor_state(states[layer], which).entries = rows
    for state in states.values():
        state.num_tokens = resume_tokens
    return states
