"""Pages of compressed entries of one compressor group (DESIGN.md §3, ``compressed_kv`` and
the indexer's keys of ``indexer_state``).

An entry never changes once its group of r tokens is complete, so entries are stored once, in
pages of ``E = P / r`` entries covering ``P = max(U, r)`` tokens, shared by every longer prefix;
a page is keyed by the prefix hash at its end and stamped with the boundary it ends at. Resuming
at any multiple of U needs the pages covering ``[0, b)``: downward closed, scanned left to right.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from engine.cache.block_pool import BlockPool, PoolExhausted
from engine.cache.compressor_geometry import (
    CompressorGroup,
    boundary,
    compressor_state,
    page_tokens,
)
from engine.cache.forms import VECTOR_BYTES, ObjectStore, PrefixScan, Stamp, StoredTensor
from engine.cache.hashing import BlockHash, PrefixIndex
from engine.events import Reason
from engine.model.state import CompressedLayerState


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
        """The first page a resume at ``resume_tokens`` lacks in the pool's view (in tier view, a
        page a lower tier holds with the right stamp is not lacking); None when none is."""
        pt = self.page_tokens
        return next((p for p in range(self.pages_needed(resume_tokens)) if self._end_of(self.page_hash(hashes, p)) != (p + 1) * pt), None)

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

    def never_stored(self, hashes: Sequence[BlockHash], resume_tokens: int) -> bool:
        """Whether some page a resume at ``resume_tokens`` reads was never stored: absent, not
        evicted and not left unstored for lack of room (a resume there was never servable)."""
        for page in range(self.pages_needed(resume_tokens)):
            h = self.page_hash(hashes, page)
            if self._end_of(h) is None and not self.pool.was_evicted(h) and h not in self._not_stored:
                return True
        return False

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
        counts = {compressor_state(states[layer], self.group.which).num_entries for layer in self.group.layers}
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
            except PoolExhausted:  # memory pressure: this page and every later one, remembered like evictions
                for later in range(page, complete):
                    self._not_stored[self.page_hash(hashes, later)] = None
                while len(self._not_stored) > self.pool.num_blocks:
                    self._not_stored.popitem(last=False)
                return
            self._not_stored.pop(h, None)
            for i, layer in enumerate(self.group.layers):
                rows = compressor_state(states[layer], self.group.which).entries[page * e : (page + 1) * e]
                self.entries[block, i].copy_(rows)
            self.page_end[block] = (page + 1) * self.page_tokens
            self.pool.publish(block, h)
            table.append(block)
