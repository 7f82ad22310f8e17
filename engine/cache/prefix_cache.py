"""The prefix cache of one model: its forms, the prefix index, lookup and the start of a request.

This is the object the engine talks to:

* :meth:`PrefixCache.block_hashes` — the prompt's hash chain (computed once per request);
* :meth:`PrefixCache.lookup` — the hash hit, then L* and every form's verdict;
* :meth:`PrefixCache.start` — lease what the plan reuses, then hand back a
  :class:`~engine.cache.sequence.PagedSequence` that allocates as the request runs;
* :meth:`PrefixCache.check_invariants` — pools, free queues and prefix index agree.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.cache.block_pool import SENTINEL_BLOCK, PoolExhausted
from engine.cache.config import CacheConfig
from engine.cache.coordinator import ResumePlan, plan_resume, resume_limit
from engine.cache.forms import CacheForm, CompressedSnapshotForm, LinearCheckpointForm, PagedKVForm
from engine.cache.hashing import BlockHash, PrefixIndex, chain_hashes, root_hash
from engine.cache.sequence import PagedSequence
from engine.events import Form
from engine.model.base import ModelLayout
from engine.model.state import CompressedLayerState, LinearLayerState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class FormOccupancy:
    """One form's pool: blocks holding state (leased by running requests or cached), of which
    leased and cached (published), and blocks an allocation could take (empty or evictable)."""

    form: Form
    used_blocks: int
    leased_blocks: int
    cached_blocks: int
    free_blocks: int
    total_blocks: int
    bytes_per_block: int

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.bytes_per_block


class PrefixCache:
    """Every cache form of one model, sized by a :class:`CacheConfig`.

    Args:
        layout: the layers the forms serve (:meth:`CausalLM.layout`).
        config: pool sizes and policies.
        model_name: part of the hash root (with the layout's revision), so two models never
            share a prefix.
        device, dtype: where the KV pools live and their element type.
    """

    def __init__(
        self,
        layout: ModelLayout,
        config: CacheConfig,
        model_name: str,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.unit_tokens = config.unit_tokens
        self.device = device
        self.index = PrefixIndex()
        self.root = root_hash(model_name, layout.revision, config.unit_tokens)
        self.kv_forms: list[PagedKVForm] = []
        self.kv_form_of_layer: dict[int, PagedKVForm] = {}
        for form, kind, blocks, window in (
            (Form.FULL_KV, "full_attention", config.full_kv_blocks, None),
            (Form.SWA_WINDOW, "sliding_attention", config.swa_blocks, layout.sliding_window),
        ):
            layers = layout.layers_of(kind)
            if not layers:
                continue
            kv_form = PagedKVForm(
                form,
                layers,
                blocks,
                config.unit_tokens,
                layout.num_kv_heads,
                layout.kv_head_dim,
                window,
                self.index,
                dtype,
                device,
            )
            self.kv_forms.append(kv_form)
            self.kv_form_of_layer.update(dict.fromkeys(layers, kv_form))
        self.linear: LinearCheckpointForm | None = None
        linear_layers = layout.layers_of("linear_attention")
        if linear_layers:
            conv_shape, rec_shape = layout.linear_state_shapes[linear_layers[0]]
            self.linear = LinearCheckpointForm(
                linear_layers, config.linear_checkpoints, config.unit_tokens, conv_shape, rec_shape, self.index, device
            )
        self.compressed: CompressedSnapshotForm | None = None
        if layout.compressed_state_specs:
            self.compressed = CompressedSnapshotForm(
                tuple(sorted(layout.compressed_state_specs)), config.compressed_snapshots, config.unit_tokens, self.index
            )
        forms: list[CacheForm] = list(self.kv_forms)
        forms += [f for f in (self.compressed, self.linear) if f is not None]
        self.forms: tuple[CacheForm, ...] = tuple(forms)

    @property
    def has_checkpoint_forms(self) -> bool:
        """Whether some form resumes only at stored checkpoints (recurrent or compressed
        state): then resume points are the checkpoint positions, not every U boundary."""
        return self.linear is not None or self.compressed is not None

    # -- reporting -----------------------------------------------------------------------------
    def resume_granularity(self) -> dict[Form, int]:
        """The coarsest spacing (tokens) between positions each form can resume at."""
        out = {f.form: self.unit_tokens for f in self.kv_forms}
        for f in (self.compressed, self.linear):
            if f is not None:
                out[f.form] = self.config.checkpoint_interval_tokens
        return out

    def log_plan(self) -> None:
        """Log every pool's size and the effective resume granularity per form; warn above 8·U."""
        for f in self.forms:
            log.info(
                "cache form %s: %d blocks x %d bytes = %.1f MiB",
                f.form,
                f.pool.num_blocks - 1,
                f.bytes_per_block,
                (f.pool.num_blocks - 1) * f.bytes_per_block / 2**20,
            )
        for form, spacing in self.resume_granularity().items():
            level = logging.WARNING if spacing > 8 * self.unit_tokens else logging.INFO
            log.log(level, "cache form %s resumes every %d tokens (U = %d)", form, spacing, self.unit_tokens)

    def occupancy(self) -> list[FormOccupancy]:
        return [
            FormOccupancy(
                form=f.form,
                used_blocks=f.pool.num_holding,
                leased_blocks=f.pool.num_leased,
                cached_blocks=f.pool.num_cached,
                free_blocks=f.pool.num_free,
                total_blocks=f.pool.num_blocks - 1,
                bytes_per_block=f.bytes_per_block,
            )
            for f in self.forms
        ]

    # -- lookup --------------------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        return chain_hashes(self.root, token_ids, self.unit_tokens)

    def lookup(self, hashes: Sequence[BlockHash], prompt_tokens: int) -> ResumePlan:
        """The hash hit and the resume plan; takes no lease and changes nothing."""
        hit = self.index.hit_blocks(hashes) * self.unit_tokens if self.config.enable_prefix_caching else 0
        return plan_resume(self.forms, hashes, prompt_tokens, hit, self.unit_tokens)

    def start(self, plan: ResumePlan, token_ids: Sequence[int], hashes: Sequence[BlockHash]) -> PagedSequence:
        """Lease every object the plan reuses, then build the request's sequence.

        Leases are taken before the sequence allocates anything, so the request's own
        allocations can never evict what its lookup matched (case C8).

        Raises:
            RuntimeError: an object the plan relies on is gone (an internal invariant).
        """
        resume = plan.resume_tokens
        u = self.unit_tokens
        seq = PagedSequence(
            self, token_ids, hashes[: len(token_ids) // u], resume, self.checkpoint_positions(plan)
        )
        try:
            for form in self.kv_forms:
                needed = form.needed_pages(resume)
                table = seq.tables[form]
                table.extend([SENTINEL_BLOCK] * (resume // u))
                seq.released_pages[form] = needed.start
                for page in needed:
                    block = form.pool.lookup(hashes[page])
                    if block is None:
                        raise RuntimeError(f"{form.form}: page {page} of the plan vanished before its lease")
                    form.pool.lease(block)
                    table[page] = block
            if self.linear is not None:
                slot = self.linear.checkpoint_at(hashes, resume)
                if resume and slot is None:
                    raise RuntimeError(f"linear_state: checkpoint at {resume} vanished before its lease")
                if slot is None:
                    seq.linear_states = self.linear.zero_state()
                else:
                    self.linear.pool.lease(slot)
                    try:
                        seq.linear_states = self.linear.read(slot)
                    finally:
                        self.linear.pool.release(slot)
            if self.compressed is not None and resume:
                slot = self.compressed.pool.lookup(hashes[resume // u - 1])
                if slot is None:
                    raise RuntimeError(f"compressed_kv: snapshot at {resume} vanished before its lease")
                self.compressed.pool.lease(slot)
                try:
                    seq.compressed_states = self.compressed.read(slot)
                finally:
                    self.compressed.pool.release(slot)
        except BaseException:
            seq.finish()  # give back the leases taken so far
            raise
        return seq

    def checkpoint_positions(self, plan: ResumePlan) -> frozenset[int]:
        """Where a request prefilling ``[L*, T)`` takes recurrent checkpoints: every multiple of
        the checkpoint interval, the last U boundary strictly before the prompt end (where a
        follow-up turn resumes), and the junction where the matched prefix ends when L* fell
        short of it (a sibling sharing that prefix then resumes there: case C1)."""
        start = plan.resume_tokens
        limit = resume_limit(plan.prompt_tokens, self.unit_tokens)
        interval = self.config.checkpoint_interval_tokens
        positions = set(range(start - start % interval + interval, limit + 1, interval))
        for p in (limit, min(plan.hash_hit_tokens, limit)):
            if p > start:
                positions.add(p)
        return frozenset(positions)

    def window_pages_needed(self, window_tokens: int, max_tokens: int) -> int:
        """Most pages one request can hold in a window pool: the window behind its last
        checkpoint (up to one interval back), one prefill chunk, and its decoded tokens."""
        c = self.config
        span = window_tokens + c.max_prefill_chunk_tokens + c.checkpoint_interval_tokens + max_tokens
        return -(-span // self.unit_tokens) + 2

    def form_epoch(self, seq: PagedSequence, form: CacheForm, resume_tokens: int) -> int:
        """Epoch of the deepest object a form contributed to the resume (0 when none)."""
        if resume_tokens == 0:
            return 0
        if isinstance(form, PagedKVForm):
            table = seq.tables.get(form, [])
            page = resume_tokens // self.unit_tokens - 1
            return form.pool.epoch[table[page]] if page < len(table) and table[page] else 0
        slot = form.pool.lookup(seq.hashes[resume_tokens // self.unit_tokens - 1])
        return form.pool.epoch[slot] if slot is not None else 0

    def save_checkpoint(
        self,
        h: BlockHash,
        linear_states: dict[int, LinearLayerState],
        compressed_states: dict[int, CompressedLayerState],
    ) -> bool:
        """Store copies of the recurrent and compressed state summarising the prefix named by
        ``h`` (each checkpoint form of the model).

        Returns whether every checkpoint form holds that prefix afterwards (stored now or
        before); False when the model has none or a pool has every slot leased.
        """
        stored = self.has_checkpoint_forms
        for form, states in ((self.linear, linear_states), (self.compressed, compressed_states)):
            if form is None or form.pool.lookup(h) is not None:
                continue
            try:
                slot = form.pool.allocate()
            except PoolExhausted:
                log.warning("%s: every slot is leased; checkpoint skipped", form.form)
                stored = False
                continue
            form.write(slot, states)  # type: ignore[arg-type]
            form.pool.publish(slot, h)
            form.pool.release(slot)
        return stored

    def check_invariants(self) -> None:
        """Raise AssertionError unless every pool is consistent and the prefix index counts
        exactly the published objects of all forms."""
        expected: Counter[BlockHash] = Counter()
        for f in self.forms:
            f.pool.check_invariants()
            expected.update(h for h in f.pool.block_hash if h is not None)
        assert dict(expected) == self.index.snapshot(), "prefix index disagrees with the pools"
