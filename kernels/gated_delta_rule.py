"""The gated delta rule of Gated DeltaNet (Qwen3-Next's ``linear_attention``), in its chunked
prefill form and its fused recurrent decode form, for a variable-length batch, with initial state
in and final state out; and the short causal conv update that feeds it during decode.

What is computed (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", ICLR 2025; as
flash-linear-attention's ``fused_recurrent_gated_delta_rule``; the plain-torch form, the
engine's torch path, is :func:`kernels.gated_delta_rule_torch.gated_delta_rule`), per sequence
and head, token by token::

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,   o_t = S_t^T q_t / sqrt(D_k)

Layouts: ``q``, ``k``: ``[T, H, D_k]`` (L2-normalised); ``v``, ``o``: ``[T, H, D_v]``; ``g``
(log-decay, <= 0) and ``beta``: ``[T, H]``; ``cu_seqlens``: ``[N + 1]`` int32 (the sequences
packed along T); ``initial_state`` and the final state: ``[N, H, D_k, D_v]`` float32. One program
per (sequence, head, tile of ``BLOCK_V`` value channels) keeps its state tile in registers over
the sequence; no autotuning (with ``inplace=True`` it writes the state it read).

:func:`chunk_gated_delta_rule` computes the same outputs and state a chunk of ``BT`` tokens at a
time with matrix products (Yang et al., "Parallelizing Linear Transformers with the Delta Rule
over Sequence Length", NeurIPS 2024, the WY / UT-transform form, with Gated DeltaNet's decay; as
flash-linear-attention's ``chunk_gated_delta_rule``; the torch form is
:func:`kernels.gated_delta_rule_torch.chunk_gated_delta_rule`). Within a chunk with start state
``S_0`` and cumulative log-decay ``G_t = sum_{s<=t} g_s``::

    A[t, s] = beta_t exp(G_t - G_s) k_t . k_s   (s < t),      X = (I + A)^-1   (forward substitution)
    U = X (beta V) - X (beta exp(G) K) S_0
    O = (exp(G) Q) S_0 / sqrt(D_k) + ((Q K^T / sqrt(D_k)) * exp(G_t - G_s) [s <= t]) U
    S = exp(G_last) S_0 + (exp(G_last - G) K)^T U

One program per (sequence, head, tile of ``BLOCK_V`` value channels) walks its sequence's chunks
with the state tile in registers (the chunk's ``X`` is recomputed per tile: it depends on K only).

:func:`causal_conv1d_update` is the decode step of the depthwise causal conv with SiLU in front
of the rule: ``y = silu(sum_j w[:, j] * window_j)`` over the ``K - 1`` saved inputs and the new
one, whose window then shifts by one (:func:`kernels.gated_delta_rule_torch.causal_conv1d` for
one token).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.gated_delta_rule_torch import gated_delta_rule as torch_gated_delta_rule
from kernels.launch import graph_safe, on_tensor_device

BLOCK_V = 32
"""Value channels one program carries."""
CHUNK = 32
"""Tokens per chunk of the chunked form (``BT``)."""


@triton.jit
def _state_tile(state_ptr, cu_ptr, HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's sequence bounds ``[first, last)``, its key and value channel offsets and
    masks, and its ``[K_PAD, BLOCK_V]`` tile of the initial state (fp32) with its offsets/mask."""
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    first = tl.load(cu_ptr + i_n).to(tl.int64)
    last = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, K_PAD)
    m_k = o_k < DK
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_v = o_v < DV
    m_s = m_k[:, None] & m_v[None, :]
    p_state = (i_n * HEADS + i_h) * DK * DV + o_k[:, None] * DV + o_v[None, :]
    b_s = tl.load(state_ptr + p_state, mask=m_s, other=0.0).to(tl.float32)
    return first, last, o_k, m_k, o_v, m_v, p_state, m_s, b_s


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, final_ptr, cu_ptr, scale,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_bt, s_ot, s_oh,
    HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    i_h = tl.program_id(1)
    first, last, o_k, m_k, o_v, m_v, p_state, m_s, b_s = _state_tile(state_ptr, cu_ptr, HEADS, DK, DV, K_PAD, BLOCK_V)
    for t in range(first, last):
        b_q = tl.load(q_ptr + t * s_qt + i_h * s_qh + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k_ptr + t * s_kt + i_h * s_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + t * s_vt + i_h * s_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g_ptr + t * s_gt + i_h).to(tl.float32)
        b_beta = tl.load(beta_ptr + t * s_bt + i_h).to(tl.float32)
        b_s = b_s * tl.exp(b_g)
        b_delta = (b_v - tl.sum(b_k[:, None] * b_s, axis=0)) * b_beta  # [BLOCK_V]
        b_s = b_s + b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_q[:, None] * b_s, axis=0)
        tl.store(out_ptr + t * s_ot + i_h * s_oh + o_v, b_o.to(out_ptr.dtype.element_ty), mask=m_v)
    tl.store(final_ptr + p_state, b_s, mask=m_s)


@triton.jit
def _chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, final_ptr, cu_ptr, scale,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_bt, s_ot, s_oh,
    HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    i_h = tl.program_id(1)
    first, last, o_k, m_k, o_v, m_v, p_state, m_s, b_s = _state_tile(state_ptr, cu_ptr, HEADS, DK, DV, K_PAD, BLOCK_V)
    o_i = tl.arange(0, BT)
    m_causal = o_i[:, None] >= o_i[None, :]
    m_strict = o_i[:, None] > o_i[None, :]
    b_eye = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    for start in range(first, last, BT):
        o_t = start + o_i
        m_t = o_t < last
        b_q = tl.load(q_ptr + o_t[:, None] * s_qt + i_h * s_qh + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32) * scale
        b_k = tl.load(k_ptr + o_t[:, None] * s_kt + i_h * s_kh + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + o_t[:, None] * s_vt + i_h * s_vh + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        b_g = tl.load(g_ptr + o_t * s_gt + i_h, mask=m_t, other=0.0).to(tl.float32)  # padded rows: no decay,
        b_beta = tl.load(beta_ptr + o_t * s_bt + i_h, mask=m_t, other=0.0).to(tl.float32)  # no write
        b_gcum = tl.cumsum(b_g, axis=0)
        b_decay = tl.exp(tl.where(m_causal, b_gcum[:, None] - b_gcum[None, :], float("-inf")))  # [BT, BT]
        b_a = tl.where(m_strict, tl.dot(b_k, tl.trans(b_k), input_precision="ieee") * b_decay * b_beta[:, None], 0.0)
        # X = (I + A)^-1 row by row: X[i] = e_i - sum_{j<i} A[i, j] X[j] (rows j < i are final)
        b_x = b_eye
        for i in range(1, BT):
            b_row = tl.sum(tl.where(o_i[:, None] == i, b_a, 0.0), axis=0)  # A[i, :]
            b_new = tl.where(o_i == i, 1.0, 0.0) - tl.sum(b_row[:, None] * b_x, axis=0)
            b_x = tl.where(o_i[:, None] == i, b_new[None, :], b_x)
        b_u = tl.dot(b_x, b_v * b_beta[:, None], input_precision="ieee")  # [BT, BLOCK_V]
        b_w = tl.dot(b_x, b_k * (b_beta * tl.exp(b_gcum))[:, None], input_precision="ieee")  # [BT, K_PAD]
        b_u = b_u - tl.dot(b_w, b_s, input_precision="ieee")
        b_intra = tl.where(m_causal, tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * b_decay, 0.0)
        b_o = tl.dot(b_q * tl.exp(b_gcum)[:, None], b_s, input_precision="ieee") + tl.dot(b_intra, b_u, input_precision="ieee")
        tl.store(out_ptr + o_t[:, None] * s_ot + i_h * s_oh + o_v[None, :], b_o.to(out_ptr.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        b_glast = tl.sum(tl.where(o_i == BT - 1, b_gcum, 0.0), axis=0)  # padded rows add 0
        b_kend = b_k * tl.exp(b_glast - b_gcum)[:, None]
        b_s = b_s * tl.exp(b_glast) + tl.dot(tl.trans(b_kend), b_u, input_precision="ieee")
    tl.store(final_ptr + p_state, b_s, mask=m_s)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be one [T, H, D_k] shape and v [T, H, D_v]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    t, h, dk = q.shape
    dv = v.shape[2]
    if g.shape != (t, h) or beta.shape != (t, h):
        raise ValueError(f"g and beta must be [T={t}, H={h}]; got {tuple(g.shape)}, {tuple(beta.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.stride(-1) != 1:
            raise ValueError(f"{name} must be a float tensor contiguous in its last dim; got {x.dtype}, strides {x.stride()}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2 or not cu_seqlens.is_contiguous():
        raise ValueError(f"cu_seqlens must be a contiguous int32 [N+1] with N >= 1; got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if not graph_safe(cu_seqlens) and (int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != t or bool((cu_seqlens.diff() < 0).any())):
        raise ValueError(f"cu_seqlens must rise from 0 to T={t}")
    n = cu_seqlens.numel() - 1
    if initial_state.shape != (n, h, dk, dv) or initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
        raise ValueError(f"initial_state must be a contiguous float32 [N={n}, H={h}, D_k={dk}, D_v={dv}]; got {initial_state.dtype} {tuple(initial_state.shape)}")
    if len({x.device for x in (q, k, v, g, beta, initial_state, cu_seqlens)}) != 1:
        raise ValueError("every tensor must be on one device")


def _run(
    kernel: triton.JITFunction, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor, inplace: bool, out: torch.Tensor | None, **extra: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    _, h, dk = q.shape
    dv = v.shape[2]
    n = cu_seqlens.numel() - 1
    if out is None:
        out = torch.empty_like(v)
    elif out.shape != v.shape or out.dtype != v.dtype or out.stride(-1) != 1 or out.device != v.device:
        raise ValueError(f"out must be a {v.dtype} {tuple(v.shape)} tensor contiguous in its last dim")
    final = initial_state if inplace else torch.empty_like(initial_state)
    kernel[(n, h, triton.cdiv(dv, BLOCK_V))](
        q, k, v, g, beta, initial_state, out, final, cu_seqlens, 1.0 / math.sqrt(dk),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), out.stride(0), out.stride(1),
        HEADS=h, DK=dk, DV=dv, K_PAD=max(triton.next_power_of_2(dk), 16), BLOCK_V=BLOCK_V, **extra,
    )  # fmt: skip
    return out, final


@on_tensor_device
def fused_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor, *, inplace: bool = False, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The recurrent form, token by token (decode): ``(o [T, H, D_v] in v's dtype, final_state
    [N, H, D_k, D_v] float32)`` (module docstring). With ``inplace`` the final state is written
    into ``initial_state``; ``out`` is where ``o`` goes (a new tensor when None).

    Raises:
        ValueError: shapes, dtypes, strides or devices that do not match the layouts;
            ``cu_seqlens`` not rising from 0 to T (not checked while
            :func:`kernels.launch.graph_safe`: no host reads).
    """
    return _run(_recurrent_kernel, q, k, v, g, beta, initial_state, cu_seqlens, inplace, out)


@on_tensor_device
def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor, *, inplace: bool = False, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The chunked form (prefill), :data:`CHUNK` tokens per step: the same arguments, results and
    errors as :func:`fused_recurrent_gated_delta_rule`, equal up to rounding."""
    return _run(_chunk_kernel, q, k, v, g, beta, initial_state, cu_seqlens, inplace, out, BT=CHUNK)


def fused_recurrent_gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The plain-torch fp32 reference of both forms:
    :func:`kernels.gated_delta_rule_torch.gated_delta_rule`, one sequence at a time."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    outs, finals = [], []
    for i in range(cu_seqlens.numel() - 1):
        a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        o, s = torch_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], initial_state[i])
        outs.append(o)
        finals.append(s)
    return torch.cat(outs), torch.stack(finals)


chunk_gated_delta_rule_ref = fused_recurrent_gated_delta_rule_ref
"""The chunked form's reference is the recurrent rule itself (the same math, summed in order)."""


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, state_ptr, y_ptr, channels, s_xb, s_sb, s_yb, WIDTH: tl.constexpr, W_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    i_b = tl.program_id(0)
    i_c = tl.program_id(1)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < channels
    o_j = tl.arange(0, W_PAD)
    m_past = o_j < WIDTH - 1
    p_state = state_ptr + i_b * s_sb + o_c[:, None] * (WIDTH - 1) + o_j[None, :]
    b_past = tl.load(p_state, mask=m_c[:, None] & m_past[None, :], other=0.0).to(tl.float32)  # [BLOCK_C, W_PAD]
    b_x = tl.load(x_ptr + i_b * s_xb + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_w = tl.load(w_ptr + o_c[:, None] * WIDTH + o_j[None, :], mask=m_c[:, None] & (o_j[None, :] < WIDTH), other=0.0).to(tl.float32)
    b_win = tl.where(o_j[None, :] == WIDTH - 1, b_x[:, None], b_past)  # the K - 1 saved inputs, then x
    b_y = tl.sum(b_win * b_w, axis=1)
    b_y = b_y / (1.0 + tl.exp(-b_y))  # SiLU
    tl.store(y_ptr + i_b * s_yb + o_c, b_y.to(y_ptr.dtype.element_ty), mask=m_c)
    # shift the window by one: the saved inputs become window slots 1 .. K - 1
    b_next = tl.where(o_j[None, :] == WIDTH - 2, b_x[:, None], 0.0)
    for j in range(0, WIDTH - 2):
        b_next += tl.where(o_j[None, :] == j, tl.sum(tl.where(o_j[None, :] == j + 1, b_past, 0.0), axis=1)[:, None], 0.0)
    tl.store(p_state, b_next.to(state_ptr.dtype.element_ty), mask=m_c[:, None] & m_past[None, :])


@on_tensor_device
def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """One decode token per row: ``x [B, C]``, ``weight [C, K]``, ``conv_state [B, C, K - 1]``
    (oldest input first; updated in place) → ``y [B, C]`` in x's dtype.

    Raises:
        ValueError: shapes, dtypes or devices that do not match; a kernel narrower than 2.
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 2:
        raise ValueError(f"x must be [B, C] and weight [C, K >= 2]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    b, c = x.shape
    width = weight.shape[1]
    if conv_state.shape != (b, c, width - 1) or not conv_state.is_contiguous() or not weight.is_contiguous() or x.stride(-1) != 1:
        raise ValueError(f"conv_state must be a contiguous [B={b}, C={c}, K-1={width - 1}] tensor and weight contiguous; got {tuple(conv_state.shape)}")
    if len({x.device, weight.device, conv_state.device}) != 1:
        raise ValueError("x, weight and conv_state must be on one device")
    y = torch.empty_like(x)
    if b == 0:
        return y
    block_c = 64
    _conv_update_kernel[(b, triton.cdiv(c, block_c))](
        x, weight, conv_state, y, c, x.stride(0), conv_state.stride(0), y.stride(0),
        WIDTH=width, W_PAD=triton.next_power_of_2(width), BLOCK_C=block_c,
    )  # fmt: skip
    return y
