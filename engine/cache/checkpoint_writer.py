"""The checkpoint writer: what a request stores besides its KV pages, and the compressed
working state a resume restores from it.

* :meth:`CheckpointWriter.save_checkpoint` — at a checkpoint position, copies of the recurrent
  state (``linear_state``) and of the compressors' pending and previous-group rows
  (``uncompressed_tail``, ``indexer_state``), keyed by the hash of ``[0, L)``;
* :meth:`CheckpointWriter.store_entries` — at every commit, the complete entry pages of every
  compressed and indexer geometry;
* :meth:`CheckpointWriter.restore_compressed` — at the start of a request, the dense working
  state of every CSA/HCA layer at L*, gathered from those pages and slots.

Faults (``engine/faults.py``) that act on stores are applied here: ``drop_tail``,
``lag_index`` and ``groups_disagree``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.cache.block_pool import BlockPool, PoolExhausted
from engine.cache.compressed import restore_states
from engine.cache.config import CacheConfig
from engine.cache.form_set import FormSet
from engine.cache.hashing import BlockHash
from engine.faults import NO_FAULTS, Faults
from engine.model.state import CompressedLayerState, LinearLayerState

log = logging.getLogger(__name__)


class CheckpointWriter:
    """Stores checkpoints and entry pages into the pools of ``form_set``, and restores from them."""

    def __init__(self, form_set: FormSet, config: CacheConfig) -> None:
        self.form_set = form_set
        self.config = config
        self.faults: Faults = NO_FAULTS
        """Injected faults (engine/faults.py); none unless a test or config enables them."""

    def save_checkpoint(
        self,
        hashes: Sequence[BlockHash],
        tokens: int,
        linear_states: dict[int, LinearLayerState],
        compressed_states: dict[int, CompressedLayerState],
    ) -> bool:
        """Store what a resume at ``tokens`` (a multiple of U) needs besides pages: copies of
        the recurrent state and of the compressors' pending and previous-group rows, keyed by
        the hash of ``[0, tokens)``. No recurrent checkpoint in Tail-Replay-only mode.

        Returns whether every such form holds that prefix afterwards (stored now or before);
        False when the model has none or a pool has every slot leased (logged as a warning).
        """
        fs = self.form_set
        stored = fs.has_checkpoint_forms
        h = hashes[tokens // fs.unit_tokens - 1]
        linear = fs.linear
        if linear is not None and self.config.tail_replay != "only" and linear.pool.lookup(h) is None:
            try:
                slot = linear.pool.allocate()
            except PoolExhausted:
                log.warning("linear_state: every slot is leased; checkpoint skipped")
                stored = False
            else:
                linear.write(slot, linear_states)
                linear.pool.publish(slot, h)
                linear.pool.release(slot)
        for form in (fs.tail, fs.indexer):
            if form is None:
                continue
            if form is fs.tail and self.faults.drop_tail:
                form.slots.remember_lost(hashes[tokens // fs.unit_tokens - 1])
                stored = False
                continue
            lag = form is fs.indexer and self.faults.lag_index
            if not form.slots.store(hashes, tokens, compressed_states, lag=lag):
                log.warning("%s: every slot is leased; rows at %d not stored", form.form, tokens)
                stored = False
        return stored

    def store_entries(self, hashes: Sequence[BlockHash], states: dict[int, CompressedLayerState], tables: list[list[int]]) -> None:
        """Store the complete entry pages of every compressed and indexer group past the
        request's leased pages ``tables[i]`` of group i (see :meth:`EntryPages.store`)."""
        compressed = self.form_set.compressed
        if states:
            disagree = self.faults.groups_disagree and compressed is not None and len(compressed.groups) > 1
            for g, table in zip(self.form_set.entry_groups(), tables, strict=True):
                g.store(hashes, states, table, withhold=1 if disagree and g is compressed.groups[-1] else 0)  # type: ignore[union-attr]

    def restore_compressed(self, hashes: Sequence[BlockHash], resume: int, tables: list[list[int]]) -> dict[int, CompressedLayerState]:
        """The working state of every CSA/HCA layer at ``resume``: entries from the
        ``compressed_kv`` and indexer key pages (which stay leased in the request's ``tables``
        until it finishes), rows from the tail and indexer slots (leased while copied).

        Raises:
            RuntimeError: an object the plan relies on is gone (an internal invariant).
        """
        fs = self.form_set
        assert fs.compressed is not None and fs.tail is not None
        slot_forms = [fs.tail.slots, *([fs.indexer.slots] if fs.indexer is not None else [])]
        leased: list[tuple[BlockPool, int]] = []
        try:
            entries = []
            for pages, table in zip(fs.entry_groups(), tables, strict=True):
                table.extend(pages.lease_pages(hashes, resume))  # released by PagedSequence.finish
                entries.append((pages.group.which, pages.read(table)))
            states = restore_states(fs.compressed_specs, resume, entries, fs.device)
            for slots in slot_forms:
                slot = slots.slot_at(hashes, resume)
                if slot is None and slots.needed_at(resume):
                    raise RuntimeError(f"{slots.pool.name}: rows at {resume} vanished before their lease")
                if slot is not None:
                    slots.pool.lease(slot)
                    leased.append((slots.pool, slot))
                slots.read_into(slot, resume, states)
        finally:
            for pool, block in leased:
                pool.release(block)
        for state in states.values():
            state.check()
        return states
