"""A mixture-of-experts layer of SwiGLU experts with fixed shapes: every (token, choice) pair is
sorted by expert into blocks of ``BLOCK_M`` rows that each belong to one expert, and one grouped
matrix product per weight runs over all the blocks; what depends on the router's choice is only
values in device tensors, never a shape, so a CUDA graph can capture it (vLLM's ``fused_moe``
with its ``moe_align_block_size``; the engine's torch path is
:class:`engine.model.qwen3_next_moe.Qwen3NextExperts`).

What is computed, for ``x [T, C]``, router choices ``topk_ids [T, k]`` (distinct per token) and
weights ``topk_weights [T, k]``, experts packed as ``gate_up [E, 2I, C]`` (gate rows, then up
rows) and ``down [E, C, I]``::

    out[t] = sum_j topk_weights[t, j] * down_e (silu(gate_e x_t) * (up_e x_t)),   e = topk_ids[t, j]

:func:`moe_align` sorts the ``P = T k`` pairs (pair ``p`` is token ``p // k``'s choice ``p % k``)
stably by expert and pads each expert's run to a multiple of ``BLOCK_M``; the padded list has at
most ``P + min(E, P) (BLOCK_M - 1)`` rows whatever the choice (at most ``min(E, P)`` experts
have pairs), which fixes the grid. Its slots beyond an
expert's pairs hold ``P`` (no pair), and blocks beyond the last expert's hold expert ``-1`` and
do nothing. The first product writes ``h [P, I] = silu(x A_g^T) * (x A_u^T)`` per pair, the second
``y [P, C] = w_p (h D^T)``; the ``k`` rows of each token are then summed. Products accumulate in
fp32: fp16 / bf16 tiles go to the tensor cores as they are, fp32 tiles in full precision
(``ieee``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.launch import on_tensor_device

BLOCK_M = 16
"""Pair rows per block (one expert per block)."""
BLOCK_N = 32
BLOCK_K = 32


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert in blocks of ``block_m`` rows, with fixed shapes.

    Args:
        topk_ids: ``[T, k]`` integer expert ids in ``[0, E)``.
        num_experts: E.

    Returns:
        ``(sorted_pairs [R] int32, block_expert [R / block_m] int32)`` with ``R = block_m ·
        ceil((P + min(E, P) (block_m − 1)) / block_m)``: the pair index in each padded row (``P`` for
        padding) and each block's expert (``-1`` past the last expert's blocks).
    """
    pairs = topk_ids.numel()
    device = topk_ids.device
    rows = block_m * triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)  # at most min(E, P) experts are used
    flat = topk_ids.reshape(-1).long()
    experts, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    first_padded = padded_end - padded
    first_sorted = counts.cumsum(0) - counts
    rank = torch.arange(pairs, device=device) - first_sorted[experts]
    sorted_pairs = torch.full((rows,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[first_padded[experts] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
    return sorted_pairs, block_expert


@triton.jit
def _dot(a, w, acc, FP32: tl.constexpr):
    """``acc + a wᵀ`` accumulated in fp32: fp16 / bf16 tiles on the tensor cores as they are
    (their products are exact in fp32), fp32 tiles in full precision."""
    if FP32:
        return acc + tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, route_ptr,
    num_pairs, n_out, k_in, s_a, s_we, s_wn, s_out,
    PAIRS_PER_A_ROW: tl.constexpr, GATED: tl.constexpr, ROUTED: tl.constexpr,
    FP32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    i_b = tl.program_id(0)
    i_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + i_b).to(tl.int64)
    if expert < 0:  # past the last expert's blocks
        return
    pair = tl.load(sorted_ptr + i_b * BM + tl.arange(0, BM)).to(tl.int64)
    m_pair = pair < num_pairs
    a_row = pair // PAIRS_PER_A_ROW  # k: the pair's token (first product); 1: the pair itself
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < n_out
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    w_expert = w_ptr + expert * s_we
    for k0 in range(0, k_in, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < k_in
        b_a = tl.load(a_ptr + a_row[:, None] * s_a + o_k[None, :], mask=m_pair[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(w_expert + o_n[:, None] * s_wn + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        acc = _dot(b_a, b_w, acc, FP32)
        if GATED:  # the up rows sit n_out rows below the gate rows
            b_u = tl.load(w_expert + (o_n[:, None] + n_out) * s_wn + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
            acc_up = _dot(b_a, b_u, acc_up, FP32)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    if ROUTED:
        acc = acc * tl.load(route_ptr + pair, mask=m_pair, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair[:, None] * s_out + o_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_pair[:, None] & m_n[None, :])


def _check(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"x must be [T, C], gate_up [E, 2I, C] and down [E, C, I]; got {tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}")
    t, c = x.shape
    e, two_i, c_w = gate_up.shape
    if c_w != c or two_i % 2 or down.shape != (e, c, two_i // 2):
        raise ValueError(f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not fit x's {c} channels as [E, 2I, C] and [E, C, I]")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape or topk_ids.is_floating_point():
        raise ValueError(f"topk_ids must be integer [T={t}, k] and topk_weights the same shape; got {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"x, gate_up and down must share one float dtype; got {x.dtype}, {gate_up.dtype}, {down.dtype}")
    if not (x.is_contiguous() and gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("x, gate_up and down must be contiguous")
    if len({x.device, gate_up.device, down.device, topk_ids.device, topk_weights.device}) != 1:
        raise ValueError("every tensor must be on one device")


@on_tensor_device
def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' output ``[T, C]`` in x's dtype (module docstring). No host read of a
    device value and no value-dependent shape: capturable in a CUDA graph.

    Args:
        x: ``[T, C]`` tokens.
        gate_up: ``[E, 2I, C]`` each expert's gate then up projection.
        down: ``[E, C, I]`` each expert's down projection.
        topk_ids: ``[T, k]`` chosen experts, distinct per token, in ``[0, E)`` (not checked on
            the host: an id out of range reads outside the weights).
        topk_weights: ``[T, k]`` their routing weights.

    Raises:
        ValueError: shapes, dtypes, devices or layouts that do not match.
    """
    _check(x, gate_up, down, topk_ids, topk_weights)
    t, c = x.shape
    e, two_i, _ = gate_up.shape
    i = two_i // 2
    k = topk_ids.shape[1]
    pairs = t * k
    if pairs == 0:
        return torch.zeros_like(x)
    sorted_pairs, block_expert = moe_align(topk_ids, e)
    # full-precision dots for fp32, and for bf16 under Triton's interpreter (which multiplies bf16's raw bits)
    fp32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")
    route = topk_weights.reshape(-1).contiguous()
    h = torch.empty((pairs, i), dtype=x.dtype, device=x.device)
    _moe_gemm_kernel[(block_expert.shape[0], triton.cdiv(i, BLOCK_N))](
        x, gate_up, h, sorted_pairs, block_expert, route, pairs, i, c, x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        PAIRS_PER_A_ROW=k, GATED=True, ROUTED=False, FP32=fp32, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
    )  # fmt: skip
    y = torch.empty((pairs, c), dtype=x.dtype, device=x.device)
    _moe_gemm_kernel[(block_expert.shape[0], triton.cdiv(c, BLOCK_N))](
        h, down, y, sorted_pairs, block_expert, route, pairs, c, i, h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        PAIRS_PER_A_ROW=1, GATED=False, ROUTED=True, FP32=fp32, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
    )  # fmt: skip
    return y.view(t, k, c).sum(1, dtype=torch.float32).to(x.dtype)


def fused_moe_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The plain-torch fp32 reference of :func:`fused_moe` (same arguments), one token and choice
    at a time; returns fp32 ``[T, C]``."""
    _check(x, gate_up, down, topk_ids, topk_weights)
    i = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            xt = x[t].float()
            h = torch.nn.functional.silu(gate_up[e, :i].float() @ xt) * (gate_up[e, i:].float() @ xt)
            out[t] += float(topk_weights[t, j]) * (down[e].float() @ h)
    return out
