"""What a layer reads and writes besides its weights: the per-sequence state protocol.

The model code is the same for the reference path (``LLM.prefill_logits``: a dense state built
from nothing) and for the cached path (a paged state whose KV lives in the cache pools and whose
recurrent state was restored from a checkpoint). Layers only see this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor


class AttentionKV(NamedTuple):
    """Keys and values a query chunk may attend to, with their absolute positions.

    keys, values: ``[S, H_kv, D]``; positions: ``[S]`` (int64), ascending.
    """

    keys: Tensor
    values: Tensor
    positions: Tensor


@dataclass(slots=True)
class LinearLayerState:
    """State of one Gated DeltaNet layer for one sequence.

    conv: ``[C_conv, K - 1]`` — the last K−1 inputs of the short causal conv, oldest first.
    recurrent: ``[H_v, D_k, D_v]`` — the delta-rule state matrix per value head (float32).
    """

    conv: Tensor
    recurrent: Tensor

    def clone(self) -> LinearLayerState:
        """An independent copy (no storage shared with this state)."""
        return LinearLayerState(self.conv.clone(), self.recurrent.clone())


class SequenceState(Protocol):
    """Per-sequence state the layers read and write during one forward chunk."""

    def attention_kv(self, layer: int, positions: Tensor, keys: Tensor, values: Tensor) -> AttentionKV:
        """Store the chunk's ``keys/values [T, H_kv, D]`` at ``positions [T]`` and return every
        key/value the chunk's queries may need (at least the layer's window before the chunk)."""
        ...

    def linear(self, layer: int) -> LinearLayerState:
        """The recurrent state of a linear layer; the layer replaces its fields in place."""
        ...


class DenseState:
    """A cache-free state: KV appended to plain tensors, recurrent state from zeros.

    Used by the reference path and by tests; it never touches a cache pool.
    """

    def __init__(self, linear_shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]], device: torch.device) -> None:
        self._kv: dict[int, AttentionKV] = {}
        self._linear = {
            layer: LinearLayerState(
                torch.zeros(conv_shape, dtype=torch.float32, device=device),
                torch.zeros(rec_shape, dtype=torch.float32, device=device),
            )
            for layer, (conv_shape, rec_shape) in linear_shapes.items()
        }

    def attention_kv(self, layer: int, positions: Tensor, keys: Tensor, values: Tensor) -> AttentionKV:
        prev = self._kv.get(layer)
        if prev is not None:
            keys = torch.cat((prev.keys, keys))
            values = torch.cat((prev.values, values))
            positions = torch.cat((prev.positions, positions))
        kv = AttentionKV(keys, values, positions)
        self._kv[layer] = kv
        return kv

    def linear(self, layer: int) -> LinearLayerState:
        return self._linear[layer]
