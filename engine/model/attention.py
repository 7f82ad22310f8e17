"""Softmax attention layers: ``full_attention`` and ``sliding_attention`` (GQA + RoPE).

For a query at position p the layer attends to keys at positions k with k ≤ p and, for a
sliding layer with window W, p − k < W (the current token plus the W − 1 before it, as in
Mistral / transformers' ``sliding_window``).
"""

from __future__ import annotations

from torch import Tensor, nn

from engine.config import HybridConfig
from engine.model import kernel_backend as kb
from engine.model.causal_attention import attention_mask, causal_attention
from engine.model.decode_batch import DecodeBatch, paged_decode
from engine.model.layers import apply_rotary
from engine.model.state import SequenceState

__all__ = ["Attention", "attention_mask"]


class Attention(nn.Module):
    """Grouped-query attention (Ainslie et al. 2023) with rotary embeddings.

    forward: ``x [T, C]``, ``positions [T]``, rotary tables ``[T, D]`` → ``[T, C]``. With the
    Triton backend the scores run in the paged kernels over the layer's pages.
    """

    kernel_backend: kb.KernelBackend = "torch"

    def __init__(self, config: HybridConfig, layer: int, window: int | None) -> None:
        super().__init__()
        self.layer = layer
        self.window = window
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        c = config.hidden_size
        self.q_proj = nn.Linear(c, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c, bias=False)

    def forward(self, x: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor], state: SequenceState | DecodeBatch) -> Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if isinstance(state, DecodeBatch):
            out = paged_decode(q, state.write_kv(self.layer, k, v), scale=self.head_dim**-0.5, window=self.window, backend=self.kernel_backend)
            return self.o_proj(out.reshape(t, -1))
        if self.kernel_backend == "triton":
            pages = state.attention_pages(self.layer, positions, k, v)
            out = kb.paged_attention(q, pages, scale=self.head_dim**-0.5, window=self.window)
            return self.o_proj(out.reshape(t, -1))
        kv = state.attention_kv(self.layer, positions, k, v)
        out = causal_attention(q, kv.keys, kv.values, positions, kv.positions, scale=self.head_dim**-0.5, window=self.window)
        return self.o_proj(out.reshape(t, -1))
