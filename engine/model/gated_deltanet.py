"""``linear_attention``: Gated DeltaNet (Yang, Kautz & Hatamizadeh, "Gated Delta Networks:
Improving Mamba2 with Delta Rule", ICLR 2025), in the form Qwen3-Next uses it: a short depthwise
causal conv with SiLU over q, k, v; L2-normalised q and k; a per-head decay
``g = −exp(A_log) · softplus(a + dt_bias)`` and write strength ``β = sigmoid(b)``; the gated
delta rule

    S_t = exp(g_t) · S_{t−1} + k_t ⊗ β_t (v_t − exp(g_t) · S_{t−1}ᵀ k_t),   o_t = S_tᵀ (q_t / √D_k)

(the recurrent reference of transformers' ``torch_recurrent_gated_delta_rule`` and of
flash-linear-attention's ``fused_recurrent_gated_delta_rule``), then an RMSNorm gated by
``silu(z)`` and the output projection.

Shapes: T tokens, H_k key heads, H_v value heads (a multiple of H_k), D_k, D_v head dims,
C_conv = 2·H_k·D_k + H_v·D_v conv channels, K conv kernel width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from engine.config import HybridConfig
from engine.model import kernel_backend as kb
from engine.model.decode_batch import DecodeBatch, conv_decode, delta_rule_decode
from engine.model.state import LinearLayerState, SequenceState

CHUNKED_MIN_TOKENS = 32
"""Chunks of at least this many tokens use the chunked form; shorter ones (decode) the
recurrent form."""


def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv followed by SiLU, continuing from a saved state.

    Args:
        x: ``[T, C]`` new inputs.
        weight: ``[C, K]`` per-channel kernel (transformers' ``conv1d.weight[:, 0, :]``).
        conv_state: ``[C, K − 1]`` the previous K − 1 inputs, oldest first (zeros at start).

    Returns:
        ``(y [T, C], new_state [C, K − 1])`` with ``y_t = silu(Σ_j w_j · x_{t−K+1+j})``.
    """
    k = weight.shape[1]
    padded = torch.cat((conv_state.transpose(0, 1).to(x.dtype), x), dim=0)  # [K-1+T, C]
    windows = padded.unfold(0, k, 1)  # [T, C, K]
    y = (windows * weight.to(x.dtype)).sum(-1)
    new_state = padded[padded.shape[0] - (k - 1) :].transpose(0, 1).contiguous()
    return nn.functional.silu(y), new_state


def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """Recurrent gated delta rule in float32 (the plain reference form).

    Args:
        q, k: ``[T, H, D_k]`` (already L2-normalised; q is scaled here by 1/√D_k).
        v: ``[T, H, D_v]``.
        g: ``[T, H]`` log-decay (≤ 0). beta: ``[T, H]`` write strength in (0, 1).
        state: ``[H, D_k, D_v]`` initial state (not modified).

    Returns:
        ``(o [T, H, D_v], final_state [H, D_k, D_v])``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    q = q.float() * scale
    k, v, g, beta = k.float(), v.float(), g.float(), beta.float()
    s = state.float().clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    decay = g.exp()
    for t in range(q.shape[0]):
        s.mul_(decay[t][:, None, None])
        kv_mem = torch.einsum("hk,hkv->hv", k[t], s)
        delta = (v[t] - kv_mem) * beta[t][:, None]
        s.add_(k[t][:, :, None] * delta[:, None, :])
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)
    return out, s


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk_size: int = 64
) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule in float32: same result as :func:`gated_delta_rule` (up to
    rounding), with the sequence split into chunks of ``chunk_size`` tokens.

    Within a chunk with start state S₀ and cumulative log-decay G_t = Σ_{s≤t} g_s the state is
    ``S_t = e^{G_t} S₀ + Σ_{s≤t} e^{G_t−G_s} k_s u_sᵀ``; the pseudo-values solve the unit
    lower-triangular system ``(I + A) U = βV − (β e^{G} K) S₀`` with
    ``A_ts = β_t e^{G_t−G_s} k_t·k_s`` for s < t (the WY / UT-transform form of Yang et al.,
    "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", NeurIPS 2024,
    and Gated DeltaNet §3). Outputs are ``O = (e^{G} Q) S₀ + (Q Kᵀ ⊙ D) U`` with
    ``D_ts = e^{G_t−G_s}`` for s ≤ t.

    Args and returns as :func:`gated_delta_rule`.
    """
    t_len, h, dk = q.shape
    dv = v.shape[-1]
    pad = (-t_len) % chunk_size
    scale = 1.0 / math.sqrt(dk)

    def chunks(x: Tensor) -> Tensor:  # [T, H, ...] -> [H, N, C, ...]
        x = x.float()
        if pad:
            x = torch.cat((x, x.new_zeros((pad, *x.shape[1:]))))
        return x.reshape(-1, chunk_size, *x.shape[1:]).movedim(2, 0)

    qc, kc, vc = chunks(q) * scale, chunks(k), chunks(v)  # [H, N, C, D]
    gc, bc = chunks(g), chunks(beta)  # [H, N, C]
    gcum = gc.cumsum(-1)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    diff = (gcum[..., :, None] - gcum[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = diff.exp()  # [H, N, C, C], zero above the diagonal
    strict = (kc @ kc.transpose(-1, -2)) * decay * bc[..., :, None]
    system = strict.masked_fill(lower.logical_not() | torch.eye(chunk_size, dtype=torch.bool, device=q.device), 0.0)
    system = system + torch.eye(chunk_size, device=q.device)
    w = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
    kcum = torch.linalg.solve_triangular(
        system, kc * (bc * gcum.exp())[..., None], upper=False, unitriangular=True
    )
    intra = (qc @ kc.transpose(-1, -2)) * decay  # [H, N, C, C]
    q_decayed = qc * gcum.exp()[..., None]
    k_to_end = kc * (gcum[..., -1:] - gcum).exp()[..., None]
    s = state.float().clone()
    out = torch.empty((h, qc.shape[1], chunk_size, dv), dtype=torch.float32, device=q.device)
    for n in range(qc.shape[1]):
        u = w[:, n] - kcum[:, n] @ s
        out[:, n] = q_decayed[:, n] @ s + intra[:, n] @ u
        s = s * gcum[:, n, -1].exp()[:, None, None] + k_to_end[:, n].transpose(-1, -2) @ u
    # padded positions carry g = 0, beta = 0 and k = 0: they leave the state unchanged
    return out.movedim(0, 2).reshape(-1, h, dv)[:t_len], s


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last axis (as flash-linear-attention's ``l2norm``)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """One ``linear_attention`` layer. forward: ``x [T, C]`` → ``[T, C]``; reads and replaces
    the sequence's :class:`LinearLayerState` for this layer."""

    kernel_backend: kb.KernelBackend = "torch"

    def __init__(self, config: HybridConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
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

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, x: Tensor, state: SequenceState | DecodeBatch) -> Tensor:
        t = x.shape[0]
        batch = state if isinstance(state, DecodeBatch) else None
        layer_state: LinearLayerState = state.linear(self.layer) if not isinstance(state, DecodeBatch) else None  # type: ignore[assignment]
        mixed = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        triton = self.kernel_backend == "triton"
        if batch is not None:  # one token per row, state in the static decode slots
            mixed = conv_decode(mixed, self.conv_weight, batch.linear(self.layer)[0], batch.slot_ids, backend=self.kernel_backend)
        elif triton:
            mixed = kb.causal_conv1d(mixed, self.conv_weight, layer_state)
        else:
            mixed, layer_state.conv = causal_conv1d(mixed, self.conv_weight, layer_state.conv)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(t, self.num_v_heads, self.head_v_dim)
        repeat = self.num_v_heads // self.num_k_heads
        if repeat > 1:
            q = q.repeat_interleave(repeat, dim=1)
            k = k.repeat_interleave(repeat, dim=1)
        q, k = l2norm(q.float()), l2norm(k.float())
        beta = torch.sigmoid(self.b_proj(x).float())
        g = -self.A_log.float().exp() * nn.functional.softplus(self.a_proj(x).float() + self.dt_bias.float())
        if batch is not None:
            o = delta_rule_decode(q, k, v, g, beta, batch.linear(self.layer)[1], batch.slot_ids, backend=self.kernel_backend)
        elif triton:
            o, layer_state.recurrent = kb.gated_delta_rule(q, k, v, g, beta, layer_state.recurrent)
        else:
            rule = chunk_gated_delta_rule if t >= CHUNKED_MIN_TOKENS else gated_delta_rule
            o, layer_state.recurrent = rule(q, k, v, g, beta, layer_state.recurrent)
        z = self.z_proj(x).reshape(t, self.num_v_heads, self.head_v_dim).float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight.float()
        o = o * nn.functional.silu(z)
        return self.o_proj(o.reshape(t, self.value_dim).to(x.dtype))
