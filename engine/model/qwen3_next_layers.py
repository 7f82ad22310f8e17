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
from engine.model.attention import attention_mask
from engine.model.decode_batch import DecodeBatch, conv_decode, delta_rule_decode, paged_decode
from engine.model.gated_deltanet import (
    CHUNKED_MIN_TOKENS,
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_rule,
    l2norm,
)
from engine.model.layers import apply_rotary
from engine.model.qwen3_next_config import Qwen3NextConfig
from engine.model.state import LinearLayerState, SequenceState


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
    """The output norm of Gated DeltaNet: ``y = x / sqrt(mean(x²) + eps) · w · silu(z)``, per
    value head, in float32. x and z are ``[..., D_v]``; ``weight [D_v]`` starts at ones (a plain
    weight, not zero-centred)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float() * nn.functional.silu(gate.float())).to(x.dtype)


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
            out = nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                kv.keys.transpose(0, 1).unsqueeze(0),
                kv.values.transpose(0, 1).unsqueeze(0),
                attn_mask=attention_mask(positions, kv.positions, None),
                scale=self.scale,
                enable_gqa=True,
            )
            out = out.squeeze(0).transpose(0, 1).reshape(t, self.num_heads * d)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, self.num_heads * d)))


class Qwen3NextGatedDeltaNet(nn.Module):
    """``linear_attention``: Gated DeltaNet (Yang, Kautz & Hatamizadeh, ICLR 2025) with
    Qwen3-Next's fused input projections.

    ``in_proj_qkvz`` is laid out per key head: for each of the H_k groups, ``[q (D_k), k (D_k),
    v (r·D_v), z (r·D_v)]``; ``in_proj_ba`` likewise ``[b (r), a (r)]``. Value head ``j·r + i``
    belongs to key head j, so q and k are repeated ``r`` times per head (``repeat_interleave``).
    Then: causal depthwise conv + SiLU over ``[q, k, v]`` (``conv1d.weight [C_conv, 1, K]``;
    only the weight is used, the conv continues from the state), L2-normalised q and k,
    ``β = sigmoid(b)``, ``g = −exp(A_log) · softplus(a + dt_bias)``, the gated delta rule, the
    gated RMSNorm with ``silu(z)`` and ``out_proj``.

    State (:class:`LinearLayerState`): conv ``[C_conv, K − 1]`` with ``C_conv = 2·H_k·D_k + H_v·D_v``
    and recurrent ``[H_v, D_k, D_v]`` (transformers keeps ``[B, H_v, D_k, D_v]``); both are
    replaced after each chunk. forward: ``x [T, C]`` → ``[T, C]``.
    """

    kernel_backend: kb.KernelBackend = "torch"

    def __init__(self, config: Qwen3NextConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.heads_per_key = self.num_v_heads // self.num_k_heads
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        c = config.hidden_size
        self.in_proj_qkvz = nn.Linear(c, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(c, 2 * self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False, padding=self.conv_kernel - 1
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, c, bias=False)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def _unpack_projections(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """q, k ``[T, H_k·D_k]``, v ``[T, H_v·D_v]``, z ``[T, H_v, D_v]``, b, a ``[T, H_v]`` from the
        head-grouped fused projections."""
        t, r = x.shape[0], self.heads_per_key
        dk, dv = self.head_k_dim, self.head_v_dim
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
        t = x.shape[0]
        batch = state if isinstance(state, DecodeBatch) else None
        layer_state: LinearLayerState = state.linear(self.layer) if not isinstance(state, DecodeBatch) else None  # type: ignore[assignment]
        q, k, v, z, b, a = self._unpack_projections(x)
        triton = self.kernel_backend == "triton"
        if batch is not None:  # one token per row, state in the static decode slots
            weight = self.conv1d.weight[:, 0, :]
            mixed = conv_decode(torch.cat((q, k, v), dim=-1), weight, batch.linear(self.layer)[0], batch.slot_ids, backend=self.kernel_backend)
        elif triton:
            mixed = kb.causal_conv1d(torch.cat((q, k, v), dim=-1), self.conv1d.weight[:, 0, :], layer_state)
        else:
            mixed, layer_state.conv = causal_conv1d(torch.cat((q, k, v), dim=-1), self.conv1d.weight[:, 0, :], layer_state.conv)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(t, self.num_k_heads, self.head_k_dim)
        if self.heads_per_key > 1:
            q = q.repeat_interleave(self.heads_per_key, dim=1)
            k = k.repeat_interleave(self.heads_per_key, dim=1)
        q, k = l2norm(q.float()), l2norm(k.float())
        v = v.reshape(t, self.num_v_heads, self.head_v_dim).float()
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * nn.functional.softplus(a.float() + self.dt_bias.float())
        if batch is not None:
            o = delta_rule_decode(q, k, v, g, beta, batch.linear(self.layer)[1], batch.slot_ids, backend=self.kernel_backend)
        elif triton:
            o, layer_state.recurrent = kb.gated_delta_rule(q, k, v, g, beta, layer_state.recurrent)
        else:
            rule = chunk_gated_delta_rule if t >= CHUNKED_MIN_TOKENS else gated_delta_rule
            o, layer_state.recurrent = rule(q, k, v, g, beta, layer_state.recurrent)
        o = self.norm(o, z)
        return self.out_proj(o.reshape(t, self.value_dim).to(x.dtype))
