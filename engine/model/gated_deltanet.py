"""``linear_attention``: Gated DeltaNet (Yang, Kautz & Hatamizadeh, "Gated Delta Networks:
Improving Mamba2 with Delta Rule", ICLR 2025), in the form Qwen3-Next uses it (transformers'
``Qwen3NextGatedDeltaNet`` in ``modeling_qwen3_next`` is the peer): a short depthwise causal conv
with SiLU over q, k, v; L2-normalised q and k; a per-head decay
``g = −exp(A_log) · softplus(a + dt_bias)`` and write strength ``β = sigmoid(b)``; the gated
delta rule (:mod:`kernels.gated_delta_rule_torch`, or its kernels); then an RMSNorm gated by
``silu(z)`` and the output projection.

:class:`GatedDeltaNetBase` is that math, once, for both model families; :class:`GatedDeltaNet`
is ``kvscope_hybrid``'s layer on it, and :class:`~engine.model.qwen3_next_layers.Qwen3NextGatedDeltaNet`
Qwen3-Next's (they differ only in how the projections are laid out and named in a checkpoint).

Shapes: T tokens, H_k key heads, H_v value heads (a multiple of H_k), D_k, D_v head dims,
C_conv = 2·H_k·D_k + H_v·D_v conv channels, K conv kernel width.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from engine.config import HybridConfig
from engine.model import kernel_backend as kb
from engine.model.decode_batch import DecodeBatch, conv_decode, delta_rule_decode
from engine.model.state import LinearLayerState, SequenceState
from kernels.gated_delta_rule_torch import (
    causal_conv1d,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_states,
    gated_delta_rule,
    l2norm,
)

CHUNK = 64
"""Tokens per chunk of the torch chunked delta rule (its default): checkpoint offsets that are
multiples of it are taken in one pass."""


class LinearAttentionConfig(Protocol):
    """The config fields a Gated DeltaNet layer reads (``HybridConfig`` and ``Qwen3NextConfig``
    both have them)."""

    @property
    def linear_num_key_heads(self) -> int: ...
    @property
    def linear_num_value_heads(self) -> int: ...
    @property
    def linear_key_head_dim(self) -> int: ...
    @property
    def linear_value_head_dim(self) -> int: ...
    @property
    def linear_conv_kernel_dim(self) -> int: ...


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gated DeltaNet's output norm, per value head in float32:
    ``y = x / sqrt(mean(x²) + eps) · w · silu(z)`` (flash-linear-attention's ``FusedRMSNormGated``,
    transformers' ``Qwen3NextRMSNormGated``). ``x, gate [..., D_v]``, ``weight [D_v]`` (a plain
    weight, not zero-centred) → ``[..., D_v]`` in x's dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float() * nn.functional.silu(gate.float())).to(x.dtype)


class GatedDeltaNetBase(nn.Module):
    """The math of a ``linear_attention`` layer between its input projections and its output
    norm (module docstring), shared by both model families.

    A subclass registers its parameters under its checkpoint's names, among them ``A_log [H_v]``
    and ``dt_bias [H_v]``, and calls :meth:`gated_delta` from its ``forward``. The layer's state
    (:class:`~engine.model.state.LinearLayerState`) is conv ``[C_conv, K − 1]`` and recurrent
    ``[H_v, D_k, D_v]``; both are replaced after each chunk (transformers keeps
    ``[B, H_v, D_k, D_v]``)."""

    kernel_backend: kb.KernelBackend = "torch"
    A_log: nn.Parameter
    dt_bias: nn.Parameter

    def __init__(self, config: LinearAttentionConfig, layer: int) -> None:
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

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def gated_delta(self, qkv: Tensor, a: Tensor, b: Tensor, conv_weight: Tensor, state: SequenceState | DecodeBatch) -> Tensor:
        """Conv, normalisation, gates and the gated delta rule of one chunk.

        Args:
            qkv: ``[T, C_conv]`` the q ``[H_k·D_k]``, k ``[H_k·D_k]`` and v ``[H_v·D_v]``
                projections side by side, before the conv.
            a, b: ``[T, H_v]`` the decay and write-strength projections.
            conv_weight: ``[C_conv, K]`` the depthwise conv kernel.
            state: a sequence's state (this layer's conv and recurrent state are read and
                replaced; at each of its :meth:`~engine.model.state.SequenceState.linear_checkpoints`
                the state there is handed to ``save_linear``) or a decode batch (one token per
                row; its static slots updated in place).

        Returns:
            ``o [T, H_v, D_v]`` float32. Value head ``j·r + i`` (r = H_v / H_k) reads key head j.
        """
        if isinstance(state, DecodeBatch):
            conv, recurrent = state.linear(self.layer)
            mixed = conv_decode(qkv, conv_weight, conv, state.slot_ids, backend=self.kernel_backend)
            q, k, v, g, beta = self._gates(mixed, a, b)
            return delta_rule_decode(q, k, v, g, beta, recurrent, state.slot_ids, backend=self.kernel_backend)
        layer_state = state.linear(self.layer)
        offsets = state.linear_checkpoints()
        if not offsets:
            return self._span(qkv, a, b, conv_weight, layer_state)
        inner = self.kernel_backend != "triton"  # the torch chunked rule hands states over at its chunk ends
        pieces, at, pending = [], 0, []
        for stop in (*offsets, qkv.shape[0]):
            if inner and stop < qkv.shape[0] and (stop - at) % CHUNK == 0:
                pending.append(stop)  # taken inside the next pass
                continue
            piece = slice(at, stop)
            if pending:
                pieces.append(self._one_pass(qkv[piece], a[piece], b[piece], conv_weight, state, at, pending))
            else:
                pieces.append(self._span(qkv[piece], a[piece], b[piece], conv_weight, layer_state))
            if stop < qkv.shape[0]:  # the recurrence stops here
                state.save_linear(self.layer, stop, layer_state.clone())
            at, pending = stop, []
        return torch.cat(pieces)

    def _one_pass(
        self, qkv: Tensor, a: Tensor, b: Tensor, conv_weight: Tensor, state: SequenceState, start: int, offsets: list[int]
    ) -> Tensor:
        """:meth:`gated_delta` over ``qkv`` (the chunk's tokens from ``start``) in one chunked pass
        whose chunk ends include every checkpoint offset (each ``start`` + a multiple of
        :data:`CHUNK`): the recurrent states there come out of the inter-chunk recurrence, and
        the conv states are the K − 1 inputs before each offset."""
        layer_state = state.linear(self.layer)
        inputs = torch.cat((layer_state.conv.transpose(0, 1).to(qkv.dtype), qkv))  # [K-1+T, C_conv]
        mixed, layer_state.conv = causal_conv1d(qkv, conv_weight, layer_state.conv)
        q, k, v, g, beta = self._gates(mixed, a, b)
        relative = [o - start for o in offsets]
        o, layer_state.recurrent, states = chunk_gated_delta_rule_states(q, k, v, g, beta, layer_state.recurrent, relative, CHUNK)
        width = self.conv_kernel - 1
        for offset, at, recurrent in zip(offsets, relative, states, strict=True):
            conv = inputs[at : at + width].transpose(0, 1).clone(memory_format=torch.contiguous_format)
            state.save_linear(self.layer, offset, LinearLayerState(conv, recurrent))
        return o

    def _span(self, qkv: Tensor, a: Tensor, b: Tensor, conv_weight: Tensor, layer_state: LinearLayerState) -> Tensor:
        """:meth:`gated_delta` over consecutive tokens of one sequence, its state replaced."""
        if self.kernel_backend == "triton":
            mixed = kb.causal_conv1d(qkv, conv_weight, layer_state)
        else:
            mixed, layer_state.conv = causal_conv1d(qkv, conv_weight, layer_state.conv)
        q, k, v, g, beta = self._gates(mixed, a, b)
        if self.kernel_backend == "triton":
            o, layer_state.recurrent = kb.gated_delta_rule(q, k, v, g, beta, layer_state.recurrent)
        else:
            rule = chunk_gated_delta_rule if qkv.shape[0] >= kb.CHUNKED_MIN_TOKENS else gated_delta_rule
            o, layer_state.recurrent = rule(q, k, v, g, beta, layer_state.recurrent)
        return o

    def _gates(self, mixed: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Heads of the conv's output, L2-normalised q and k (float32, repeated per value head),
        the decay g and the write strength β."""
        t = mixed.shape[0]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(t, self.num_v_heads, self.head_v_dim)
        if self.heads_per_key > 1:
            q = q.repeat_interleave(self.heads_per_key, dim=1)
            k = k.repeat_interleave(self.heads_per_key, dim=1)
        q, k = l2norm(q.float()), l2norm(k.float())
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * nn.functional.softplus(a.float() + self.dt_bias.float())
        return q, k, v, g, beta


class GatedDeltaNet(GatedDeltaNetBase):
    """``kvscope_hybrid``'s ``linear_attention`` layer: separate q, k, v, z, a, b projections, the
    conv kernel as ``conv_weight [C_conv, K]`` and the output norm's weight as ``norm_weight
    [D_v]``. forward: ``x [T, C]`` → ``[T, C]``."""

    def __init__(self, config: HybridConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.eps = config.rms_norm_eps
        c = config.hidden_size
        self.q_proj = nn.Linear(c, self.key_dim, bias=False)
        self.k_proj = nn.Linear(c, self.key_dim, bias=False)
        self.v_proj = nn.Linear(c, self.value_dim, bias=False)
        self.z_proj = nn.Linear(c, self.value_dim, bias=False)
        self.a_proj = nn.Linear(c, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(c, self.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.conv_kernel))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm_weight = nn.Parameter(torch.ones(self.head_v_dim))
        self.o_proj = nn.Linear(self.value_dim, c, bias=False)

    def forward(self, x: Tensor, state: SequenceState | DecodeBatch) -> Tensor:
        t = x.shape[0]
        qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        o = self.gated_delta(qkv, self.a_proj(x), self.b_proj(x), self.conv_weight, state)
        z = self.z_proj(x).reshape(t, self.num_v_heads, self.head_v_dim)
        o = gated_rms_norm(o, z, self.norm_weight, self.eps)
        return self.o_proj(o.reshape(t, self.value_dim).to(x.dtype))
