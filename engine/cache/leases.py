"""Leases: starting a request on its plan, and who holds which block afterwards.

:meth:`Leases.start` leases every object a plan reads *before* the request allocates anything
(case C8), re-checking the plan first (the TOCTOU window of DESIGN.md §4, red line 3), and hands
back the request's :class:`~engine.cache.sequence.PagedSequence`. :class:`Leases` keeps the
requests started and not finished, so :meth:`Leases.check_owned` can match every device lease to
its holder.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Sequence

from engine.cache.block_pool import SENTINEL_BLOCK
from engine.cache.checkpoint_writer import CheckpointWriter
from engine.cache.coordinator import ResumePlan
from engine.cache.form_set import FormSet
from engine.cache.forms import PagedKVForm
from engine.cache.hashing import BlockHash
from engine.cache.sequence import PagedSequence
from engine.events import Form, Reason


class StaleResume(Exception):
    """An object a plan relies on changed between the lookup and its lease (the TOCTOU window
    of DESIGN.md §4 red line 3). The caller looks up again with the form vetoed
    (``epoch_changed``): the request degrades to recompute instead of reading a changed object."""

    def __init__(self, form: Form) -> None:
        super().__init__(f"{form}: an object of the plan changed before its lease")
        self.form = form


class Leases:
    """Starts requests on the pools of ``form_set``; their stores go through ``writer``."""

    def __init__(self, form_set: FormSet, writer: CheckpointWriter) -> None:
        self.form_set = form_set
        self.writer = writer
        self.running: weakref.WeakSet[PagedSequence] = weakref.WeakSet()
        """Requests started and not finished (for the ownership check)."""

    def start(self, plan: ResumePlan, token_ids: Sequence[int], hashes: Sequence[BlockHash]) -> PagedSequence:
        """Lease every object the plan reuses, then build the request's sequence.

        Leases are taken before the sequence allocates anything, so the request's own
        allocations can never evict what its lookup matched (case C8).

        Raises:
            StaleResume: a form's pools changed since the lookup and it can no longer resume at
                L* (nothing is leased then).
            RuntimeError: an object the plan relies on is gone although its pool did not change
                (an internal invariant).
        """
        fs, u = self.form_set, self.form_set.unit_tokens
        resume = plan.resume_tokens - plan.replayed_tokens  # where computation starts
        if resume:
            versions = dict(plan.pool_versions)
            for f in fs.forms:
                changed = versions.get(f.form) != tuple(p.version for p in f.pools)
                rebuilt = plan.replayed_tokens and f.form == Form.LINEAR_STATE  # reads nothing stored
                if changed and not rebuilt and f.resume_at_most(hashes, resume) < resume:
                    raise StaleResume(f.form)
        seq = PagedSequence(fs, self.writer, self.running, token_ids, hashes[: len(token_ids) // u], resume, fs.checkpoint_positions(plan))
        self.running.add(seq)
        seq.approximate = plan.replayed_tokens > 0
        seq.window_evicted = {f for f in fs.kv_forms if f.window is not None and plan.form(f.form).reason == Reason.SWA_EVICTED}
        try:
            for form in fs.kv_forms:
                needed = form.needed_pages(resume)
                table = seq.tables[form]
                table.extend([SENTINEL_BLOCK] * (resume // u))
                seq.released_pages[form] = needed.start
                for page in needed:
                    table[page] = _lease_page(form, hashes, page)
            if plan.replayed_tokens:
                self._pin_replayed(plan, hashes, seq)
            linear = fs.linear
            if linear is not None and seq.approximate:
                seq.linear_states = linear.zero_state()  # Tail-Replay rebuilds it from here
            elif linear is not None:
                slot = linear.checkpoint_at(hashes, resume)
                if resume and slot is None:
                    raise RuntimeError(f"linear_state: checkpoint at {resume} vanished before its lease")
                if slot is None:
                    seq.linear_states = linear.zero_state()
                else:
                    linear.pool.lease(slot)
                    try:
                        seq.linear_states = linear.read(slot)
                    finally:
                        linear.pool.release(slot)
            if fs.compressed is not None:
                seq.compressed_states = self.writer.restore_compressed(hashes, resume, seq.entry_tables) if resume else {}
        except BaseException:
            seq.finish()  # give back the leases taken so far
            raise
        return seq

    def _pin_replayed(self, plan: ResumePlan, hashes: Sequence[BlockHash], seq: PagedSequence) -> None:
        """Tail-Replay computes from L − R but its lookup matched up to L: lease the pages of
        ``[L − R, L)`` too (KV and compressed entries), outside the block tables so the replayed
        rows are never written into them, so the request's own allocations cannot evict them
        (case C8). Released by :meth:`PagedSequence.finish`."""
        point, start, u = plan.resume_tokens, plan.resume_tokens - plan.replayed_tokens, self.form_set.unit_tokens
        for form in self.form_set.kv_forms:
            for page in form.needed_pages(point):
                if page >= start // u:
                    seq.pinned.append((form.pool, _lease_page(form, hashes, page)))
        for pages in self.form_set.entry_groups():
            for page in range(pages.pages_needed(start), pages.pages_needed(point)):
                block = pages.block_of(hashes, page)
                if block is None:
                    raise RuntimeError(f"{pages.pool.name}: page {page} of the plan vanished before its lease")
                pages.pool.lease(block)
                seq.pinned.append((pages.pool, block))

    def check_owned(self, prefetching: Counter[tuple[int, int]]) -> None:
        """Raise AssertionError unless every device lease has its holder, between two steps: a
        KV page's ref count equals the number of running requests whose block table (or pinned
        list) holds it, plus a prefetch copying into it (``prefetching``: (id of the pool,
        block) counts); a page being written (unpublished) belongs to exactly one request;
        compressed entry pages likewise; tail, indexer-row and checkpoint slots are leased only
        by a prefetch."""
        fs = self.form_set
        running = [seq for seq in self.running if not seq.finished]
        for form in fs.kv_forms:
            held = Counter(b for seq in running for b in seq.tables[form] if b != SENTINEL_BLOCK)
            held.update(b for seq in running for pool, b in seq.pinned if pool is form.pool)
            held.update(b for (pool_id, b), n in prefetching.items() for _ in range(n) if pool_id == id(form.pool))
            for block in range(1, form.pool.num_blocks):
                rc = form.pool.ref_count[block]
                assert rc == held[block], f"{form.form}: block {block} has {rc} leases, {held[block]} running requests hold it"
                if rc and form.pool.block_hash[block] is None:
                    assert held[block] == 1, f"{form.form}: unpublished block {block} is written by {held[block]} requests"
        for i, pages in enumerate(fs.entry_groups()):
            held = Counter(b for seq in running for b in seq.entry_tables[i])
            held.update(b for seq in running for pool, b in seq.pinned if pool is pages.pool)
            held.update(b for (pool_id, b), n in prefetching.items() for _ in range(n) if pool_id == id(pages.pool))
            for block in range(1, pages.pool.num_blocks):
                rc = pages.pool.ref_count[block]
                assert rc == held[block], f"{pages.pool.name}: block {block} has {rc} leases, {held[block]} running requests hold it"
        entry_pools = {id(g.pool) for g in fs.entry_groups()}
        for f in fs.forms:
            if isinstance(f, PagedKVForm):
                continue
            for pool in f.pools:
                if id(pool) not in entry_pools:
                    fetching = sum(n for (pool_id, _), n in prefetching.items() if pool_id == id(pool))
                    assert pool.num_leased == fetching, f"{pool.name}: {pool.num_leased} slots leased between steps"


def _lease_page(form: PagedKVForm, hashes: Sequence[BlockHash], page: int) -> int:
    """Lease the block holding page ``page`` of this prefix in ``form``; its id.

    Raises:
        RuntimeError: the page is gone (an internal invariant: the plan was checked).
    """
    block = form.pool.lookup(hashes[page])
    if block is None:
        raise RuntimeError(f"{form.form}: page {page} of the plan vanished before its lease")
    form.pool.lease(block)
    return block
