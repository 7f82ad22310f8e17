"""Chunked-prefill attention over a paged KV cache: each sequence's new chunk of query tokens
attends causally to its cached prefix and to the chunk itself, through its block table, for a
varlen batch (``cu_seqlens``), with grouped-query heads and an optional sliding window.

What is computed, for sequence ``b`` with ``n_b = cu_seqlens[b+1] - cu_seqlens[b]`` new tokens,
``L_b = seq_lens[b]`` tokens in its pages (the prefix and the chunk: the chunk's keys and values
are already written, as the engine's slot mapping does before attention), query token ``i`` of
the chunk at position ``p = L_b - n_b + i``, query head ``h``, KV head ``g = h // (H_q / H_kv)``::

    keys  j in [max(0, p - window + 1) or 0, p]
    o[t, h] = sum_j softmax_j(scale * q[t, h] . K[b, j, g]) V[b, j, g],   t = cu_seqlens[b] + i

with ``K[b, j]`` row ``j % P`` of page ``block_tables[b, j // P]``.

Layouts: ``q``, ``out``: ``[T, H_q, D]`` (the chunks packed, ``T = cu_seqlens[-1]``);
``k_cache``, ``v_cache``: ``[num_blocks, P, H_kv, D]`` with any strides; ``block_tables``:
``[N, max_blocks]`` int32; ``seq_lens``: ``[N]`` int32; ``cu_seqlens``: ``[N + 1]`` int32.

One program per (sequence, query head, tile of ``BLOCK_M`` chunk tokens) walks the pages its
tile can see with an online softmax in fp32 (FlashAttention-2's forward, Dao 2023, over pages as
in vLLM's prefix-prefill kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import on_tensor_device

BLOCK_M = 16
"""Chunk tokens one program holds."""


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, cu_ptr,
    scale, window,
    s_qt, s_qh, s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, s_ot, s_oh, s_tb,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    D_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_m = tl.program_id(2)
    i_g = i_h // GROUP
    first = tl.load(cu_ptr + i_b).to(tl.int64)
    n_new = tl.load(cu_ptr + i_b + 1).to(tl.int64) - first
    if i_m * BLOCK_M >= n_new:
        return
    seq_len = tl.load(lens_ptr + i_b)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # chunk tokens of this tile
    m_m = o_m < n_new
    o_pos = seq_len - n_new + o_m  # their positions in the sequence
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < HEAD_DIM
    p_q = q_ptr + (first + o_m)[:, None] * s_qt + i_h * s_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    b_m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    b_l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    b_acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
    last = tl.minimum(seq_len - n_new + (i_m + 1) * BLOCK_M, seq_len)  # past the tile's last position
    lowest = 0
    if HAS_WINDOW:
        lowest = tl.maximum(seq_len - n_new + i_m * BLOCK_M - window + 1, 0)
    o_p = tl.arange(0, PAGE)
    for i_page in range(lowest // PAGE, tl.cdiv(last, PAGE)):
        block = tl.load(tables_ptr + i_b * s_tb + i_page).to(tl.int64)
        o_key = i_page * PAGE + o_p
        m_key = o_key < seq_len
        b_k = tl.load(k_ptr + block * s_kn + o_p[:, None] * s_kp + i_g * s_kh + o_d[None, :], mask=m_key[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + block * s_vn + o_p[:, None] * s_vp + i_g * s_vh + o_d[None, :], mask=m_key[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scale  # [BLOCK_M, PAGE]
        m_s = m_m[:, None] & m_key[None, :] & (o_key[None, :] <= o_pos[:, None])
        if HAS_WINDOW:
            m_s = m_s & (o_key[None, :] > o_pos[:, None] - window)
        b_s = tl.where(m_s, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_base = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # a row with nothing seen yet
        b_alpha = tl.exp(b_m - b_base)
        b_p = tl.exp(b_s - b_base[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_v, input_precision="ieee")
        b_m = b_m_new
    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    p_out = out_ptr + (first + o_m)[:, None] * s_ot + i_h * s_oh + o_d[None, :]
    tl.store(p_out, b_o.to(out_ptr.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])


def _check(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens: torch.Tensor
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be [T, H_q, D] and k_cache, v_cache one [num_blocks, P, H_kv, D] shape; got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    t, h_q, d = q.shape
    num_blocks, page, h_kv, d_kv = k_cache.shape
    if d != d_kv or h_kv == 0 or h_q % h_kv:
        raise ValueError(f"q [T, {h_q}, {d}] does not group over the cache's [.., {h_kv}, {d_kv}] heads")
    if page & (page - 1) or page < 16:
        raise ValueError(f"page size {page} must be a power of two >= 16")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share one float dtype; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}'s head dim must be contiguous (strides {x.stride()})")
    n = block_tables.shape[0] if block_tables.dim() == 2 else -1
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables must be a row-contiguous int32 [N, max_blocks] tensor; got {block_tables.dtype} {tuple(block_tables.shape)}")
    if (
        seq_lens.shape != (n,) or seq_lens.dtype != torch.int32 or cu_seqlens.shape != (n + 1,) or cu_seqlens.dtype != torch.int32
        or not seq_lens.is_contiguous() or not cu_seqlens.is_contiguous()
    ):  # fmt: skip
        raise ValueError(f"seq_lens must be contiguous int32 [N={n}] and cu_seqlens contiguous int32 [N+1={n + 1}]; got {tuple(seq_lens.shape)}, {tuple(cu_seqlens.shape)}")
    new = cu_seqlens.diff()
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != t or bool((new < 0).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to T={t}")
    if bool((seq_lens < new).any()) or (n and int(seq_lens.max()) > block_tables.shape[1] * page):
        raise ValueError("each sequence's tokens must include its chunk and fit its block table")
    if block_tables.numel() and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < num_blocks:
        raise ValueError(f"block ids must be in 0..{num_blocks - 1}")
    if len({x.device for x in (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens)}) != 1:
        raise ValueError("every tensor must be on one device")


@on_tensor_device
def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the packed chunks ``q [T, H_q, D]`` over their paged sequences (see the
    module docstring); returns ``out [T, H_q, D]`` in q's dtype.

    Raises:
        ValueError: a shape, dtype, stride or device that does not match the layouts;
            ``cu_seqlens`` not rising from 0 to T; a chunk longer than its sequence, or a
            sequence longer than its block table; a block id out of range; a window below 1.
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"out must be a {q.dtype} {tuple(q.shape)} tensor with a contiguous head dim")
    t, h_q, d = q.shape
    n = seq_lens.shape[0]
    if t == 0:
        return out
    longest = int(cu_seqlens.diff().max())
    _paged_prefill_kernel[(n, h_q, triton.cdiv(longest, BLOCK_M))](
        q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens, scale, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_tables.stride(0),
        HEAD_DIM=d, GROUP=h_q // k_cache.shape[2], PAGE=k_cache.shape[1], BLOCK_M=BLOCK_M,
        D_PAD=max(triton.next_power_of_2(d), 16), HAS_WINDOW=window is not None,
    )  # fmt: skip
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The plain-torch fp32 reference of :func:`paged_prefill_attention`; returns fp32."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens)
    t, h_q, d = q.shape
    page, h_kv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros((t, h_q, d), dtype=torch.float32, device=q.device)
    for b in range(seq_lens.shape[0]):
        first, last, length = int(cu_seqlens[b]), int(cu_seqlens[b + 1]), int(seq_lens[b])
        if first == last:
            continue
        pages = block_tables[b, : (length + page - 1) // page].long()
        keys = k_cache[pages].reshape(-1, h_kv, d)[:length].float().repeat_interleave(h_q // h_kv, dim=1)  # [L, H_q, D]
        values = v_cache[pages].reshape(-1, h_kv, d)[:length].float().repeat_interleave(h_q // h_kv, dim=1)
        positions = torch.arange(length - (last - first), length, device=q.device)  # the chunk's
        key_pos = torch.arange(length, device=q.device)
        allowed = key_pos[None, :] <= positions[:, None]
        if window is not None:
            allowed &= key_pos[None, :] > positions[:, None] - window
        scores = torch.einsum("ihd,jhd->hij", q[first:last].float(), keys) * scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[first:last] = torch.einsum("hij,jhd->ihd", scores.softmax(dim=-1), values)
    return out
