"""DeepSeek-V4's compressed attention: each query attends to its sliding window of uncompressed
rows plus compressed entries — the ones the lightning indexer selected (CSA) or every entry whose
group has ended (HCA) — with one shared key/value head (K = V) and a learned sink per head.

What is computed (DeepSeek-V4 paper §2.3; the engine's torch path is
:func:`engine.model.deepseek_v4_attention.sink_attention` over
``DeepseekV4Attention._window_and_compressed``'s keys), for query ``t`` at position ``p_t`` and
head ``h``::

    window keys    s with 0 <= p_t - window_positions[s] < W
    entries  CSA:  indices[t, i] where valid[t, i]      HCA: w < floor((p_t + 1) / r)
    o[t, h] = sum_j softmax_j(scale * q[t, h] . K_j ; sink_h) K_j

where the sink only adds ``exp(sink_h)`` to the denominator (gpt-oss's learned sink).

Layouts: ``q``, ``out``: ``[T, H, D]``; ``window_kv``: ``[S, D]`` (the window's rows, stored
positions ``window_positions [S]``); ``entries``: ``[N, D]``; ``positions``: ``[T]`` int;
``indices`` ``[T, K]`` int32 (distinct within a row among the valid slots, as a top-k gives
them) and ``valid`` ``[T, K]`` bool for CSA (None for HCA, which then
needs ``ratio``); ``sinks``: ``[H]`` float32. One program per (query, tile of ``BLOCK_H`` heads)
walks the window rows and then the entries with an online softmax in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import on_tensor_device

BLOCK_S = 32
"""Window rows or entries one step of a program reads."""
BLOCK_H = 16
"""Query heads one program holds."""


@triton.jit
def _online_step(b_q, b_k, m_key, b_m, b_l, b_acc, scale):
    """One tile of keys (shared with the values) into the running softmax of ``b_q``."""
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scale  # [BLOCK_H, BLOCK_S]
    b_s = tl.where(m_key[None, :], b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
    b_alpha = tl.exp(b_m - b_m_new)
    b_p = tl.exp(b_s - b_m_new[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_k, input_precision="ieee")
    return b_m_new, b_l, b_acc


@triton.jit
def _sparse_kernel(
    q_ptr, win_ptr, win_pos_ptr, ent_ptr, pos_ptr, idx_ptr, valid_ptr, sinks_ptr, out_ptr,
    num_window, num_entries, num_selected, window, ratio, scale,
    s_qt, s_qh, s_win, s_ent, s_it, s_vt, s_ot, s_oh,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    SELECTED: tl.constexpr,
):  # fmt: skip
    i_t = tl.program_id(0).to(tl.int64)
    i_hb = tl.program_id(1)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < HEADS
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < HEAD_DIM
    o_s = tl.arange(0, BLOCK_S)
    b_q = tl.load(q_ptr + i_t * s_qt + o_h[:, None] * s_qh + o_d[None, :], mask=m_h[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    b_m = tl.load(sinks_ptr + o_h, mask=m_h, other=0.0)  # the sink starts the running max ...
    b_l = tl.full((BLOCK_H,), 1.0, dtype=tl.float32)  # ... with exp(sink - sink) in the sum
    b_acc = tl.zeros((BLOCK_H, D_PAD), dtype=tl.float32)
    pos = tl.load(pos_ptr + i_t).to(tl.int64)
    for i_s in range(0, num_window, BLOCK_S):  # the window
        o_row = i_s + o_s
        m_row = o_row < num_window
        key_pos = tl.load(win_pos_ptr + o_row, mask=m_row, other=0).to(tl.int64)
        m_key = m_row & (key_pos <= pos) & (pos - key_pos < window)
        b_k = tl.load(win_ptr + o_row[:, None].to(tl.int64) * s_win + o_d[None, :], mask=m_key[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_m, b_l, b_acc = _online_step(b_q, b_k, m_key, b_m, b_l, b_acc, scale)
    if SELECTED:  # CSA: the indexer's choice
        for i_s in range(0, num_selected, BLOCK_S):
            o_i = i_s + o_s
            m_i = o_i < num_selected
            b_valid = tl.load(valid_ptr + i_t * s_vt + o_i, mask=m_i, other=0) != 0
            b_idx = tl.load(idx_ptr + i_t * s_it + o_i, mask=m_i, other=0).to(tl.int64)
            m_key = m_i & b_valid
            b_k = tl.load(ent_ptr + b_idx[:, None] * s_ent + o_d[None, :], mask=m_key[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            b_m, b_l, b_acc = _online_step(b_q, b_k, m_key, b_m, b_l, b_acc, scale)
    else:  # HCA: every entry whose group has ended
        visible = tl.minimum((pos + 1) // ratio, num_entries)
        for i_s in range(0, visible, BLOCK_S):
            o_row = i_s + o_s
            m_key = o_row < visible
            b_k = tl.load(ent_ptr + o_row[:, None].to(tl.int64) * s_ent + o_d[None, :], mask=m_key[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            b_m, b_l, b_acc = _online_step(b_q, b_k, m_key, b_m, b_l, b_acc, scale)
    b_o = b_acc / b_l[:, None]
    tl.store(out_ptr + i_t * s_ot + o_h[:, None] * s_oh + o_d[None, :], b_o.to(out_ptr.dtype.element_ty), mask=m_h[:, None] & m_d[None, :])


def _check(
    q: torch.Tensor, window_kv: torch.Tensor, window_positions: torch.Tensor, entries: torch.Tensor, positions: torch.Tensor,
    sinks: torch.Tensor, indices: torch.Tensor | None, valid: torch.Tensor | None, ratio: int | None, window: int,
) -> None:  # fmt: skip
    if q.dim() != 3 or window_kv.dim() != 2 or entries.dim() != 2 or window_kv.shape[1] != q.shape[2] or entries.shape[1] != q.shape[2]:
        raise ValueError(f"q must be [T, H, D], window_kv [S, D] and entries [N, D]; got {tuple(q.shape)}, {tuple(window_kv.shape)}, {tuple(entries.shape)}")
    t, h, _ = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or window_kv.dtype != q.dtype or entries.dtype != q.dtype:
        raise ValueError(f"q, window_kv and entries must share one float dtype; got {q.dtype}, {window_kv.dtype}, {entries.dtype}")
    if q.stride(-1) != 1 or window_kv.stride(-1) != 1 or entries.stride(-1) != 1:
        raise ValueError("q, window_kv and entries must be contiguous in their last dim")
    if (
        window_positions.shape != window_kv.shape[:1] or positions.shape != (t,) or window_positions.is_floating_point()
        or positions.is_floating_point() or not window_positions.is_contiguous() or not positions.is_contiguous()
    ):  # fmt: skip
        raise ValueError("window_positions must be contiguous integers [S] and positions contiguous integers [T]")
    if sinks.shape != (h,) or sinks.dtype != torch.float32:
        raise ValueError(f"sinks must be float32 [H={h}]; got {sinks.dtype} {tuple(sinks.shape)}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if (indices is None) != (valid is None):
        raise ValueError("indices and valid go together (CSA); neither for HCA")
    if indices is None:
        if ratio is None or ratio < 1:
            raise ValueError("HCA (no indices) needs ratio >= 1")
    elif valid is not None:
        if indices.dim() != 2 or indices.shape[0] != t or indices.dtype != torch.int32 or valid.shape != indices.shape or valid.dtype != torch.bool or indices.stride(-1) != 1:
            raise ValueError(f"indices must be int32 [T={t}, K] (row-major) and valid bool of the same shape; got {indices.dtype} {tuple(indices.shape)}, {valid.dtype} {tuple(valid.shape)}")
        if bool(valid.any()) and not 0 <= int(indices[valid].min()) <= int(indices[valid].max()) < entries.shape[0]:
            raise ValueError(f"a valid index is outside 0..{entries.shape[0] - 1}")
    tensors = [q, window_kv, window_positions, entries, positions, sinks, *(x for x in (indices, valid) if x is not None)]
    if len({x.device for x in tensors}) != 1:
        raise ValueError("every tensor must be on one device")


@on_tensor_device
def sparse_compressed_attention(
    q: torch.Tensor, window_kv: torch.Tensor, window_positions: torch.Tensor, entries: torch.Tensor, positions: torch.Tensor,
    sinks: torch.Tensor, *, scale: float, window: int,
    indices: torch.Tensor | None = None, valid: torch.Tensor | None = None, ratio: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``out [T, H, D]`` in q's dtype (module docstring). CSA: pass ``indices`` and ``valid``;
    HCA: pass ``ratio``.

    Raises:
        ValueError: shapes, dtypes, strides or devices that do not match the layouts; a window
            below 1; indices without valid (or the reverse); HCA without a ratio; a valid index
            outside the entries.
    """
    _check(q, window_kv, window_positions, entries, positions, sinks, indices, valid, ratio, window)
    t, h, d = q.shape
    out = torch.empty_like(q)
    if t == 0:
        return out
    selected = indices is not None
    idx = indices if indices is not None else positions
    val = valid.to(torch.int8).contiguous() if valid is not None else positions
    _sparse_kernel[(t, triton.cdiv(h, BLOCK_H))](
        q, window_kv, window_positions, entries, positions, idx, val, sinks, out,
        window_kv.shape[0], entries.shape[0], indices.shape[1] if indices is not None else 0, window, ratio or 1, scale,
        q.stride(0), q.stride(1), window_kv.stride(0), entries.stride(0), idx.stride(0) if selected else 0,
        val.stride(0) if selected else 0, out.stride(0), out.stride(1),
        HEADS=h, HEAD_DIM=d, D_PAD=max(triton.next_power_of_2(d), 16), BLOCK_H=BLOCK_H, BLOCK_S=BLOCK_S, SELECTED=selected,
    )  # fmt: skip
    return out


def sparse_compressed_attention_ref(
    q: torch.Tensor, window_kv: torch.Tensor, window_positions: torch.Tensor, entries: torch.Tensor, positions: torch.Tensor,
    sinks: torch.Tensor, *, scale: float, window: int,
    indices: torch.Tensor | None = None, valid: torch.Tensor | None = None, ratio: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """The plain-torch fp32 reference (the visibility masks, then the engine's ``sink_attention``
    math in fp32); returns fp32 ``[T, H, D]``."""
    _check(q, window_kv, window_positions, entries, positions, sinks, indices, valid, ratio, window)
    t, n = q.shape[0], entries.shape[0]
    delta = positions.long()[:, None] - window_positions.long()[None, :]
    window_visible = (delta >= 0) & (delta < window)
    if indices is not None and valid is not None:
        chosen = torch.zeros((t, n), dtype=torch.bool, device=q.device)
        if n:
            chosen.scatter_(1, indices.long().clamp(0, n - 1), valid)
    else:
        assert ratio is not None
        chosen = torch.arange(n, device=q.device)[None, :] < torch.div(positions.long() + 1, ratio, rounding_mode="floor")[:, None]
    keys = torch.cat((window_kv, entries)).float()
    visible = torch.cat((window_visible, chosen), dim=1)
    logits = torch.einsum("thd,sd->hts", q.float(), keys) * scale
    logits = logits.masked_fill(~visible[None], float("-inf"))
    combined = torch.cat((logits, sinks.view(-1, 1, 1).expand(-1, t, 1)), dim=-1)
    probs = combined.softmax(dim=-1)[..., :-1]
    return torch.einsum("hts,sd->thd", probs, keys)
