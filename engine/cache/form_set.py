"""The forms of one model's prefix cache: their pools, the prefix index, the kernel contracts
their readers were built for, and the device view a lookup plans on.

A :class:`FormSet` owns every device pool (through its forms), the :class:`PrefixIndex` they
publish into, the hash root, the contracts and the validation memo. It decides nothing about
plans: :mod:`engine.cache.planner` plans on :meth:`FormSet.resumable`, the swap controller
copies its pools' objects, the checkpoint writer stores into them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.cache.block_pool import BlockPool
from engine.cache.compressed import (
    CompressedKVForm,
    EntryPages,
    IndexerStateForm,
    UncompressedTailForm,
)
from engine.cache.config import CacheConfig
from engine.cache.coordinator import ResumableForm, ResumePlan, resume_limit
from engine.cache.form_spec import (
    FormSpec,
    PoolKind,
    PoolSpec,
    form_specs,
    layout_pools,
    needs_checkpoints,
)
from engine.cache.forms import KERNEL_ABI, LinearCheckpointForm, PagedKVForm
from engine.cache.hashing import BlockHash, PrefixIndex, chain_hashes, root_hash
from engine.cache.memory_plan import window_pages_needed
from engine.cache.validation import (
    KernelContract,
    LayoutFingerprint,
    ValidationFailure,
    check_alignment,
    check_kernel_contract,
)
from engine.events import Form, Reason
from engine.model.base import ModelLayout

log = logging.getLogger(__name__)

CacheForm = PagedKVForm | CompressedKVForm | UncompressedTailForm | IndexerStateForm | LinearCheckpointForm


class PoolEntry(NamedTuple):
    """One device pool with its spec: the form it belongs to, the pool, what one block holds,
    bytes per block, and the prefix tokens one block covers (0 for a per-boundary slot)."""

    form: Form
    pool: BlockPool
    kind: PoolKind
    bytes_per_block: int
    page_tokens: int


@dataclass(frozen=True, slots=True)
class Vetoed:
    """A form whose stored objects failed validation, or changed between a lookup and its
    leases: it can resume nowhere but at 0 and reports ``reason``."""

    form: Form
    reason: Reason
    downward_closed = True  # the same reason at every point

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        return 0

    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int) -> Reason:
        return self.reason


def _live_block_bytes(form: CacheForm) -> list[int]:
    """Bytes per block of each pool of ``form``, as allocated, in ``form.pools`` order."""
    if isinstance(form, CompressedKVForm):
        return [g.bytes_per_block for g in form.groups]
    if isinstance(form, UncompressedTailForm):
        return [form.slots.bytes_per_block]
    if isinstance(form, IndexerStateForm):
        return [*(k.bytes_per_block for k in form.keys), form.slots.bytes_per_block]
    return [form.bytes_per_block]


class FormSet:
    """Every cache form of one model, sized by a :class:`CacheConfig`.

    Args:
        layout: the layers the forms serve (:meth:`CausalLM.layout`).
        config: pool sizes and policies (``config`` may be replaced later; pool sizes stay).
        model_name: part of the hash root (with the layout's revision), so two models never
            share a prefix.
        device, dtype: where the pools live and the KV pages' element type.

    Raises:
        ValueError: a compression ratio neither divides U nor is a multiple of it.
        RuntimeError: an allocated pool differs from its spec (an internal invariant).
    """

    def __init__(self, layout: ModelLayout, config: CacheConfig, model_name: str, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.layout = layout
        self.unit_tokens = u = config.unit_tokens
        self.device = device
        self.index = PrefixIndex()
        self.root = root_hash(model_name, layout.revision, u)
        self.pool_specs = layout_pools(layout, u, dtype)
        """Per form, its pools' specs (computed from the layout before allocation)."""
        self.kv_forms: list[PagedKVForm] = []
        self.kv_form_of_layer: dict[int, PagedKVForm] = {}
        kv_shapes = {i: layout.kv_shape(i) for i in range(len(layout.layer_types))}
        for form, layers, blocks, window in (
            (Form.FULL_KV, layout.layers_of("full_attention"), config.full_kv_blocks, None),
            (Form.SWA_WINDOW, layout.window_layers, config.swa_blocks, layout.sliding_window),
        ):
            if not layers:
                continue
            kv_form = PagedKVForm(form, layers, blocks, u, kv_shapes, window, self.index, dtype, device)
            self.kv_forms.append(kv_form)
            self.kv_form_of_layer.update(dict.fromkeys(layers, kv_form))
        self.linear: LinearCheckpointForm | None = None
        linear_layers = layout.layers_of("linear_attention")
        if linear_layers:
            conv_shape, rec_shape = layout.linear_state_shapes[linear_layers[0]]
            slots = 2 if config.tail_replay == "only" else config.linear_checkpoints  # only the sentinel and one slot
            self.linear = LinearCheckpointForm(linear_layers, slots, u, conv_shape, rec_shape, self.index, device)
        self.compressed_specs = dict(layout.compressed_state_specs)
        self.compressed: CompressedKVForm | None = None
        self.tail: UncompressedTailForm | None = None
        self.indexer: IndexerStateForm | None = None
        if self.compressed_specs:
            specs = self.compressed_specs
            self.compressed = CompressedKVForm(specs, config.compressed_blocks, u, self.index, device)
            self.tail = UncompressedTailForm(specs, config.tail_slots, u, self.index, device)
            if any(spec.indexer is not None for spec in specs.values()):
                self.indexer = IndexerStateForm(specs, config.compressed_blocks, config.tail_slots, u, self.index, device)
        forms: list[CacheForm] = list(self.kv_forms)
        forms += [f for f in (self.compressed, self.tail, self.indexer, self.linear) if f is not None]
        self.forms: tuple[CacheForm, ...] = tuple(forms)
        self._check_specs()
        self.stored_revision = layout.revision
        """The weights every stored object was computed with (a stamp of the writer)."""
        self.stored_kernel_abi = KERNEL_ABI
        """The reader interface the stored objects were written for."""
        self.contracts = {
            t.name: KernelContract(
                layout=LayoutFingerprint.of(t.tensor, axis_order=t.axis_order, kernel_abi=KERNEL_ABI, model_revision=layout.revision),
                vector_bytes=t.vector_bytes,
            )
            for f in self.forms
            for t in f.stored_tensors()
        }
        """What the readers of each pool tensor were built for (this model's layout)."""
        self._reported: set[str] = set()
        self._validated: tuple[tuple[object, ...], dict[Form, ValidationFailure]] | None = None
        self.has_checkpoint_forms = needs_checkpoints(self.pool_specs)
        """Whether some form resumes only at stored checkpoints (recurrent state, or rows of a
        compressor's tail or indexer): then resume points are the checkpoint positions, not
        every U boundary."""
        self.checkpoints_inside_chunks = self.linear is not None and self.tail is None and self.indexer is None and self.compressed is None
        """Whether a prefill chunk may run past a checkpoint position, the checkpoint taken inside
        it (:meth:`PagedSequence.begin_chunk <engine.cache.sequence.PagedSequence.begin_chunk>`):
        the recurrent state is the only checkpointed state, and the linear layers hand it over at
        each such position. A compressor's tail and indexer rows exist only at a chunk's end, so
        with compressed forms chunks still end at every checkpoint position."""

    def _check_specs(self) -> None:
        if [f.form for f in self.forms] != list(self.pool_specs):
            raise RuntimeError(f"forms {[f.form for f in self.forms]} differ from their specs {list(self.pool_specs)}")
        for f in self.forms:
            live = [(p.name, b) for p, b in zip(f.pools, _live_block_bytes(f), strict=True)]
            spec = [(p.name, p.bytes_per_block) for p in self.pool_specs[f.form]]
            if live != spec:
                raise RuntimeError(f"{f.form}: pools {live} (name, bytes per block) differ from the spec {spec}")
            if isinstance(f, UncompressedTailForm | IndexerStateForm) and f.slots.keeps_rows != self.pool_specs[f.form][-1].checkpointed:
                raise RuntimeError(f"{f.form}: the spec disagrees on whether its slots keep rows")

    # -- the pools -------------------------------------------------------------------------------
    def pools(self) -> Iterator[BlockPool]:
        """Every device pool, form by form."""
        return (p for f in self.forms for p in f.pools)

    def entry_groups(self) -> list[EntryPages]:
        """The entry-page groups: every ``compressed_kv`` geometry, then every indexer key one."""
        out = list(self.compressed.groups) if self.compressed is not None else []
        if self.indexer is not None:
            out += self.indexer.keys
        return out

    def pools_with_specs(self) -> list[tuple[PoolSpec, BlockPool]]:
        """Every pool once with its spec, grouped by :class:`PoolKind` (KV pages, window pages,
        entry pages of ``compressed_kv`` then of the indexer, slots of the tail then of the
        indexer, checkpoints)."""
        kinds = list(PoolKind)
        pairs = [(s, pool) for f in self.forms for s, pool in zip(self.pool_specs[f.form], f.pools, strict=True)]
        return sorted(pairs, key=lambda pair: kinds.index(pair[0].kind))

    def pool_entries(self) -> list[PoolEntry]:
        """:meth:`pools_with_specs` as named rows."""
        return [PoolEntry(s.form, pool, s.kind, s.bytes_per_block, s.page_tokens) for s, pool in self.pools_with_specs()]

    def limit_cached(self, form: Form, max_cached_blocks: int | None) -> int:
        """Cap the evictable pages the paged pool of ``form`` (``full_kv`` or ``swa_window``) keeps
        cached (None lifts the cap): :meth:`BlockPool.limit_cached`. Returns the pages evicted now.

        Raises:
            ValueError: the model has no paged pool for ``form``, or a negative cap.
        """
        pools = [f.pool for f in self.kv_forms if f.form is form]
        if not pools:
            raise ValueError(f"this model has no paged {form} pool (it has: {', '.join(f.form for f in self.kv_forms) or 'none'})")
        return sum(pool.limit_cached(max_cached_blocks) for pool in pools)

    def inject_eviction(self, plan: ResumePlan, hashes: Sequence[BlockHash]) -> None:
        """Fault ``evict_between_check_and_use``: invalidate the deepest page the plan matched
        in the first page-based form (as another thread evicting it between lookup and lease)."""
        resume = plan.resume_tokens - plan.replayed_tokens
        if not resume or not self.kv_forms:
            return
        form = self.kv_forms[0]
        block = form.pool.lookup(hashes[resume // self.unit_tokens - 1])
        if block is not None:
            form.pool.invalidate(block)

    def lose_shard(self, form: Form, hashes: Sequence[BlockHash]) -> None:
        """Fault ``lose_shard``: withdraw every published object of ``form`` that one of
        ``hashes`` names (as if this rank's shard of it were lost)."""
        for f in self.forms:
            if f.form != form:
                continue
            for pool in f.pools:
                for h in hashes:
                    block = pool.lookup(h)
                    if block is not None:
                        pool.invalidate(block)

    # -- what each form is -----------------------------------------------------------------------
    def resume_granularity(self) -> dict[Form, int]:
        """The coarsest spacing (tokens) between positions each form can resume at."""
        return {form: spec.granularity_tokens for form, spec in form_specs(self.pool_specs, self.config).items()}

    def form_specs(self) -> dict[Form, FormSpec]:
        """One frozen spec per form: its resume granularity and rule, its pools, how it
        recovers, and the layout fingerprint of every stored tensor (what validation layer 2
        compares)."""
        fingerprints = {f.form: [(t.name, self.contracts[t.name].layout) for t in f.stored_tensors()] for f in self.forms}
        return form_specs(self.pool_specs, self.config, fingerprints)

    def missing_reasons(self) -> dict[Form, Reason]:
        """Per form, the reason it reports when a lower tier had to supply its device copy."""
        return {form: spec.missing_reason for form, spec in form_specs(self.pool_specs, self.config).items()}

    def checkpoint_positions(self, plan: ResumePlan) -> frozenset[int]:
        """Where a request prefilling ``[L*, T)`` takes recurrent checkpoints: every multiple of
        the checkpoint interval, the last U boundary strictly before the prompt end (where a
        repeat of the prompt resumes), the prompt end itself when it is a U boundary (where a
        longer follow-up resumes), and the junction where the matched prefix ends when L* fell
        short of it (a sibling sharing that prefix then resumes there: case C1)."""
        start = plan.resume_tokens
        limit = resume_limit(plan.prompt_tokens, self.unit_tokens)
        interval = self.config.checkpoint_interval_tokens
        positions = set(range(start - start % interval + interval, limit + 1, interval))
        end = plan.prompt_tokens
        if end % self.unit_tokens == 0:
            positions.add(end)  # the state after the whole prompt: where a longer follow-up resumes
        for p in (limit, min(plan.hash_hit_tokens, limit)):
            if p > start:
                positions.add(p)
        return frozenset(positions)

    def window_pages_needed(self, window_tokens: int, max_tokens: int) -> int:
        """Most pages one request can hold in a window pool (:func:`memory_plan.window_pages_needed`)."""
        return window_pages_needed(self.config, window_tokens, max_tokens)

    # -- the device view -------------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The prompt's hash chain, one hash per full block of U tokens."""
        return chain_hashes(self.root, token_ids, self.unit_tokens)

    def hash_hit_tokens(self, hashes: Sequence[BlockHash]) -> int:
        """Length of the longest prefix some form (or tier) still holds; 0 with caching off."""
        return self.index.hit_blocks(hashes) * self.unit_tokens if self.config.enable_prefix_caching else 0

    def failure_reasons(self, vetoes: Mapping[Form, Reason] | None) -> dict[Form, Reason]:
        """The forms that must not resume: validation failures, then ``vetoes`` (which win)."""
        return {form: failure.reason for form, failure in self.validation_failures().items()} | dict(vetoes or {})

    def resumable(self, reasons: Mapping[Form, Reason]) -> list[ResumableForm]:
        """Every form in order, those in ``reasons`` replaced by a :class:`Vetoed` one."""
        return [Vetoed(f.form, reasons[f.form]) if f.form in reasons else f for f in self.forms]

    def pool_versions(self) -> tuple[tuple[Form, tuple[int, ...]], ...]:
        """Each form's pool versions now (what ``start`` re-checks against a plan)."""
        return tuple((f.form, tuple(p.version for p in f.pools)) for f in self.forms)

    def validation_failures(self) -> dict[Form, ValidationFailure]:
        """Per form, the first stored tensor that breaks its reader's kernel contract (layer 2:
        dtype, block shape, axis order, kernel ABI, model revision) or alignment (layer 4: byte
        offsets and strides against the vector width). Memoised until a tensor, the stored
        revision or the ABI changes.

        Raises:
            RuntimeError: a pool tensor without a kernel contract (an internal invariant).
        """
        declared = [(f, f.stored_tensors()) for f in self.forms]
        key = (
            self.stored_revision,
            self.stored_kernel_abi,
            *((t.name, t.tensor.data_ptr(), t.tensor.dtype, t.tensor.shape, t.tensor.stride()) for _, ts in declared for t in ts),
        )
        if self._validated is not None and self._validated[0] == key:
            return self._validated[1]  # nothing a reader depends on changed since the last check
        out: dict[Form, ValidationFailure] = {}
        for f, tensors in declared:
            for t in tensors:
                contract = self.contracts.get(t.name)
                if contract is None:
                    raise RuntimeError(f"{t.name}: a pool tensor without a kernel contract")
                stored = LayoutFingerprint.of(
                    t.tensor, axis_order=t.axis_order, kernel_abi=self.stored_kernel_abi, model_revision=self.stored_revision
                )
                failure = check_kernel_contract(stored, contract) or check_alignment(t.tensor, contract)
                if failure is not None:
                    if t.name not in self._reported:
                        self._reported.add(t.name)
                        log.warning("%s: stored blocks cannot be reused: %s", t.name, failure)
                    out[f.form] = failure
                    break
        self._validated = (key, out)
        return out
