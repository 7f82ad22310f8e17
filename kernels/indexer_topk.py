"""DeepSeek-V4's lightning indexer: the index score of every query against every compressed index
key, and the top-k keys each query may see (causal at compressed granularity).

What is computed (DeepSeek-V4 paper §2.3.1 eqs. 13-17; the engine's torch path is
:meth:`engine.model.deepseek_v4_compressor.Indexer.select`)::

    I[t, s] = scale * sum_h w[t, h] * ReLU(q[t, h] . K[s])        for s < visible[t]
    visible[t] = floor((positions[t] + 1) / r)                     (groups ending at or before t)
    top[t]   = the min(k, N) highest I[t, s], ties to the earlier s; slots past visible[t] invalid

Layouts: ``q``: ``[T, H_I, D_I]`` (rotated queries); ``keys``: ``[N, D_I]`` (the index keys of
every complete group); ``weights``: ``[T, H_I]`` float32 (the per-token head weights, already
scaled); ``positions``: ``[T]`` int32/int64. Results: ``scores [T, N]`` float32 (-inf where not
visible), ``indices [T, K]`` int32 and ``valid [T, K]`` bool, ``K = min(k, N)``.

Two kernels: one program scores ``BLOCK_N`` keys for one query (every head), one program picks
one query's top-k with a sort of its whole row (``N`` ≤ :data:`MAX_KEYS`) on keys that pack the
score's order-preserving bits above the reversed index, so ties go to the earlier entry as the
engine's stable sort does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import on_tensor_device

BLOCK_N = 64
"""Keys one scoring program handles."""
MAX_KEYS = 16384
"""Most index keys a query's top-k sorts in one program."""


@triton.jit
def _score_kernel(
    q_ptr, k_ptr, w_ptr, pos_ptr, out_ptr, num_keys, scale, ratio,
    s_qt, s_qh, s_kn, s_wt, s_ot,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    i_t = tl.program_id(0).to(tl.int64)
    i_n = tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < num_keys
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < HEAD_DIM
    b_k = tl.load(k_ptr + o_n[:, None].to(tl.int64) * s_kn + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    b_s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i_h in range(HEADS):
        b_q = tl.load(q_ptr + i_t * s_qt + i_h * s_qh + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_w = tl.load(w_ptr + i_t * s_wt + i_h).to(tl.float32)
        b_s += b_w * tl.maximum(tl.sum(b_k * b_q[None, :], axis=1), 0.0)
    visible = (tl.load(pos_ptr + i_t).to(tl.int64) + 1) // ratio
    b_s = tl.where(o_n < visible, b_s * scale, float("-inf"))
    tl.store(out_ptr + i_t * s_ot + o_n, b_s, mask=m_n)


@triton.jit
def _topk_kernel(scores_ptr, idx_ptr, valid_ptr, num_keys, k, s_st, s_it, N_PAD: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, N_PAD)
    m_n = o_n < num_keys
    b_s = tl.load(scores_ptr + i_t * s_st + o_n, mask=m_n, other=float("-inf"))
    # order-preserving integer of the float (sign-magnitude to two's complement), then the
    # reversed index below it: one descending sort ranks by score, ties to the smaller index
    b_bits = b_s.to(tl.int32, bitcast=True)
    b_ordered = tl.where(b_bits < 0, b_bits ^ 0x7FFFFFFF, b_bits).to(tl.int64)
    b_key = (b_ordered << 32) | (N_PAD - 1 - o_n).to(tl.int64)
    b_key = tl.where(m_n, b_key, tl.full((N_PAD,), -9223372036854775808, tl.int64))  # padding sorts last
    b_sorted = tl.sort(b_key, descending=True)
    b_idx = (N_PAD - 1 - (b_sorted & 0xFFFFFFFF)).to(tl.int32)
    b_ninf = tl.full((N_PAD,), float("-inf"), tl.float32).to(tl.int32, bitcast=True)
    b_ninf = (b_ninf ^ 0x7FFFFFFF).to(tl.int64)  # -inf's ordered integer (it is negative)
    b_valid = (b_sorted >> 32) > b_ninf  # a visible key
    m_k = o_n < k
    tl.store(idx_ptr + i_t * s_it + o_n, b_idx, mask=m_k)
    tl.store(valid_ptr + i_t * s_it + o_n, b_valid.to(tl.int8), mask=m_k)


def _check(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, ratio: int, k: int) -> None:
    if q.dim() != 3 or keys.dim() != 2 or q.shape[2] != keys.shape[1]:
        raise ValueError(f"q must be [T, H_I, D_I] and keys [N, D_I]; got {tuple(q.shape)}, {tuple(keys.shape)}")
    t, h, _ = q.shape
    if weights.shape != (t, h) or weights.dtype != torch.float32:
        raise ValueError(f"weights must be float32 [T={t}, H_I={h}]; got {weights.dtype} {tuple(weights.shape)}")
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64) or not positions.is_contiguous():
        raise ValueError(f"positions must be a contiguous int32/int64 [T={t}]; got {positions.dtype} {tuple(positions.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or keys.dtype != q.dtype:
        raise ValueError(f"q and keys must share one float dtype; got {q.dtype}, {keys.dtype}")
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or weights.stride(-1) != 1:
        raise ValueError("q, keys and weights must be contiguous in their last dim")
    if ratio < 1 or k < 1:
        raise ValueError(f"ratio and k must be >= 1; got {ratio}, {k}")
    if keys.shape[0] > MAX_KEYS:
        raise ValueError(f"{keys.shape[0]} index keys exceed the {MAX_KEYS} one program sorts")
    if len({x.device for x in (q, keys, weights, positions)}) != 1:
        raise ValueError("every tensor must be on one device")


@on_tensor_device
def indexer_topk(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, *, ratio: int, k: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scores [T, N] float32, indices [T, K] int32, valid [T, K] bool)`` (module docstring).

    Raises:
        ValueError: shapes, dtypes, strides or devices that do not match the layouts; ``ratio``
            or ``k`` below 1; more than :data:`MAX_KEYS` keys.
    """
    _check(q, keys, weights, positions, ratio, k)
    t, heads, d = q.shape
    n = keys.shape[0]
    kk = min(k, n)
    scores = torch.empty((t, n), dtype=torch.float32, device=q.device)
    indices = torch.empty((t, kk), dtype=torch.int32, device=q.device)
    valid = torch.empty((t, kk), dtype=torch.int8, device=q.device)
    if t == 0 or n == 0:
        return scores, indices, valid.bool()
    _score_kernel[(t, triton.cdiv(n, BLOCK_N))](
        q, keys, weights, positions, scores, n, scale, ratio,
        q.stride(0), q.stride(1), keys.stride(0), weights.stride(0), scores.stride(0),
        HEADS=heads, HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), BLOCK_N=BLOCK_N,
    )  # fmt: skip
    _topk_kernel[(t,)](scores, indices, valid, n, kk, scores.stride(0), indices.stride(0), N_PAD=triton.next_power_of_2(n))
    return scores, indices, valid.bool()


def indexer_topk_ref(
    q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, *, ratio: int, k: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain-torch fp32 reference of :func:`indexer_topk` (the engine's scoring and stable
    descending sort)."""
    _check(q, keys, weights, positions, ratio, k)
    t, n = q.shape[0], keys.shape[0]
    scores = (torch.relu(torch.einsum("thd,nd->thn", q.float(), keys.float())) * scale * weights[:, :, None]).sum(dim=1)
    visible = torch.div(positions.long() + 1, ratio, rounding_mode="floor")
    scores = scores.masked_fill(torch.arange(n, device=q.device)[None, :] >= visible[:, None], float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : min(k, n)]
    valid = order < visible[:, None] if t else order.bool()
    return scores, order.to(torch.int32), valid


def chosen_mask(indices: torch.Tensor, valid: torch.Tensor, num_keys: int) -> torch.Tensor:
    """The ``[T, N]`` bool mask of the valid chosen keys (what the engine's ``select`` returns)."""
    chosen = torch.zeros((indices.shape[0], num_keys), dtype=torch.bool, device=indices.device)
    return chosen.scatter_(1, indices.long(), valid)
