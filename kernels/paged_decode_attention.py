"""Decode-time attention over a paged KV cache: one query token per sequence attends to the keys
and values its block table points at, with grouped-query heads, an optional sliding window and
an optional attention sink; padding rows of a decode batch (``seq_lens == 0``, their block table
on the sentinel page) are skipped and their output is zero.

What is computed, per sequence ``b`` and query head ``h`` (KV head ``g = h // (H_q / H_kv)``)::

    keys  j in [start_b, L_b),   L_b = seq_lens[b],   start_b = max(0, L_b - window) or 0
    s_j   = scale * q[b, h] . K[b, j, g]
    o[b, h] = sum_j softmax_j(s ; sink_h) V[b, j, g]

where ``softmax(s ; sink)`` adds ``exp(sink_h)`` to the denominator only (the sink is a logit
with no value: StreamingLLM's attention sink, Xiao et al. 2023, in the learned-per-head form of
gpt-oss), and ``K[b, j]`` is row ``j % P`` of page ``block_tables[b, j // P]``.

Layouts:

* ``q``: ``[B, H_q, D]``; ``out``: ``[B, H_q, D]`` (written for every row; zero for padding rows).
* ``k_cache``, ``v_cache``: ``[num_blocks, P, H_kv, D]``, any strides (a layer's slice of the
  engine's ``[num_blocks, layers, 2, P, H_kv, D]`` pages is one).
* ``block_tables``: ``[B, max_blocks]`` int32, page ids; ``seq_lens``: ``[B]`` int32, tokens in
  the cache for each sequence (the current token's key and value already written).
* ``sinks``: ``[H_q]`` float32 logits, or None.

One program per (sequence, KV head) holds the group's query heads and walks the sequence's pages
with an online softmax (Milakov and Gimelshein 2018; FlashAttention's rescaling), in fp32
whatever the input dtype. The same contract as vLLM's ``paged_attention_v1`` for decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import graph_safe, on_tensor_device


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, sinks_ptr,
    scale, window,
    s_qb, s_qh, s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, s_ob, s_oh, s_tb,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, HAS_SINK: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    i_b = tl.program_id(0).to(tl.int64)
    i_g = tl.program_id(1)
    o_h = i_g * GROUP + tl.arange(0, G_PAD)  # the group's query heads
    m_h = tl.arange(0, G_PAD) < GROUP
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < HEAD_DIM
    seq_len = tl.load(lens_ptr + i_b)
    p_out = out_ptr + i_b * s_ob + o_h[:, None] * s_oh + o_d[None, :]
    if seq_len == 0:  # a padding row: nothing to read
        tl.store(p_out, tl.zeros((G_PAD, D_PAD), dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=m_h[:, None] & m_d[None, :])
        return
    b_q = tl.load(q_ptr + i_b * s_qb + o_h[:, None] * s_qh + o_d[None, :], mask=m_h[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    if HAS_SINK:
        b_m = tl.load(sinks_ptr + o_h, mask=m_h, other=0.0).to(tl.float32)  # the sink starts the running max
        b_l = tl.full((G_PAD,), 1.0, dtype=tl.float32)  # exp(sink - sink)
    else:
        b_m = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
        b_l = tl.zeros((G_PAD,), dtype=tl.float32)
    b_acc = tl.zeros((G_PAD, D_PAD), dtype=tl.float32)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    o_p = tl.arange(0, PAGE)
    for i_page in range(start // PAGE, tl.cdiv(seq_len, PAGE)):
        block = tl.load(tables_ptr + i_b * s_tb + i_page).to(tl.int64)
        o_tok = i_page * PAGE + o_p
        m_tok = (o_tok >= start) & (o_tok < seq_len)
        p_k = k_ptr + block * s_kn + o_p[:, None] * s_kp + i_g * s_kh + o_d[None, :]
        p_v = v_ptr + block * s_vn + o_p[:, None] * s_vp + i_g * s_vh + o_d[None, :]
        b_k = tl.load(p_k, mask=m_tok[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [PAGE, D_PAD]
        b_v = tl.load(p_v, mask=m_tok[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_s = tl.sum(b_q[:, None, :] * b_k[None, :, :], axis=2) * scale  # [G_PAD, PAGE]
        b_s = tl.where(m_tok[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp(b_m - b_m_new)
        b_p = tl.exp(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.sum(b_p[:, :, None] * b_v[None, :, :], axis=1)
        b_m = b_m_new
    b_o = b_acc / b_l[:, None]
    tl.store(p_out, b_o.to(out_ptr.dtype.element_ty), mask=m_h[:, None] & m_d[None, :])


def _check(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, sinks: torch.Tensor | None
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be [B, H_q, D] and k_cache, v_cache one [num_blocks, P, H_kv, D] shape; got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    b, h_q, d = q.shape
    num_blocks, page, h_kv, d_kv = k_cache.shape
    if d != d_kv:
        raise ValueError(f"q's head dim {d} differs from the cache's {d_kv}")
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"{h_q} query heads cannot be grouped over {h_kv} KV heads")
    if page & (page - 1):
        raise ValueError(f"page size {page} must be a power of two")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share one float dtype; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s head dim must be contiguous (strides {t.stride()})")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables must be a row-contiguous int32 [B={b}, max_blocks] tensor; got {block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.shape != (b,) or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be a contiguous int32 [B={b}] tensor; got {seq_lens.dtype} {tuple(seq_lens.shape)} strides {seq_lens.stride()}")
    if b and not graph_safe(seq_lens) and int(seq_lens.max()) > block_tables.shape[1] * page:  # host reads: kernels.launch
        raise ValueError(f"a sequence of {int(seq_lens.max())} tokens does not fit {block_tables.shape[1]} pages of {page}")
    if b and not graph_safe(seq_lens) and (int(seq_lens.min()) < 0 or (block_tables.numel() and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < num_blocks)):
        raise ValueError(f"seq_lens must be >= 0 and block ids in 0..{num_blocks - 1}")
    if sinks is not None and (sinks.shape != (h_q,) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks must be a float32 [H_q={h_q}] tensor; got {sinks.dtype} {tuple(sinks.shape)}")
    if len({t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, *([sinks] if sinks is not None else []))}) != 1:
        raise ValueError("every tensor must be on one device")


@on_tensor_device
def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention ``[B, H_q, D]`` (see the module docstring for the layouts).

    Args:
        window: attend to the last ``window`` tokens only (sliding-window layers); None: all.
        sinks: per-query-head sink logits ``[H_q]`` float32, or None.
        out: where to write (``[B, H_q, D]``, q's dtype); a new tensor when None.

    Raises:
        ValueError: a shape, dtype, stride or device that does not match the layouts; a window
            below 1; a sequence longer than its block table; a block id out of range (the
            last two are not checked while :func:`kernels.launch.graph_safe`: no host reads).
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, sinks)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    b, h_q, d = q.shape
    h_kv, page = k_cache.shape[2], k_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"out must be a {q.dtype} {tuple(q.shape)} tensor with a contiguous head dim")
    if b == 0:
        return out
    group = h_q // h_kv
    _paged_decode_kernel[(b, h_kv)](
        q, k_cache, v_cache, out, block_tables, seq_lens, sinks if sinks is not None else seq_lens,
        scale, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_tables.stride(0),
        HEAD_DIM=d, GROUP=group, PAGE=page, G_PAD=max(triton.next_power_of_2(group), 1), D_PAD=triton.next_power_of_2(d),
        HAS_SINK=sinks is not None, HAS_WINDOW=window is not None,
    )  # fmt: skip
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain-torch fp32 reference of :func:`paged_decode_attention` (same arguments), one
    sequence at a time; returns fp32 ``[B, H_q, D]``."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, sinks)
    b, h_q, d = q.shape
    page, h_kv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros((b, h_q, d), dtype=torch.float32, device=q.device)
    for i in range(b):
        length = int(seq_lens[i])
        if length == 0:
            continue
        pages = block_tables[i, : (length + page - 1) // page].long()
        keys = k_cache[pages].reshape(-1, h_kv, d)[:length].float()  # [L, H_kv, D]
        values = v_cache[pages].reshape(-1, h_kv, d)[:length].float()
        start = max(0, length - window) if window is not None else 0
        keys, values = keys[start:], values[start:]
        keys = keys.repeat_interleave(h_q // h_kv, dim=1)  # [L, H_q, D]
        values = values.repeat_interleave(h_q // h_kv, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), keys) * scale  # [H_q, L]
        if sinks is not None:
            scores = torch.cat([scores, sinks[:, None].float()], dim=1)
        probs = scores.softmax(dim=-1)[:, : keys.shape[0]]
        out[i] = torch.einsum("hl,lhd->hd", probs, values)
    return out
