"""Per-boundary rows of compressor groups in fixed-geometry slots (DESIGN.md §3,
``uncompressed_tail`` and the indexer's pending rows of ``indexer_state``).

A compressor's pending rows ``[b, L)`` and, for overlapping (CSA) compressors, the previous
group's rows depend on L, so they are stored per cached boundary (one slot per boundary L, at
checkpoint positions), stamped with L and, per group, the hash of ``[0, b)`` — the version of
the entries they continue.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from engine.cache.block_pool import BlockPool, PoolExhausted
from engine.cache.compressor_geometry import (
    CompressorGroup,
    boundary,
    compressor_state,
    page_tokens,
    tail_rows,
)
from engine.cache.forms import VECTOR_BYTES, ObjectStore, Stamp, StoredTensor
from engine.cache.hashing import BlockHash, PrefixIndex
from engine.events import Reason
from engine.model.state import CompressedLayerState


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
        self.stale_since: OrderedDict[BlockHash, float] = OrderedDict()
        """Slots stored stamped behind their boundary (fault injection: ``lag_index``) → when the
        first was stored, :attr:`clock` seconds; dropped once the right rows replace them
        (bounded like :attr:`lost`). What the indexer's sync delay in seconds counts from."""
        self.clock: Callable[[], float] = time.monotonic
        """The clock of :attr:`stale_since` (monotonic seconds; injectable for tests)."""

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

    def stamp_at(self, hashes: Sequence[BlockHash], tokens: int) -> Stamp | None:
        """The stamp ``(L, *boundary hashes)`` of the slot stored under the hash of
        ``[0, tokens)`` — also of one a lower tier holds, or a stale one; None when absent."""
        return self._stamp_of(hashes[tokens // self.unit_tokens - 1]) if tokens else None

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
                c = compressor_state(states[layer], g.which)
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
                c = compressor_state(states[layer], g.which)
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
        if lag:
            self.stale_since.setdefault(h, self.clock())
            if len(self.stale_since) > self.pool.num_blocks:
                self.stale_since.popitem(last=False)
        else:
            self.stale_since.pop(h, None)
        self.pool.publish(slot, h)
        self.pool.release(slot)
        return True
