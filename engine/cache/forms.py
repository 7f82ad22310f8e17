"""Per-form stores and their resume rules (DESIGN.md §3).

Each form answers one question for the coordinator: *the longest resume point ≤ L at which this
form can resume exactly* (:meth:`resume_at_most`). The rules:

* ``full_kv`` — every page covering ``[0, L)`` is cached (scanned left to right);
* ``swa_window`` — the pages covering the window before L, ``[L − W + 1, L)``, are cached (older
  pages may be gone; scanned right to left);
* ``linear_state`` — a checkpoint of every linear layer taken exactly at L exists (scanned right
  to left); L = 0 needs none (the zero state).

The compressed forms (``compressed_kv``, ``uncompressed_tail``, ``indexer_state``) live in
:mod:`engine.cache.compressed`.

Both KV forms store pages of U tokens ``kv [num_blocks, n_layers, 2, U, H_kv, D]`` (keys at
index 0, values at 1; one such tensor per KV geometry, e.g. GQA sliding layers and the single
K = V row of CSA/HCA windows), one page id shared by every layer of the form; checkpoints store
``conv [num_slots, n_layers, C_conv, K − 1]`` and ``recurrent [num_slots, n_layers, H_v, D_k, D_v]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from engine.cache.block_pool import BlockPool
from engine.cache.hashing import BlockHash, PrefixIndex
from engine.events import Form, Reason
from engine.model.state import LinearLayerState

KERNEL_ABI = 1
"""Version of the interface between stored blocks and the code that reads them (attention over
pages, compressor restore, recurrent-state restore); bumped whenever a reader changes how it
interprets a block. Stored objects carry the version they were written for (layer 2 of
validation compares it with the reader's)."""

VECTOR_BYTES = 16
"""Alignment the attention and compressor readers need (128-bit vector loads)."""


class PrefixScan:
    """How many of the first ``needed`` objects of a prefix one pool holds, counted from the
    start up to the first gap — memoised per hash chain (by identity) and pool version, because
    the coordinator's fixed point asks a downward-closed form several times per lookup. A count
    below what was scanned is final for any longer scan; otherwise it holds up to the scan."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._memo: tuple[Sequence[BlockHash], object, int, int] | None = None  # hashes, version, scanned, present

    def present(self, hashes: Sequence[BlockHash], needed: int, scan: Callable[[int], int]) -> int:
        """``min(present, needed)``, calling ``scan(needed)`` (the uncached count) only when the
        memo cannot answer."""
        memo = self._memo
        if memo is not None and memo[0] is hashes and memo[1] == self.pool.view_version and (memo[3] < memo[2] or needed <= memo[2]):
            return min(memo[3], needed)
        present = scan(needed)
        self._memo = (hashes, self.pool.view_version, needed, present)
        return present


class StoredTensor(NamedTuple):
    """One pool tensor ``[num_blocks, *block]`` of a form, as its writer laid it out: the axis
    names of a block and the vector width (bytes) the reading kernel loads it with."""

    name: str
    tensor: Tensor
    axis_order: tuple[str, ...]
    vector_bytes: int


Stamp = tuple[int | bytes | None, ...]
"""What an object records besides its hash: the boundary it ends at, the entries it continues."""


def _no_stamp(block: int) -> Stamp:
    return ()


def _set_no_stamp(block: int, stamp: Stamp) -> None:
    if stamp:
        raise RuntimeError(f"block {block}: a stamp {stamp!r} for a pool that keeps none")


class ObjectStore(NamedTuple):
    """One pool with the tensors its blocks index and its stamp accessors: what the host/disk
    tiers copy down and back (:mod:`engine.cache.tiers`)."""

    pool: BlockPool
    tensors: list[StoredTensor]
    stamp: Callable[[int], Stamp]
    set_stamp: Callable[[int, Stamp], None]


class PagedKVForm:
    """KV pages of one group of attention layers: ``full_kv`` (window None) or ``swa_window``."""

    def __init__(
        self,
        form: Form,
        layers: tuple[int, ...],
        num_blocks: int,
        unit_tokens: int,
        kv_shapes: dict[int, tuple[int, int]],
        window: int | None,
        index: PrefixIndex,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.form = form
        self.evicted_reason = Reason.SWA_EVICTED if window is not None else Reason.KV_EVICTED
        self.downward_closed = window is None  # a prefix of pages: the same loss reason at every point
        self.layers = layers
        self.unit_tokens = unit_tokens
        self.window = window
        self.pool = BlockPool(form.value, num_blocks, index.add, index.remove)
        self.pools = (self.pool,)
        self.scan = PrefixScan(self.pool)
        # one tensor per KV geometry, all indexed by the same page id
        self.kv_groups: dict[tuple[int, int], Tensor] = {}
        self.layer_slot: dict[int, tuple[Tensor, int]] = {}
        for shape in dict.fromkeys(kv_shapes[layer] for layer in layers):
            members = [layer for layer in layers if kv_shapes[layer] == shape]
            kv = torch.zeros((num_blocks, len(members), 2, unit_tokens, *shape), dtype=dtype, device=device)
            self.kv_groups[shape] = kv
            self.layer_slot.update({layer: (kv, i) for i, layer in enumerate(members)})

    @property
    def bytes_per_block(self) -> int:
        return sum(kv[0].numel() * kv.element_size() for kv in self.kv_groups.values())

    def stored_tensors(self) -> list[StoredTensor]:
        axes = ("layer", "kv", "token", "head", "dim")
        return [StoredTensor(f"{self.form}[{h}x{d}]", kv, axes, VECTOR_BYTES) for (h, d), kv in self.kv_groups.items()]

    def epoch_at(self, hashes: Sequence[BlockHash], resume_tokens: int) -> int:
        """Epoch of the page ending at ``resume_tokens`` (0 at 0 or when absent)."""
        if resume_tokens == 0:
            return 0
        block = self.pool.lookup(hashes[resume_tokens // self.unit_tokens - 1])
        return self.pool.epoch[block] if block is not None else 0

    def needed_keys(self, hashes: Sequence[BlockHash], resume_tokens: int) -> list[tuple[BlockPool, BlockHash]]:
        """(pool, hash) of every object a resume at ``resume_tokens`` reads."""
        return [(self.pool, hashes[p]) for p in self.needed_pages(resume_tokens)]

    def stores(self) -> list[ObjectStore]:
        return [ObjectStore(self.pool, self.stored_tensors(), _no_stamp, _set_no_stamp)]

    def first_needed_token(self, resume_tokens: int) -> int:
        """The oldest token whose KV a query at position ``resume_tokens`` reads."""
        if self.window is None:
            return 0
        return max(0, resume_tokens - self.window + 1)

    def needed_pages(self, resume_tokens: int) -> range:
        """Page indices that must be cached to resume at ``resume_tokens`` (a multiple of U)."""
        return range(self.first_needed_token(resume_tokens) // self.unit_tokens, resume_tokens // self.unit_tokens)

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        """Largest multiple of U ≤ ``limit_tokens`` at which every needed page is cached."""
        u = self.unit_tokens
        if self.window is None:
            def scan(needed: int) -> int:
                found = list(map(self.pool.presence(), hashes[:needed]))
                return found.index(False) if False in found else len(found)

            return self.scan.present(hashes, limit_tokens // u, scan) * u
        for cand in range(limit_tokens - limit_tokens % u, 0, -u):
            if all(self.pool.present(hashes[p]) for p in self.needed_pages(cand)):
                return cand
        return 0

    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int) -> Reason:
        """Why this form cannot resume at ``resume_tokens``: every page it lacks there was stored
        and evicted (``kv_evicted`` / ``swa_evicted``: the point was a stored one), or one was
        never stored — the window form stores pages only behind recurrent checkpoints, so a point
        between them is ``below_granularity``. Newest pages first (a never-stored one ends it)."""
        pool = self.pool
        for p in reversed(self.needed_pages(resume_tokens)):
            h = hashes[p]
            if not pool.present(h) and not pool.was_evicted(h):
                return Reason.BELOW_GRANULARITY
        return self.evicted_reason


class LinearCheckpointForm:
    """Checkpoints of the conv and recurrent state of every ``linear_attention`` layer, keyed by
    the hash of the prefix they summarise (the block ending at the checkpoint)."""

    form = Form.LINEAR_STATE
    downward_closed = False  # one checkpoint per point

    def __init__(
        self,
        layers: tuple[int, ...],
        num_slots: int,
        unit_tokens: int,
        conv_shape: tuple[int, ...],
        recurrent_shape: tuple[int, ...],
        index: PrefixIndex,
        device: torch.device,
    ) -> None:
        self.layers = layers
        self.unit_tokens = unit_tokens
        self.pool = BlockPool(self.form.value, num_slots, index.add, index.remove)
        self.pools = (self.pool,)
        self.conv = torch.zeros((num_slots, len(layers), *conv_shape), dtype=torch.float32, device=device)
        self.recurrent = torch.zeros((num_slots, len(layers), *recurrent_shape), dtype=torch.float32, device=device)

    @property
    def bytes_per_block(self) -> int:
        return (self.conv[0].numel() + self.recurrent[0].numel()) * 4

    def stored_tensors(self) -> list[StoredTensor]:
        # the conv window (K − 1 = 3 values per channel) is read element by element
        return [
            StoredTensor("linear_state.conv", self.conv, ("layer", "channel", "tap"), self.conv.element_size()),
            StoredTensor("linear_state.recurrent", self.recurrent, ("layer", "head", "key", "value"), VECTOR_BYTES),
        ]

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        """Largest multiple of U ≤ ``limit_tokens`` with a checkpoint exactly there (or 0)."""
        u = self.unit_tokens
        for cand in range(limit_tokens - limit_tokens % u, 0, -u):
            if self.pool.present(hashes[cand // u - 1]):
                return cand
        return 0

    def needed_keys(self, hashes: Sequence[BlockHash], resume_tokens: int) -> list[tuple[BlockPool, BlockHash]]:
        """(pool, hash) of the checkpoint a resume at ``resume_tokens`` reads (none at 0)."""
        return [(self.pool, hashes[resume_tokens // self.unit_tokens - 1])] if resume_tokens else []

    def stores(self) -> list[ObjectStore]:
        return [ObjectStore(self.pool, self.stored_tensors(), _no_stamp, _set_no_stamp)]

    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int) -> Reason:
        """No checkpoint at ``resume_tokens``: evicted or never taken, it is missing (case C1)."""
        return Reason.LINEAR_CHECKPOINT_MISSING

    def left_device_between(self, hashes: Sequence[BlockHash], low: int, high: int) -> bool:
        """Whether a checkpoint at some multiple of U in (``low``, ``high``] was taken and left
        the device (evicted, or held only by a lower tier) — as opposed to never taken."""
        u = self.unit_tokens
        return any(self.pool.was_evicted(hashes[p // u - 1]) for p in range(low + u, high + 1, u))

    def epoch_at(self, hashes: Sequence[BlockHash], resume_tokens: int) -> int:
        """Epoch of the checkpoint at ``resume_tokens`` (0 at 0 or when absent)."""
        slot = self.checkpoint_at(hashes, resume_tokens)
        return self.pool.epoch[slot] if slot is not None else 0

    def checkpoint_at(self, hashes: Sequence[BlockHash], resume_tokens: int) -> int | None:
        """Slot of the checkpoint at ``resume_tokens`` (None at 0 or when absent)."""
        if resume_tokens == 0:
            return None
        return self.pool.lookup(hashes[resume_tokens // self.unit_tokens - 1])

    def read(self, slot: int) -> dict[int, LinearLayerState]:
        """Copies of the checkpointed state, per model layer."""
        return {
            layer: LinearLayerState(self.conv[slot, i], self.recurrent[slot, i]).clone()
            for i, layer in enumerate(self.layers)
        }

    def write(self, slot: int, states: dict[int, LinearLayerState]) -> None:
        for i, layer in enumerate(self.layers):
            self.conv[slot, i].copy_(states[layer].conv)
            self.recurrent[slot, i].copy_(states[layer].recurrent)

    def zero_state(self) -> dict[int, LinearLayerState]:
        return {
            layer: LinearLayerState(torch.zeros_like(self.conv[0, i]), torch.zeros_like(self.recurrent[0, i]))
            for i, layer in enumerate(self.layers)
        }


def gather_pages(kv: Tensor, pages: Tensor, slot: int, first_token: int, num_tokens: int) -> tuple[Tensor, Tensor]:
    """Keys and values ``[num_tokens, H_kv, D]`` of one layer, read through a page list.

    ``pages [P]`` lists the pages in token order; ``first_token`` is the offset of the first wanted
    token inside ``pages[0]``.
    """
    g = kv[pages, slot]  # [P, 2, U, H, D]
    h, d = g.shape[-2], g.shape[-1]
    keys = g[:, 0].reshape(-1, h, d)[first_token : first_token + num_tokens]
    values = g[:, 1].reshape(-1, h, d)[first_token : first_token + num_tokens]
    return keys, values
