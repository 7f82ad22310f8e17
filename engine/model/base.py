"""What the engine needs of a model family: its layout (for the cache) and one forward signature.

Every family (``kvscope_hybrid``, ``qwen3_next``, ``deepseek_v4``) is an ``nn.Module`` that
implements :class:`CausalLM`; the prefix cache sizes its pools from :class:`ModelLayout` alone,
so it never depends on a family's config class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from engine.model.state import CompressedLayerSpec, DenseState, PackedStates, SequenceState

WINDOW_KINDS = frozenset({"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"})
"""Layer kinds whose attention reads a sliding window of KV rows."""

StateShapes = tuple[tuple[int, ...], tuple[int, ...]]
"""(conv state shape, recurrent state shape) of one linear-attention layer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelLayout:
    """The per-sequence state a model keeps, layer by layer.

    Attributes:
        model_type: the family (``config.json``'s ``model_type``).
        revision: names the weights; part of every prefix hash, so two revisions never share.
        vocab_size: logits width.
        layer_types: one kind per layer (DESIGN.md §3 names).
        num_kv_heads, kv_head_dim: the KV geometry attention layers store (H_kv, D), unless
            ``kv_geometry`` names another for a layer.
        sliding_window: W of every layer that keeps a window — ``sliding_attention`` and the
            local branch of CSA/HCA layers (None without such layers).
        linear_state_shapes: per ``linear_attention`` layer index, its state shapes.
        compressed_state_specs: per CSA/HCA layer index, the geometry of the state it keeps
            besides its window (compressed entries, uncompressed tail, indexer).
        kv_geometry: per attention layer index, (H_kv, D) where it differs from
            (``num_kv_heads``, ``kv_head_dim``) — e.g. the single shared K = V row of a CSA/HCA
            layer's window in a model whose other attention layers are GQA.
    """

    model_type: str
    revision: str
    vocab_size: int
    layer_types: tuple[str, ...]
    num_kv_heads: int
    kv_head_dim: int
    sliding_window: int | None
    linear_state_shapes: Mapping[int, StateShapes] = field(default_factory=dict)
    compressed_state_specs: Mapping[int, CompressedLayerSpec] = field(default_factory=dict)
    kv_geometry: Mapping[int, tuple[int, int]] = field(default_factory=dict)

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(H_kv, D) of the KV rows an attention layer stores."""
        return self.kv_geometry.get(layer, (self.num_kv_heads, self.kv_head_dim))

    @property
    def window_layers(self) -> tuple[int, ...]:
        """Layers that keep a window of KV rows (``swa_window``): sliding and CSA/HCA layers."""
        return tuple(i for i, k in enumerate(self.layer_types) if k in WINDOW_KINDS)

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers of one kind, in model order."""
        return tuple(i for i, k in enumerate(self.layer_types) if k == kind)


class CausalLM(nn.Module):
    """Base class of every model family the engine runs.

    ``forward(input_ids [T], positions [T], state)`` returns float32 logits ``[T, vocab]`` and
    updates ``state`` (KV, recurrent and compressor state) in place; with a
    :class:`~engine.model.state.PackedStates` the T tokens are several sequences' chunks packed
    in order (continuous batching); parameter names follow the
    family's reference implementation so checkpoints load as they are.
    """

    def attach_lm_head(self, hidden_size: int, vocab_size: int, embed_tokens: nn.Embedding, tie: bool) -> None:
        """``self.lm_head [vocab, hidden]``, sharing the input embedding's weight when ``tie``
        (recorded in ``self.tied_weights`` for the loader: lm_head → embed_tokens)."""
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.tied_weights: dict[str, str] = {}
        if tie:
            self.lm_head.weight = embed_tokens.weight
            self.tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}

    float32_names: tuple[str, ...] = ()
    """Name endings of parameters and buffers kept in float32 whatever the model's dtype (a
    family's numerically sensitive weights, as transformers' ``_keep_in_fp32_modules``)."""

    def to_dtype(self, dtype: torch.dtype) -> CausalLM:
        """``self.to(dtype)``, then the :attr:`float32_names` tensors back to float32; returns self."""
        self.to(dtype)
        for name, tensor in (*self.named_parameters(), *self.named_buffers()):
            if name.endswith(self.float32_names) and tensor.is_floating_point():
                tensor.data = tensor.data.to(torch.float32)
        return self

    def check_weights(self) -> None:
        """Called once every tensor is loaded: checks values the shapes cannot (a routing table's
        range). Raises ``ValueError`` naming the tensor."""

    @property
    def layout(self) -> ModelLayout:
        raise NotImplementedError

    def new_dense_state(self) -> DenseState:
        """A cache-free state for the reference path (``LLM.prefill_logits``)."""
        raise NotImplementedError

    def init_random(self, seed: int) -> None:
        """Deterministic random weights (tests and untrained presets)."""
        raise NotImplementedError

    def forward(self, input_ids: Tensor, positions: Tensor, state: SequenceState | PackedStates) -> Tensor:
        raise NotImplementedError
