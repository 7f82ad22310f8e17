"""The mixers of a Qwen3-Next layer: gated softmax attention and Gated DeltaNet, with the two
norms they use. Parameter names and numerics follow transformers' ``modeling_qwen3_next``.

Shapes: T tokens of one sequence, C hidden size, H query heads, H_kv KV heads, D head dim,
R rotary dims (R ≤ D), H_k / H_v linear key / value heads, D_k / D_v their head dims,
r = H_v / H_k value heads per key head, K conv kernel width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.model import kernel_backend as kb
from engine.model.causal_attention import causal_attention
from engine.model.decode_batch import DecodeBatch, paged_decode
from engine.model.gated_deltanet import GatedDeltaNetBase, gated_rms_norm
from engine.model.layers import apply_rotary
from engine.model.qwen3_next_config import Qwen3NextConfig
from engine.model.state import SequenceState


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from one (Qwen3-Next's "zero-centred",
    weight-decay friendly norm): ``y = x / sqrt(mean(x²) + eps) · (1 + w)``, in float32 and cast
    back to x's dtype. x is ``[..., N]``; ``weight [N]`` starts at zeros."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The output norm of Gated DeltaNet, :func:`~engine.model.gated_deltanet.gated_rms_norm`,
    holding its ``weight [D_v]`` (starts at ones: a plain weight, not zero-centred). x and z are
    ``[..., D_v]``."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


def apply_partial_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first R dims of ``x [T, H, D]`` by the tables ``cos, sin [T, R]`` (rotate-half
    convention within those R dims); dims R … D−1 pass through unchanged."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat((apply_rotary(x[..., :r], cos, sin), x[..., r:]), dim=-1)


class Qwen3NextAttention(nn.Module):
    """``full_attention``: grouped-query softmax attention with a sigmoid output gate, per-head
    zero-centred RMSNorm on queries and keys, and partial RoPE (Qwen3-Next; the gate is the
    "gated attention" of Qiu et al., 2025).

    ``q_proj`` yields ``2·D`` values per head: the query (first D) and its gate (last D). The keys
    handed to :meth:`SequenceState.attention_kv` — what the cache stores — are taken after
    ``k_norm`` and RoPE. forward: ``x [T, C]``, ``positions [T]``, rotary tables ``[T, R]`` →
    ``[T, C]``.
    """

    kernel_backend: kb.KernelBackend = "torch"

    def __init__(self, config: Qwen3NextConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        c, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(c, self.num_heads * d * 2, bias=bias)
        self.k_proj = nn.Linear(c, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(c, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, c, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)

    def forward(self, x: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor], state: SequenceState | DecodeBatch) -> Tensor:
        t, d = x.shape[0], self.head_dim
        query_and_gate = self.q_proj(x).view(t, self.num_heads, 2 * d)
        q, gate = query_and_gate[..., :d], query_and_gate[..., d:]
        cos, sin = rope
        q = apply_partial_rotary(self.q_norm(q), cos, sin)
        k = apply_partial_rotary(self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, d)), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        if isinstance(state, DecodeBatch):
            decoded = paged_decode(q, state.write_kv(self.layer, k, v), scale=self.scale, window=None, backend=self.kernel_backend)
            out = decoded.reshape(t, self.num_heads * d)
        elif self.kernel_backend == "triton":
            pages = state.attention_pages(self.layer, positions, k, v)
            out = kb.paged_attention(q, pages, scale=self.scale, window=None).reshape(t, self.num_heads * d)
        else:
            kv = state.attention_kv(self.layer, positions, k, v)
            out = causal_attention(q, kv.keys, kv.values, positions, kv.positions, scale=self.scale).reshape(t, self.num_heads * d)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, self.num_heads * d)))


class Qwen3NextGatedDeltaNet(GatedDeltaNetBase):
    """``linear_attention``: Gated DeltaNet (:class:`~engine.model.gated_deltanet.GatedDeltaNetBase`,
    whose docstring has the math and the state) with Qwen3-Next's fused input projections.

    ``in_proj_qkvz`` is laid out per key head: for each of the H_k groups, ``[q (D_k), k (D_k),
    v (r·D_v), z (r·D_v)]``; ``in_proj_ba`` likewise ``[b (r), a (r)]``. Value head ``j·r + i``
    belongs to key head j. Qwen3.5 (``config.split_linear_projections``) has one projection per
    output instead, every head contiguous: ``in_proj_qkv`` ``[q (H_k·D_k), k, v (H_v·D_v)]``,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (transformers' ``Qwen3_5GatedDeltaNet``). ``conv1d.weight [C_conv, 1, K]`` is the conv kernel (only the weight
    is used: the conv continues from the state); ``norm`` is the gated RMSNorm with ``silu(z)``.
    forward: ``x [T, C]`` → ``[T, C]``.
    """

    def __init__(self, config: Qwen3NextConfig, layer: int) -> None:
        super().__init__(config, layer)
        c = config.hidden_size
        self.split = config.split_linear_projections
        if self.split:  # Qwen3.5: one projection per output, heads contiguous
            self.in_proj_qkv = nn.Linear(c, 2 * self.key_dim + self.value_dim, bias=False)
            self.in_proj_z = nn.Linear(c, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(c, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(c, self.num_v_heads, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(c, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(c, 2 * self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False, padding=self.conv_kernel - 1
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, c, bias=False)

    def _unpack_projections(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """q, k ``[T, H_k·D_k]``, v ``[T, H_v·D_v]``, z ``[T, H_v, D_v]``, b, a ``[T, H_v]`` from the
        head-grouped fused projections."""
        t, r = x.shape[0], self.heads_per_key
        dk, dv = self.head_k_dim, self.head_v_dim
        if self.split:
            q, k, v = torch.split(self.in_proj_qkv(x), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
            z = self.in_proj_z(x).view(t, self.num_v_heads, dv)
            return q, k, v, z, self.in_proj_b(x), self.in_proj_a(x)
        qkvz = self.in_proj_qkvz(x).view(t, self.num_k_heads, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(t, self.num_k_heads, 2 * r), [r, r], dim=-1)
        return (
            q.reshape(t, self.key_dim),
            k.reshape(t, self.key_dim),
            v.reshape(t, self.value_dim),
            z.reshape(t, self.num_v_heads, dv),
            b.reshape(t, self.num_v_heads),
            a.reshape(t, self.num_v_heads),
        )

    def forward(self, x: Tensor, state: SequenceState | DecodeBatch) -> Tensor:
        q, k, v, z, b, a = self._unpack_projections(x)
        o = self.gated_delta(torch.cat((q, k, v), dim=-1), a, b, self.conv1d.weight[:, 0, :], state)
        return self.out_proj(self.norm(o, z).reshape(x.shape[0], self.value_dim).to(x.dtype))
