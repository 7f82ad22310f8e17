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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.cache.block_pool import BlockPool, PoolExhausted
from engine.cache.forms import VECTOR_BYTES, ObjectStore, PrefixScan, Stamp, StoredTensor
from engine.cache.hashing import BlockHash, PrefixIndex
from engine.cache.validation import intersect_groups
from engine.events import Form, Reason
from engine.model.state import (
    CompressedLayerSpec,
    CompressedLayerState,
    CompressorSpec,
    CompressorState,
)

# which compressor of a layer a group holds
MAIN = "compressor"
INDEXER = "indexer"


def page_tokens(unit_tokens: int, ratio: int) -> int:
    """Tokens one entry page covers: ``max(U, r)``.

    Raises:
        ValueError: r neither divides U nor is a multiple of it.
    """
    if unit_tokens % ratio and ratio % unit_tokens:
        raise ValueError(
            f"compression ratio {ratio} neither divides the prefix-match unit U = {unit_tokens} nor is a "
            f"multiple of it; choose CacheConfig.unit_tokens accordingly (e.g. {ratio} or a divisor of it)"
        )
    return max(unit_tokens, ratio)


def boundary(tokens: int, ratio: int) -> int:
    """``b = ⌊L/r⌋·r``: the prefix the complete compressed entries cover."""
    return tokens - tokens % ratio


def tail_rows(spec: CompressorSpec, tokens: int) -> tuple[int, int]:
    """(pending rows, previous-group rows) a compressor keeps after ``tokens`` tokens."""
    b = boundary(tokens, spec.ratio)
    prev = spec.ratio if spec.overlapping and b >= spec.ratio else 0
    return tokens - b, prev


@dataclass(frozen=True, slots=True)
class CompressorGroup:
    """Layers whose compressor (main or indexer) shares one geometry and element type."""

    which: str
    spec: CompressorSpec
    dtype: torch.dtype
    layers: tuple[int, ...]


def compressor_groups(specs: Mapping[int, CompressedLayerSpec], which: str) -> list[CompressorGroup]:
    """Group the layers of ``specs`` by the geometry of their main (``MAIN``) or indexer
    (``INDEXER``) compressor, in layer order."""
    members: dict[tuple[CompressorSpec, torch.dtype], list[int]] = {}
    for layer in sorted(specs):
        spec = specs[layer].compressor if which == MAIN else specs[layer].indexer
        if spec is not None:
            members.setdefault((spec, specs[layer].dtype), []).append(layer)
    return [CompressorGroup(which, spec, dtype, tuple(layers)) for (spec, dtype), layers in members.items()]


def _compressor(state: CompressedLayerState, which: str) -> CompressorState:
    cstate = state.compressor if which == MAIN else state.indexer
    if cstate is None:
        raise RuntimeError(f"a compressed layer state without its {which} state")
    return cstate


class EntryPages:
    """Pages of compressed entries of one :class:`CompressorGroup`:
    ``entries [num_blocks, n_layers, E, D]``, page p holding entries ``[p·E, (p+1)·E)`` of every
    layer of the group, keyed by the hash of the prefix ``[0, (p+1)·P)`` and stamped with that
    boundary (``page_end[block]``, tokens).
    """

    def __init__(
        self,
        name: str,
        group: CompressorGroup,
        num_blocks: int,
        unit_tokens: int,
        index: PrefixIndex,
        device: torch.device,
    ) -> None:
        self.group = group
        self.unit_tokens = unit_tokens
        self.ratio = group.spec.ratio
        self.page_tokens = page_tokens(unit_tokens, self.ratio)
        self.entries_per_page = self.page_tokens // self.ratio
        self.pool = BlockPool(name, num_blocks, index.add, index.remove)
        self.entries = torch.zeros(
            (num_blocks, len(group.layers), self.entries_per_page, group.spec.head_dim), dtype=group.dtype, device=device
        )
        self.page_end = [0] * num_blocks
        self.scan = PrefixScan(self.pool)
        self._not_stored: OrderedDict[BlockHash, None] = OrderedDict()
        """Pages recently left unstored because every block was leased."""

    @property
    def bytes_per_block(self) -> int:
        return self.entries[0].numel() * self.entries.element_size()

    def stored_tensors(self) -> list[StoredTensor]:
        return [StoredTensor(self.pool.name, self.entries, ("layer", "entry", "dim"), VECTOR_BYTES)]

    def pages_needed(self, tokens: int) -> int:
        """Pages holding the entries of ``[0, b)`` for a resume at ``tokens``."""
        return boundary(tokens, self.ratio) // self.page_tokens

    def page_hash(self, hashes: Sequence[BlockHash], page: int) -> BlockHash:
        return hashes[(page + 1) * self.page_tokens // self.unit_tokens - 1]

    def block_of(self, hashes: Sequence[BlockHash], page: int) -> int | None:
        """The block holding page ``page`` of this prefix, if cached with the right version."""
        block = self.pool.lookup(self.page_hash(hashes, page))
        if block is None or self.page_end[block] != (page + 1) * self.page_tokens:
            return None
        return block

    def present_pages(self, hashes: Sequence[BlockHash], needed: int) -> int:
        """How many of the first ``needed`` pages of this prefix are cached, counted from page 0
        up to the first gap. Memoised per hash chain and pool version, as the coordinator's fixed
        point asks several times per lookup."""
        step, pt = self.page_tokens // self.unit_tokens, self.page_tokens

        def scan(needed: int) -> int:
            ends = list(map(self._end_of, hashes[step - 1 : needed * step : step]))
            if ends == list(range(pt, (len(ends) + 1) * pt, pt)):
                return len(ends)
            return next(i for i, end in enumerate(ends) if end != (i + 1) * pt)  # a gap or another version

        return self.scan.present(hashes, needed, scan)

    def _end_of(self, h: BlockHash) -> int | None:
        """The boundary stamp of the page cached under ``h`` (in tier view, also of a page a
        lower tier holds); None when absent."""
        block = self.pool.cached_blocks.get(h)
        if block is not None:
            return self.page_end[block]
        entry = self.pool.lower_entry(h)
        return None if entry is None else int(entry.stamp[0])  # type: ignore[attr-defined]

    def needed_keys(self, hashes: Sequence[BlockHash], resume_tokens: int) -> list[tuple[BlockPool, BlockHash]]:
        return [(self.pool, self.page_hash(hashes, p)) for p in range(self.pages_needed(resume_tokens))]

    def stores(self) -> list[ObjectStore]:
        return [ObjectStore(self.pool, self.stored_tensors(), self._stamp, self._set_stamp)]

    def _stamp(self, block: int) -> Stamp:
        return (self.page_end[block],)

    def _set_stamp(self, block: int, stamp: Stamp) -> None:
        (end,) = stamp
        if not isinstance(end, int):
            raise RuntimeError(f"{self.pool.name}: page stamp {stamp!r} is not a token count")
        self.page_end[block] = end

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        """Largest multiple of U ≤ ``limit_tokens`` whose entry pages are all cached."""
        u = self.unit_tokens
        limit = limit_tokens - limit_tokens % u
        present = self.present_pages(hashes, self.pages_needed(limit))
        # with ``present`` pages, any L with ⌊L/r⌋·r ≤ present·P resumes: L < present·P + P
        return min(limit, present * self.page_tokens + self.page_tokens - u)

    def first_missing(self, hashes: Sequence[BlockHash], resume_tokens: int) -> int | None:
        return next((p for p in range(self.pages_needed(resume_tokens)) if self.block_of(hashes, p) is None), None)

    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int, evicted: Reason, stale: Reason) -> Reason:
        """``evicted`` when the first missing page was evicted or could not be stored for lack
        of room (memory pressure either way), ``stale`` when a page under that hash holds
        another boundary version, else ``below_granularity`` (never stored)."""
        page = self.first_missing(hashes, resume_tokens)
        if page is None:
            return Reason.NONE
        h = self.page_hash(hashes, page)
        if self._end_of(h) is not None:
            return stale
        return evicted if self.pool.was_evicted(h) or h in self._not_stored else Reason.BELOW_GRANULARITY

    def lease_pages(self, hashes: Sequence[BlockHash], resume_tokens: int) -> list[int]:
        """Lease every page a resume at ``resume_tokens`` reads; returns their blocks in order.

        Raises:
            RuntimeError: a page the plan relies on is gone (an internal invariant).
        """
        blocks: list[int] = []
        try:
            for page in range(self.pages_needed(resume_tokens)):
                block = self.block_of(hashes, page)
                if block is None:
                    raise RuntimeError(f"{self.pool.name}: page {page} of the plan vanished before its lease")
                self.pool.lease(block)
                blocks.append(block)
        except BaseException:
            for block in blocks:
                self.pool.release(block)
            raise
        return blocks

    def read(self, blocks: list[int]) -> dict[int, Tensor]:
        """Entries ``[len(blocks)·E, D]`` per layer, gathered from leased pages."""
        if not blocks:
            return {layer: self.entries.new_zeros((0, self.group.spec.head_dim)) for layer in self.group.layers}
        rows = self.entries[torch.tensor(blocks, dtype=torch.long, device=self.entries.device)]  # [B, n, E, D]
        return {layer: rows[:, i].reshape(-1, rows.shape[-1]).clone() for i, layer in enumerate(self.group.layers)}

    def store(
        self, hashes: Sequence[BlockHash], states: Mapping[int, CompressedLayerState], table: list[int], *, withhold: int = 0
    ) -> None:
        """Store every complete page of ``states`` past ``table`` (the request's leased pages of
        this prefix, in page order) and append it there, leased: a page already cached under its
        hash is leased as it is, a new one is allocated, written and published. Stops early when
        every block is leased (the request then simply caches less; a later commit retries).

        The request keeps its pages leased until it finishes, then releases them tail first (as
        full-KV pages), so a prefix's first pages — which every later page needs — outlive its
        last ones.
        """
        counts = {_compressor(states[layer], self.group.which).num_entries for layer in self.group.layers}
        if len(counts) != 1:
            raise RuntimeError(f"{self.pool.name}: layers of one group hold different entry counts {sorted(counts)}")
        complete = counts.pop() // self.entries_per_page - withhold  # withhold: fault injection
        e = self.entries_per_page
        for page in range(len(table), complete):
            h = self.page_hash(hashes, page)
            block = self.pool.lookup(h)
            if block is not None:
                self.pool.lease(block)
                table.append(block)
                continue
            try:
                block = self.pool.allocate()
            except PoolExhausted:  # memory pressure: remembered like an eviction
                self._not_stored[h] = None
                if len(self._not_stored) > self.pool.num_blocks:
                    self._not_stored.popitem(last=False)
                return
            self._not_stored.pop(h, None)
            for i, layer in enumerate(self.group.layers):
                rows = _compressor(states[layer], self.group.which).entries[page * e : (page + 1) * e]
                self.entries[block, i].copy_(rows)
            self.page_end[block] = (page + 1) * self.page_tokens
            self.pool.publish(block, h)
            table.append(block)


class BoundarySlots:
    """Per-boundary rows of several :class:`CompressorGroup` s — the pending rows ``[b, L)`` and
    the previous group's rows — in fixed-geometry slots, one slot per cached boundary L, keyed by
    the hash of ``[0, L)`` and stamped with L and, per group, the hash of ``[0, b)``.

    Per group: ``pending_kv / pending_gate [num_slots, n_layers, max(r − U, 0), F]`` and
    ``prev_kv / prev_gate [num_slots, n_layers, r or 0, D]`` (only the first rows the stamp
    implies are meaningful).
    """

    def __init__(
        self,
        name: str,
        groups: Sequence[CompressorGroup],
        num_slots: int,
        unit_tokens: int,
        index: PrefixIndex,
        device: torch.device,
    ) -> None:
        self.groups = tuple(groups)
        self.unit_tokens = unit_tokens
        self.pool = BlockPool(name, num_slots, index.add, index.remove)
        self.tensors: list[dict[str, Tensor]] = []
        for g in self.groups:
            page_tokens(unit_tokens, g.spec.ratio)  # refuse ratios that do not tile U
            n, f, d, r = len(g.layers), g.spec.row_width, g.spec.head_dim, g.spec.ratio
            p = max(r - unit_tokens, 0)
            prev = r if g.spec.overlapping else 0
            self.tensors.append(
                {
                    "pending_kv": torch.zeros((num_slots, n, p, f), dtype=g.dtype, device=device),
                    "pending_gate": torch.zeros((num_slots, n, p, f), dtype=g.dtype, device=device),
                    "prev_kv": torch.zeros((num_slots, n, prev, d), dtype=g.dtype, device=device),
                    "prev_gate": torch.zeros((num_slots, n, prev, d), dtype=g.dtype, device=device),
                }
            )
        self.slot_tokens = [0] * num_slots
        self.slot_boundaries: list[tuple[BlockHash | None, ...]] = [()] * num_slots
        self.lost: OrderedDict[BlockHash, None] = OrderedDict()
        """Slots recently lost before they were stored (fault injection: ``drop_tail``)."""

    @property
    def bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for tensors in self.tensors for t in tensors.values())

    def remember_lost(self, h: BlockHash) -> None:
        """Note a slot lost before it was stored (bounded like the pool's eviction memory)."""
        self.lost[h] = None
        if len(self.lost) > self.pool.num_blocks:
            self.lost.popitem(last=False)

    def stored_tensors(self) -> list[StoredTensor]:
        out = []
        for g, tensors in zip(self.groups, self.tensors, strict=True):
            for name, t in tensors.items():
                if t.numel():  # a ratio with no such rows stores nothing
                    out.append(StoredTensor(f"{self.pool.name}[r{g.spec.ratio}].{name}", t, ("layer", "row", "dim"), VECTOR_BYTES))
        return out

    @property
    def keeps_rows(self) -> bool:
        """Whether some U boundary needs a slot: a compressor with r > U has pending rows at
        boundaries inside a group, an overlapping one keeps the previous group's rows."""
        return any(g.spec.overlapping or g.spec.ratio > self.unit_tokens for g in self.groups)

    def needed_at(self, tokens: int) -> bool:
        """Whether a resume at ``tokens`` needs a slot (some group keeps rows there)."""
        return any(sum(tail_rows(g.spec, tokens)) for g in self.groups)

    def version(self, hashes: Sequence[BlockHash], tokens: int) -> tuple[BlockHash | None, ...]:
        """Per group, the hash of ``[0, b)`` (None for b = 0): what the rows continue."""
        u = self.unit_tokens
        out: list[BlockHash | None] = []
        for g in self.groups:
            b = boundary(tokens, g.spec.ratio)
            out.append(hashes[b // u - 1] if b else None)
        return tuple(out)

    def slot_at(self, hashes: Sequence[BlockHash], tokens: int) -> int | None:
        """The slot stored at ``tokens`` with the right stamp (None when absent or stale)."""
        if tokens == 0:
            return None
        slot = self.pool.lookup(hashes[tokens // self.unit_tokens - 1])
        if slot is None or self.slot_tokens[slot] != tokens or self.slot_boundaries[slot] != self.version(hashes, tokens):
            return None
        return slot

    def _stamp_of(self, h: BlockHash) -> Stamp | None:
        """The stamp of the slot cached under ``h`` (in tier view, also of one a lower tier
        holds); None when absent."""
        slot = self.pool.cached_blocks.get(h)
        if slot is not None:
            return self._stamp(slot)
        entry = self.pool.lower_entry(h)
        return None if entry is None else tuple(entry.stamp)  # type: ignore[attr-defined]

    def _stamp(self, slot: int) -> Stamp:
        return (self.slot_tokens[slot], *self.slot_boundaries[slot])

    def _set_stamp(self, slot: int, stamp: Stamp) -> None:
        tokens, *boundaries = stamp
        if not isinstance(tokens, int) or len(boundaries) != len(self.groups):
            raise RuntimeError(f"{self.pool.name}: slot stamp {stamp!r} does not fit {len(self.groups)} groups")
        self.slot_tokens[slot] = tokens
        self.slot_boundaries[slot] = tuple(b if isinstance(b, bytes) else None for b in boundaries)

    def stores(self) -> list[ObjectStore]:
        return [ObjectStore(self.pool, self.stored_tensors(), self._stamp, self._set_stamp)]

    def needed_keys(self, hashes: Sequence[BlockHash], tokens: int) -> list[tuple[BlockPool, BlockHash]]:
        return [(self.pool, hashes[tokens // self.unit_tokens - 1])] if tokens and self.needed_at(tokens) else []

    def usable_at(self, hashes: Sequence[BlockHash], tokens: int) -> bool:
        if not self.needed_at(tokens):
            return True
        return self._stamp_of(hashes[tokens // self.unit_tokens - 1]) == (tokens, *self.version(hashes, tokens))

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        """Largest multiple of U ≤ ``limit_tokens`` needing no slot or having a valid one."""
        u = self.unit_tokens
        for cand in range(limit_tokens - limit_tokens % u, 0, -u):
            if self.usable_at(hashes, cand):
                return cand
        return 0

    def loss_reason(self, hashes: Sequence[BlockHash], tokens: int, missing: Reason, stale: Reason) -> Reason:
        """``stale`` when a slot under the hash carries another version, ``missing`` when it was
        evicted, ``below_granularity`` when none was stored there."""
        h = hashes[tokens // self.unit_tokens - 1]
        if self._stamp_of(h) is not None:
            return stale
        return missing if self.pool.was_evicted(h) or h in self.lost else Reason.BELOW_GRANULARITY

    def epoch_at(self, hashes: Sequence[BlockHash], tokens: int) -> int:
        slot = self.slot_at(hashes, tokens)
        return self.pool.epoch[slot] if slot is not None else 0

    def read_into(self, slot: int | None, tokens: int, states: Mapping[int, CompressedLayerState]) -> None:
        """Set the pending and previous-group rows of ``states`` for a resume at ``tokens``
        from ``slot`` (None: no group keeps rows there)."""
        for g, tensors in zip(self.groups, self.tensors, strict=True):
            pending, prev = tail_rows(g.spec, tokens)
            if (pending or prev) and slot is None:
                raise RuntimeError(f"{self.pool.name}: {tokens} tokens need stored rows and no slot was leased")
            for i, layer in enumerate(g.layers):
                c = _compressor(states[layer], g.which)
                at = slot if slot is not None else 0  # slot 0 is the sentinel: zero-length reads
                c.pending_kv = tensors["pending_kv"][at, i, :pending].clone()
                c.pending_gate = tensors["pending_gate"][at, i, :pending].clone()
                c.prev_kv = tensors["prev_kv"][at, i, :prev].clone()
                c.prev_gate = tensors["prev_gate"][at, i, :prev].clone()

    def store(
        self, hashes: Sequence[BlockHash], tokens: int, states: Mapping[int, CompressedLayerState], *, lag: bool = False
    ) -> bool:
        """Store the rows of ``states`` (all at ``tokens``) under the hash of ``[0, tokens)``
        (``lag``: fault injection, stamp them one boundary behind).

        Returns whether the slot is cached afterwards (stored now or before, or not needed);
        False when every slot is leased.
        """
        if not self.needed_at(tokens):
            return True
        h = hashes[tokens // self.unit_tokens - 1]
        cached = self.pool.lookup(h)
        if cached is not None:
            if self.slot_at(hashes, tokens) is not None:
                return True
            if self.pool.ref_count[cached]:
                return False  # a stale slot someone still reads: cannot replace it now
            self.pool.invalidate(cached)  # a stale slot: replace it with the right rows
        try:
            slot = self.pool.allocate()
        except PoolExhausted:
            return False
        for g, tensors in zip(self.groups, self.tensors, strict=True):
            pending, prev = tail_rows(g.spec, tokens)
            for i, layer in enumerate(g.layers):
                c = _compressor(states[layer], g.which)
                if states[layer].num_tokens != tokens or c.pending_kv.shape[0] != pending or c.prev_kv.shape[0] != prev:
                    raise RuntimeError(
                        f"{self.pool.name}: layer {layer} holds {states[layer].num_tokens} tokens "
                        f"({c.pending_kv.shape[0]} pending, {c.prev_kv.shape[0]} previous rows), stored at {tokens}"
                    )
                tensors["pending_kv"][slot, i, :pending] = c.pending_kv
                tensors["pending_gate"][slot, i, :pending] = c.pending_gate
                tensors["prev_kv"][slot, i, :prev] = c.prev_kv
                tensors["prev_gate"][slot, i, :prev] = c.prev_gate
        self.slot_tokens[slot] = tokens - self.unit_tokens if lag else tokens
        self.slot_boundaries[slot] = self.version(hashes, tokens)
        self.pool.publish(slot, h)
        self.pool.release(slot)
        return True


class CompressedKVForm:
    """``compressed_kv``: entry pages of every main compressor group. Resumes where every group
    does (group intersection: the minimum over groups, e.g. CSA ratio 4 and HCA ratio 128)."""

    form = Form.COMPRESSED_KV

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
        """The first group's reason; ``group_disagree`` when a group simply lacks a page (never
        evicted) that another group holds at that point."""
        reasons = [
            g.loss_reason(hashes, resume_tokens, Reason.COMPRESSED_EVICTED, Reason.COMPRESSED_VERSION_MISMATCH)
            for g in self.groups
        ]
        for reason in reasons:
            if reason == Reason.BELOW_GRANULARITY and Reason.NONE in reasons:
                return Reason.GROUP_DISAGREE
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
        version (the index would lag the compressed KV), else ``below_granularity``."""
        for k in self.keys:
            reason = k.loss_reason(hashes, resume_tokens, Reason.INDEXER_STALE, Reason.INDEXER_STALE)
            if reason != Reason.NONE:
                return reason
        return self.slots.loss_reason(hashes, resume_tokens, Reason.INDEXER_STALE, Reason.INDEXER_STALE)

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
            _compressor(states[layer], which).entries = rows
    for state in states.values():
        state.num_tokens = resume_tokens
    return states
