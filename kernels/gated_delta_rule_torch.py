"""The gated delta rule of Gated DeltaNet and its short causal conv in plain PyTorch (float32):
the engine's ``torch`` backend and the reference :mod:`kernels.gated_delta_rule`'s Triton kernels
are checked against. No Triton here, so the engine imports it on every device.

What is computed (Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", ICLR 2025; the recurrent reference of transformers' ``torch_recurrent_gated_delta_rule``
in ``modeling_qwen3_next`` and of flash-linear-attention's ``fused_recurrent_gated_delta_rule``),
per head, token by token::

    S_t = exp(g_t) · S_{t−1} + k_t ⊗ β_t (v_t − exp(g_t) · S_{t−1}ᵀ k_t),   o_t = S_tᵀ (q_t / √D_k)

Shapes: T tokens, H heads, D_k / D_v key / value head dims, C channels, K conv kernel width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last axis (as flash-linear-attention's ``l2norm``)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


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
    # depthwise: one group per channel (as transformers' nn.Conv1d with groups = C)
    y = nn.functional.conv1d(padded.transpose(0, 1)[None], weight.to(x.dtype)[:, None], groups=weight.shape[0])[0].transpose(0, 1).contiguous()
    new_state = padded[padded.shape[0] - (k - 1) :].transpose(0, 1).contiguous()
    return nn.functional.silu(y), new_state


def delta_rule_step(
    q: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One token of the gated delta rule (module docstring), for any leading batch dims ``...``.

    Args:
        q: ``[..., H, D_k]`` already scaled by 1/√D_k; k: ``[..., H, D_k]``; v: ``[..., H, D_v]``.
        decay: ``[..., H]`` the multiplicative decay ``exp(g)``; beta: ``[..., H]``.
        state: ``[..., H, D_k, D_v]`` (not modified).

    Returns:
        ``(o [..., H, D_v], new_state [..., H, D_k, D_v])``, in the inputs' (float) dtype.
    """
    state = state * decay[..., None, None]
    delta = (v - torch.einsum("...hk,...hkv->...hv", k, state)) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("...hk,...hkv->...hv", q, state), state


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
        ``(o [T, H, D_v], final_state [H, D_k, D_v])``, float32.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    q = q.float() * scale
    k, v, g, beta = k.float(), v.float(), g.float(), beta.float()
    s = state.float().clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    decay = g.exp()
    for t in range(q.shape[0]):
        out[t], s = delta_rule_step(q[t], k[t], v[t], decay[t], beta[t], s)
    return out, s


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk_size: int = 64
) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule in float32: same result as :func:`gated_delta_rule` (up to
    rounding), with the sequence split into chunks of ``chunk_size`` tokens
    (:func:`chunk_gated_delta_rule_states` without states on the way)."""
    o, final, _ = chunk_gated_delta_rule_states(q, k, v, g, beta, state, (), chunk_size)
    return o, final


def chunk_gated_delta_rule_states(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, offsets: Sequence[int], chunk_size: int = 64
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The chunked gated delta rule, also handing back the state after each of ``offsets``
    tokens (checkpoints taken inside one call: the inter-chunk recurrence passes them anyway).

    Within a chunk with start state S₀ and cumulative log-decay G_t = Σ_{s≤t} g_s the state is
    ``S_t = e^{G_t} S₀ + Σ_{s≤t} e^{G_t−G_s} k_s u_sᵀ``; the pseudo-values solve the unit
    lower-triangular system ``(I + A) U = βV − (β e^{G} K) S₀`` with
    ``A_ts = β_t e^{G_t−G_s} k_t·k_s`` for s < t (the WY / UT-transform form of Yang et al.,
    "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", NeurIPS 2024,
    and Gated DeltaNet §3; as flash-linear-attention's ``chunk_gated_delta_rule``). Outputs are
    ``O = (e^{G} Q) S₀ + (Q Kᵀ ⊙ D) U`` with ``D_ts = e^{G_t−G_s}`` for s ≤ t.

    Args as :func:`gated_delta_rule`, and ``offsets``: ascending distinct token counts in
    ``(0, T)``, each a multiple of ``chunk_size``.

    Returns:
        ``(o [T, H, D_v], final_state [H, D_k, D_v], [state after offsets[i] tokens, ...])``,
        float32.

    Raises:
        ValueError: offsets not ascending and distinct, or one that is not a multiple of
            ``chunk_size`` inside ``(0, T)``.
    """
    t_len, h, dk = q.shape
    if any(o <= 0 or o >= t_len or o % chunk_size for o in offsets) or list(offsets) != sorted(set(offsets)):
        raise ValueError(f"checkpoint offsets {list(offsets)} must be ascending distinct multiples of {chunk_size} inside (0, {t_len})")
    at_chunk_end = {o // chunk_size - 1 for o in offsets}
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
    states: list[Tensor] = []
    out = torch.empty((h, qc.shape[1], chunk_size, dv), dtype=torch.float32, device=q.device)
    for n in range(qc.shape[1]):
        u = w[:, n] - kcum[:, n] @ s
        out[:, n] = q_decayed[:, n] @ s + intra[:, n] @ u
        s = s * gcum[:, n, -1].exp()[:, None, None] + k_to_end[:, n].transpose(-1, -2) @ u
        if n in at_chunk_end:
            states.append(s)  # a new tensor each step: never written again
    # padded positions carry g = 0, beta = 0 and k = 0: they leave the state unchanged
    return out.movedim(0, 2).reshape(-1, h, dv)[:t_len], s, states
