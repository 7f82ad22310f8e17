"""Per-form stores and their resume rules (DESIGN.md §3).

Each form answers one question for the coordinator: *the longest resume point ≤ L at which this
form can resume exactly* (:meth:`resume_at_most`). The rules:

* ``full_kv`` — every page covering ``[0, L)`` is cached (scanned left to right);
* ``swa_window`` — the pages covering the window before L, ``[L − W + 1, L)``, are cached (older
  pages may be gone; scanned right to left);
* ``linear_state`` — a checkpoint of every linear layer taken exactly at L exists (scanned right
  to left); L = 0 needs none (the zero state).

Both KV forms store pages of U tokens ``kv [num_blocks, n_layers, 2, U, H_kv, D]`` (keys at
index 0, values at 1), one page id shared by every layer of the group; checkpoints store
``conv [num_slots, n_layers, C_conv, K − 1]`` and ``recurrent [num_slots, n_layers, H_v, D_k, D_v]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from engine.cache.block_pool import BlockPool
from engine.cache.hashing import BlockHash, PrefixIndex
from engine.events import Form, Reason
from engine.model.state import CompressedLayerState, CompressorState, LinearLayerState


class PagedKVForm:
    """KV pages of one group of attention layers: ``full_kv`` (window None) or ``swa_window``."""

    def __init__(
        self,
        form: Form,
        layers: tuple[int, ...],
        num_blocks: int,
        unit_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        window: int | None,
        index: PrefixIndex,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.form = form
        self.evicted_reason = Reason.SWA_EVICTED if window is not None else Reason.KV_EVICTED
        self.layers = layers
        self.layer_slot = {layer: i for i, layer in enumerate(layers)}
        self.unit_tokens = unit_tokens
        self.window = window
        self.pool = BlockPool(form.value, num_blocks, index.add, index.remove)
        self.kv = torch.zeros(
            (num_blocks, len(layers), 2, unit_tokens, num_kv_heads, head_dim), dtype=dtype, device=device
        )

    @property
    def bytes_per_block(self) -> int:
        return self.kv[0].numel() * self.kv.element_size()

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
            n = 0
            for h in hashes[: limit_tokens // u]:
                if self.pool.lookup(h) is None:
                    break
                n += 1
            return n * u
        for cand in range(limit_tokens - limit_tokens % u, 0, -u):
            if all(self.pool.lookup(hashes[p]) is not None for p in self.needed_pages(cand)):
                return cand
        return 0


    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int) -> Reason:
        """Why this form cannot resume at ``resume_tokens``: a page it needs there was evicted
        (``kv_evicted`` / ``swa_evicted``), or was never stored — the window form stores pages
        only behind recurrent checkpoints, so a point between them is ``below_granularity``."""
        missing = [hashes[p] for p in self.needed_pages(resume_tokens) if self.pool.lookup(hashes[p]) is None]
        if not missing or any(self.pool.was_evicted(h) for h in missing):
            return self.evicted_reason
        return Reason.BELOW_GRANULARITY


class LinearCheckpointForm:
    """Checkpoints of the conv and recurrent state of every ``linear_attention`` layer, keyed by
    the hash of the prefix they summarise (the block ending at the checkpoint)."""

    form = Form.LINEAR_STATE

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
        self.conv = torch.zeros((num_slots, len(layers), *conv_shape), dtype=torch.float32, device=device)
        self.recurrent = torch.zeros((num_slots, len(layers), *recurrent_shape), dtype=torch.float32, device=device)

    @property
    def bytes_per_block(self) -> int:
        return (self.conv[0].numel() + self.recurrent[0].numel()) * 4

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        """Largest multiple of U ≤ ``limit_tokens`` with a checkpoint exactly there (or 0)."""
        u = self.unit_tokens
        for cand in range(limit_tokens - limit_tokens % u, 0, -u):
            if self.pool.lookup(hashes[cand // u - 1]) is not None:
                return cand
        return 0

    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int) -> Reason:
        """No checkpoint at ``resume_tokens``: evicted or never taken, it is missing."""
        return Reason.LINEAR_CHECKPOINT_MISSING

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


class CompressedSnapshotForm:
    """Snapshots of every compressed (CSA/HCA) layer's whole state at one boundary — its window
    rows, compressed entries, uncompressed tail and indexer — keyed by the hash of the prefix
    they summarise, taken where recurrent checkpoints are taken.

    A snapshot carries all three compressed objects of DESIGN.md §3 together, at the same
    boundary version by construction, so the index can never lag the KV nor the tail miss; it is
    reported as the ``compressed_kv`` form. Its size grows with the prefix (the entries are
    copied into every snapshot), so slots hold tensors of any length rather than fixed pages.
    """

    form = Form.COMPRESSED_KV

    def __init__(self, layers: tuple[int, ...], num_slots: int, unit_tokens: int, index: PrefixIndex) -> None:
        self.layers = layers
        self.unit_tokens = unit_tokens
        self.pool = BlockPool(self.form.value, num_slots, index.add, index.remove)
        self.slots: list[dict[int, CompressedLayerState] | None] = [None] * num_slots

    @property
    def bytes_per_block(self) -> int:
        """Mean bytes of the stored snapshots (they differ in size)."""
        held = [s for s in self.slots if s is not None]
        return sum(snapshot_bytes(s) for s in held) // len(held) if held else 0

    def resume_at_most(self, hashes: Sequence[BlockHash], limit_tokens: int) -> int:
        """Largest multiple of U ≤ ``limit_tokens`` with a snapshot exactly there (or 0)."""
        u = self.unit_tokens
        for cand in range(limit_tokens - limit_tokens % u, 0, -u):
            if self.pool.lookup(hashes[cand // u - 1]) is not None:
                return cand
        return 0

    def loss_reason(self, hashes: Sequence[BlockHash], resume_tokens: int) -> Reason:
        """``compressed_evicted`` if the snapshot there was evicted, else ``below_granularity``
        (snapshots exist only at checkpoint positions)."""
        if self.pool.was_evicted(hashes[resume_tokens // self.unit_tokens - 1]):
            return Reason.COMPRESSED_EVICTED
        return Reason.BELOW_GRANULARITY

    def read(self, slot: int) -> dict[int, CompressedLayerState]:
        snapshot = self.slots[slot]
        if snapshot is None:
            raise RuntimeError(f"compressed_kv: slot {slot} is leased but holds no snapshot")
        return {layer: state.clone() for layer, state in snapshot.items()}

    def write(self, slot: int, states: dict[int, CompressedLayerState]) -> None:
        missing = set(self.layers) - set(states)
        if missing:
            raise RuntimeError(f"compressed_kv: no state for layers {sorted(missing)} at a snapshot")
        self.slots[slot] = {layer: states[layer].clone() for layer in self.layers}


def snapshot_bytes(snapshot: dict[int, CompressedLayerState]) -> int:
    total = 0
    for state in snapshot.values():
        parts = [state.window_kv, *vars_of(state.compressor)]
        if state.indexer is not None:
            parts.extend(vars_of(state.indexer))
        total += sum(t.numel() * t.element_size() for t in parts)
    return total


def vars_of(state: CompressorState) -> tuple[Tensor, ...]:
    return (state.entries, state.pending_kv, state.pending_gate, state.prev_kv, state.prev_gate)


CacheForm = PagedKVForm | LinearCheckpointForm | CompressedSnapshotForm


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
