"""One running request's view of the cache: block tables, slot mapping, working recurrent state.

Life of a request (all on one thread; the runtime issue adds batching):

1. :meth:`Leases.start` (``PrefixCache.start``) leases every object the plan reuses — pages of
   every KV form and the checkpoint at L* — *before* any allocation for the request (red line
   3, case C8), then copies the checkpoint into the request's working recurrent state.
2. For each chunk ``[start, end)``: :meth:`begin_chunk` allocates the pages the chunk writes;
   the layers call :meth:`attention_kv` / :meth:`linear`; :meth:`commit` publishes the pages
   the chunk completed, takes a recurrent checkpoint when ``end`` is a checkpoint position, and
   returns the sliding pages that left the window (their content stays cached until evicted).
   Nothing a chunk produced is visible to other requests before its commit.
3. :meth:`finish` releases every lease (full-KV pages tail first, so prefixes outlive their
   tails; window pages head first, so each boundary's window tail is evicted last).

Window watermark (case C7): sliding pages are kept for ``[anchor − W + 1, end)`` where the anchor
is the last point a later request could resume at (the last stored checkpoint for models with
linear layers), so the window behind the last usable checkpoint stays intact while the request
decodes.
"""

from __future__ import annotations

import itertools
from collections.abc import MutableSet, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.cache.block_pool import SENTINEL_BLOCK, BlockPool
from engine.cache.checkpoint_writer import CheckpointWriter
from engine.cache.form_set import FormSet
from engine.cache.forms import PagedKVForm, gather_pages
from engine.cache.hashing import BlockHash, chain_hashes
from engine.model.state import (
    AttentionKV,
    AttentionPages,
    CompressedLayerSpec,
    CompressedLayerState,
    LinearLayerState,
)

_SERIALS = itertools.count()

WINDOW_TAIL_PRIORITY = 1
"""Eviction priority of the window pages behind a request's last resume boundary."""


@dataclass(slots=True)
class _ChunkPages:
    """Per-chunk index tensors for one KV form, built once and shared by its layers."""

    write_pages: Tensor  # [T] page id per new token
    write_offsets: Tensor  # [T] row inside the page
    read_pages: Tensor  # [P] pages covering [first, end)
    read_first: int  # offset of the first read token inside read_pages[0]
    read_tokens: int
    read_positions: Tensor  # [S]
    block_table: Tensor  # [1, pages] int32, the whole table (the paged kernels' view)
    end: int  # tokens stored once the chunk is written


class PagedSequence:
    """Implements :class:`~engine.model.state.SequenceState` over the cache pools.

    Args:
        form_set: the forms whose pools it allocates from and publishes into.
        writer: stores its entry pages at commits and its checkpoints.
        running: the started, unfinished requests; the sequence leaves it when it finishes.
        token_ids, hashes: the prompt and the hashes of its full blocks.
        resume_tokens: where computation starts (its leases up to there are taken by the caller).
        checkpoint_positions: where it stores checkpoints (prefill chunks end there).
    """

    def __init__(
        self,
        form_set: FormSet,
        writer: CheckpointWriter,
        running: MutableSet[PagedSequence],
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        resume_tokens: int,
        checkpoint_positions: frozenset[int],
    ) -> None:
        self.form_set = form_set
        self.writer = writer
        self.running = running
        self.serial = next(_SERIALS)
        """Unique per sequence for the life of the process (names its eviction groups)."""
        self.token_ids = list(token_ids)
        self.hashes = list(hashes)
        self.unit_tokens = form_set.unit_tokens
        self.num_computed_tokens = resume_tokens
        self.last_checkpoint_tokens = resume_tokens
        self.last_checkpoint_reached = resume_tokens
        """The last checkpoint position the prefill reached, stored or not (a full slot pool, a
        fault): the window behind an older one is no longer leased."""
        self.tables: dict[PagedKVForm, list[int]] = {f: [] for f in form_set.kv_forms}
        self.published_pages = resume_tokens // self.unit_tokens
        self.released_pages: dict[PagedKVForm, int] = {f: 0 for f in form_set.kv_forms}
        self.linear_states: dict[int, LinearLayerState] = {}
        self.compressed_states: dict[int, CompressedLayerState] = {}
        """The request's own copy of every CSA/HCA layer's state (restored from the compressed
        forms at L*; what it adds is stored back at each commit and checkpoint)."""
        self.entry_tables: list[list[int]] = [[] for _ in form_set.entry_groups()]
        """Per entry-page group of the form set: the blocks of this prefix's compressed entry pages
        the request holds leased, in page order (restored at L*, then stored at commits)."""
        self.checkpoint_positions = checkpoint_positions
        """Where this request stores recurrent checkpoints (prefill chunks end there, or take
        them inside: :attr:`chunk_stops`)."""
        self.pinned: list[tuple[BlockPool, int]] = []
        """Blocks leased only to keep them (a Tail-Replay's matched pages past its start)."""
        self.approximate = False
        """Tail-Replay: the state is rebuilt approximately, so nothing this request computes
        is published, stored or checkpointed (set by start)."""
        self.window_evicted: set[PagedKVForm] = set()
        """Window forms whose pages this request's lookup found evicted (set by start)."""
        self._chunk: dict[PagedKVForm, _ChunkPages] = {}
        self._chunk_positions: Tensor | None = None
        self._inner_offsets: tuple[int, ...] = ()
        self._inner_states: dict[int, dict[int, LinearLayerState]] = {}
        """Checkpoints inside the current chunk: position -> layer -> its state there."""
        self.finished = False

    @property
    def chunk_stops(self) -> frozenset[int]:
        """The checkpoint positions a prefill chunk must end at: all of them, or none when they
        are taken inside chunks (``FormSet.checkpoints_inside_chunks``; a Tail-Replay takes none)."""
        if self.form_set.checkpoints_inside_chunks:
            return frozenset()
        return self.checkpoint_positions

    @property
    def chunk_positions(self) -> Tensor | None:
        """The positions tensor ``[T]`` of the chunk begun by :meth:`begin_chunk` and not yet
        committed (the layers must pass this very tensor), or None between chunks."""
        return self._chunk_positions

    # -- SequenceState --------------------------------------------------------------------------
    def attention_kv(self, layer: int, positions: Tensor, keys: Tensor, values: Tensor) -> AttentionKV:
        plan = self._write_chunk(layer, positions, keys, values)
        kv, slot = self.form_set.kv_form_of_layer[layer].layer_slot[layer]
        k, v = gather_pages(kv, plan.read_pages, slot, plan.read_first, plan.read_tokens)
        return AttentionKV(k.to(keys.dtype), v.to(values.dtype), plan.read_positions)

    def _write_chunk(self, layer: int, positions: Tensor, keys: Tensor, values: Tensor) -> _ChunkPages:
        """Write the chunk's keys and values into the layer's pages (the slot mapping)."""
        if positions is not self._chunk_positions:
            raise RuntimeError("attention_kv called with positions other than the current chunk's")
        form = self.form_set.kv_form_of_layer[layer]
        plan = self._chunk[form]
        kv, slot = form.layer_slot[layer]
        kv[plan.write_pages, slot, 0, plan.write_offsets] = keys.to(kv.dtype)
        kv[plan.write_pages, slot, 1, plan.write_offsets] = values.to(kv.dtype)
        return plan

    def attention_pages(self, layer: int, positions: Tensor, keys: Tensor, values: Tensor) -> AttentionPages:
        plan = self._write_chunk(layer, positions, keys, values)
        kv, slot = self.form_set.kv_form_of_layer[layer].layer_slot[layer]
        return AttentionPages(kv[:, slot, 0], kv[:, slot, 1], plan.block_table, plan.end)

    def linear(self, layer: int) -> LinearLayerState:
        return self.linear_states[layer]

    def linear_checkpoints(self) -> tuple[int, ...]:
        """Checkpoint positions inside the current chunk, as ascending token offsets from its
        start (empty unless ``FormSet.checkpoints_inside_chunks``, prefix caching is on and the
        sequence is not approximate)."""
        return self._inner_offsets

    def save_linear(self, layer: int, offset: int, state: LinearLayerState) -> None:
        """Keep ``layer``'s state after ``offset`` tokens of the current chunk (one of
        :meth:`linear_checkpoints`; ``state`` must not be written again); stored at :meth:`commit`."""
        self._inner_states.setdefault(self.num_computed_tokens + offset, {})[layer] = state

    def compressed(self, layer: int, spec: CompressedLayerSpec) -> CompressedLayerState:
        """The state of a CSA/HCA layer: restored from the compressed forms at L* by
        :meth:`Leases.start`, or created empty on first use at L* = 0.

        Raises:
            RuntimeError: no state for this layer although the request resumed at L* > 0.
            ValueError: ``spec`` differs from the one the state was created with.
        """
        state = self.compressed_states.get(layer)
        if state is None:
            if self.num_computed_tokens:
                raise RuntimeError(f"layer {layer}: resumed at {self.num_computed_tokens} tokens without its compressed state")
            state = self.compressed_states[layer] = CompressedLayerState.empty(spec, self.form_set.device)
        elif state.spec != spec:
            raise ValueError(f"layer {layer}: compressed state built for {state.spec}, asked for {spec}")
        return state

    # -- chunk protocol ------------------------------------------------------------------------
    def begin_chunk(self, end: int) -> Tensor:
        """Allocate pages for ``[num_computed_tokens, end)`` and build the chunk's index tensors.

        Returns the chunk's positions ``[end − num_computed_tokens]``.

        Raises:
            engine.cache.block_pool.PoolExhausted: a pool has no evictable block left.
        """
        start = self.num_computed_tokens
        if not start < end <= len(self.token_ids):
            raise RuntimeError(f"chunk [{start}, {end}) outside the sequence of {len(self.token_ids)} tokens")
        u = self.unit_tokens
        device = self.form_set.device
        positions = torch.arange(start, end, device=device)
        last_page = (end - 1) // u
        for form, table in self.tables.items():
            while len(table) <= last_page:
                table.append(form.pool.allocate())
            first = form.first_needed_token(start)
            first_page = first // u
            read = table[first_page : last_page + 1]
            if SENTINEL_BLOCK in read:
                raise RuntimeError(f"{form.form}: page of the live window was released (table {table})")
            table_t = torch.tensor(table, dtype=torch.long, device=device)
            self._chunk[form] = _ChunkPages(
                write_pages=table_t[positions // u],
                write_offsets=positions % u,
                read_pages=torch.tensor(read, dtype=torch.long, device=device),
                read_first=first - first_page * u,
                read_tokens=end - first,
                read_positions=torch.arange(first, end, device=device),
                block_table=table_t[None, : last_page + 1].to(torch.int32),
                end=end,
            )
        self._chunk_positions = positions
        self._inner_states = {}
        self._inner_offsets = ()
        if self.form_set.checkpoints_inside_chunks and self.form_set.config.enable_prefix_caching and not self.approximate:
            self._inner_offsets = tuple(sorted(p - start for p in self.checkpoint_positions if start < p < end and p % u == 0))
        return positions

    def commit(self, end: int, take_checkpoint: bool) -> None:
        """Mark ``[num_computed_tokens, end)`` computed; publish completed pages; checkpoint; trim windows."""
        self.num_computed_tokens = end
        self._chunk.clear()
        self._chunk_positions = None
        self._inner_offsets = ()
        u = self.unit_tokens
        full_pages = end // u
        if full_pages > len(self.hashes):
            parent = self.hashes[-1] if self.hashes else self.form_set.root
            self.hashes.extend(chain_hashes(parent, self.token_ids[len(self.hashes) * u : full_pages * u], u))
        if self.form_set.config.enable_prefix_caching and not self.approximate:
            for page in range(self.published_pages, full_pages):
                for form, table in self.tables.items():
                    if table[page] != SENTINEL_BLOCK and self._page_backs_a_resume_point(form, page):
                        form.pool.publish(table[page], self.hashes[page])
            if self.compressed_states:
                self.writer.store_entries(self.hashes, self.compressed_states, self.entry_tables)
            for inner in sorted(self._inner_states):  # taken inside the chunk (begin_chunk)
                self.last_checkpoint_reached = inner
                if self.writer.save_checkpoint(self.hashes, inner, self._inner_states[inner], self.compressed_states):
                    self.last_checkpoint_tokens = inner
            if take_checkpoint and end % u == 0:
                self.last_checkpoint_reached = end
                if self.writer.save_checkpoint(self.hashes, end, self.linear_states, self.compressed_states):
                    self.last_checkpoint_tokens = end
        self._inner_states = {}
        self.published_pages = max(self.published_pages, full_pages)
        self._trim_windows()

    def append_token(self, token_id: int) -> None:
        """Extend the sequence by one generated token (decode)."""
        self.token_ids.append(token_id)

    def _page_backs_a_resume_point(self, form: PagedKVForm, page: int) -> bool:
        """Store rule of the window form, the same predicate as its lookup rule: with linear
        layers a resume point needs a checkpoint, so a window page is worth publishing only if it
        lies in the window before one of this request's checkpoint positions (case C12). A page
        that backs nothing is returned unpublished and reused first."""
        if form.window is None or not self.form_set.has_checkpoint_forms:
            return True
        return any(form.needed_pages(c).start <= page < c // self.unit_tokens for c in self.checkpoint_positions)

    def resume_anchor(self) -> int:
        """The latest position at which a future request could resume on this request's state:
        the last stored recurrent checkpoint when the model has linear layers, else the last U
        boundary; with prefix caching off, nothing is kept for later (the current position)."""
        if not self.form_set.config.enable_prefix_caching or self.approximate:
            return self.num_computed_tokens
        if not self.form_set.has_checkpoint_forms:
            return self.num_computed_tokens - self.num_computed_tokens % self.unit_tokens
        return min(self.last_checkpoint_tokens, self.num_computed_tokens)

    def _trim_windows(self) -> None:
        """Give back the window pages no resume point this request can still produce reads: those
        before the window of its anchor — or of the last checkpoint position it reached when the
        checkpoint there was not stored (else a request whose checkpoints all fail would keep its
        whole prompt's window leased and exhaust the pool). Released pages stay cached."""
        u = self.unit_tokens
        anchor = max(self.resume_anchor(), min(self.last_checkpoint_reached, self.num_computed_tokens))
        for form, table in self.tables.items():
            if form.window is None:
                continue
            keep_from = form.first_needed_token(anchor)
            for page in range(self.released_pages[form], keep_from // u):
                if table[page] != SENTINEL_BLOCK:
                    form.pool.release(table[page])
                    table[page] = SENTINEL_BLOCK
            self.released_pages[form] = max(self.released_pages[form], keep_from // u)

    def finish(self) -> None:
        """Release every lease; idempotent. Pages the request did not publish become free.

        Release order decides eviction order within a priority (the first released is evicted
        first): full-KV pages tail first, so a prefix outlives its tail; window pages past the
        resume anchor first (no resume point can use them), then the rest oldest first. The
        window behind the anchor — the boundary a follow-up turn resumes at — is released with a
        higher priority, so it is evicted after every other window page (cases C5 and C7).
        """
        if self.finished:
            return
        self.finished = True
        self.running.discard(self)
        anchor = self.resume_anchor()
        anchor_page = anchor // self.unit_tokens
        for form, table in self.tables.items():
            if form.window is None:
                for block in reversed(table):
                    if block != SENTINEL_BLOCK:
                        form.pool.release(block)
            else:
                tail = form.needed_pages(anchor)  # the window a follow-up resumes on
                group = (self.serial, anchor)  # its pages are worth keeping only together
                # admission: a request whose own window had been evicted (the pool is thrashing)
                # does not get its tail protected, or it would evict the next session's in turn
                priority = 0 if form in self.window_evicted else WINDOW_TAIL_PRIORITY
                for page in [*range(anchor_page, len(table)), *range(anchor_page)]:
                    if table[page] == SENTINEL_BLOCK:
                        continue
                    if page in tail:
                        form.pool.release(table[page], priority=priority, group=group)
                    else:
                        form.pool.release(table[page])
            table.clear()
        for pool, block in reversed(self.pinned):
            pool.release(block)
        self.pinned.clear()
        for pages, table in zip(self.form_set.entry_groups(), self.entry_tables, strict=True):
            for block in reversed(table):  # tail first: a prefix outlives its tail
                pages.pool.release(block)
            table.clear()
        self.linear_states.clear()
        self.compressed_states.clear()
