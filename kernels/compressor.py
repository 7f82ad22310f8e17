"""DeepSeek-V4's gated pooling: every group of ``r`` projected source rows becomes one compressed
entry (the KV compressors of CSA and HCA and the indexer's key compressor), before the entry's
RMSNorm and RoPE, which stay elementwise torch.

What is computed (DeepSeek-V4 paper §2.3.1 eqs. 9-12 and §2.3.2 eqs. 20-23; transformers'
``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor``; the engine's torch path is
:class:`engine.model.deepseek_v4_compressor.Compressor`), for entry ``w`` and channel ``c``::

    non-overlapping (HCA, F = D):   slots j < r:   C_j = kv[w r + j, c],   Z_j = gate[w r + j, c] + B[j, c]
    overlapping (CSA, F = 2 D):     slots j < r:   C_j = kv[(w-1) r + j, c],       Z_j = gate[(w-1) r + j, c] + B[j, c]
                                    slots r + j:   C_{r+j} = kv[w r + j, D + c],   Z_{r+j} = gate[w r + j, D + c] + B[j, D + c]
    pooled[w, c] = sum_j softmax_j(Z)[j] C_j          (softmax per channel over the slots, fp32)

For an overlapping compressor the slots of entry 0 come from ``prev_kv`` / ``prev_gate``
(``[r, D]``: the first halves of the group before this call's rows) or, with no previous group,
get weight 0.

Layouts: ``kv``, ``gate``: ``[n r, F]`` (the rows of ``n`` complete groups, gate logits before
the bias); ``bias``: ``[r, F]`` float32; ``prev_kv``, ``prev_gate``: ``[r, D]`` or None; out:
``[n, D]`` in kv's dtype. One program pools ``BLOCK_D`` channels of one entry.

:func:`compressor_decode_step` is the decode form: one new row goes into the open group's
pending rows (a static ``[r, F]`` buffer and a count), and when it completes the group the entry
is pooled by the same kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import on_tensor_device

BLOCK_D = 64
"""Channels one program pools."""


@triton.jit
def _pool_kernel(
    kv_ptr, gate_ptr, bias_ptr, prev_kv_ptr, prev_gate_ptr, out_ptr,
    s_row, s_out,
    RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, OVERLAPPING: tl.constexpr, HAS_PREV: tl.constexpr,
    R_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    i_w = tl.program_id(0)
    i_c = tl.program_id(1)
    o_c = i_c * BLOCK_D + tl.arange(0, BLOCK_D)
    m_c = o_c < HEAD_DIM
    o_j = tl.arange(0, R_PAD)
    m_j = o_j < RATIO
    m = m_j[:, None] & m_c[None, :]
    o_rows = (i_w * RATIO + o_j).to(tl.int64)
    if OVERLAPPING:
        f_width = 2 * HEAD_DIM
        # this group's second halves
        b_kv = tl.load(kv_ptr + o_rows[:, None] * s_row + HEAD_DIM + o_c[None, :], mask=m, other=0.0).to(tl.float32)
        b_z = tl.load(gate_ptr + o_rows[:, None] * s_row + HEAD_DIM + o_c[None, :], mask=m, other=0.0).to(tl.float32)
        b_z += tl.load(bias_ptr + o_j[:, None] * f_width + HEAD_DIM + o_c[None, :], mask=m, other=0.0)
        b_z = tl.where(m, b_z, float("-inf"))
        # the previous group's first halves: rows of this call, or prev_* for entry 0
        m_in = m & (i_w > 0)
        p_rows = tl.maximum(o_rows - RATIO, 0)
        b_pkv = tl.load(kv_ptr + p_rows[:, None] * s_row + o_c[None, :], mask=m_in, other=0.0).to(tl.float32)
        b_pz = tl.load(gate_ptr + p_rows[:, None] * s_row + o_c[None, :], mask=m_in, other=0.0).to(tl.float32)
        m_prev = m_in
        if HAS_PREV:
            m_first = m & (i_w == 0)
            b_pkv += tl.load(prev_kv_ptr + o_j[:, None] * HEAD_DIM + o_c[None, :], mask=m_first, other=0.0).to(tl.float32)
            b_pz += tl.load(prev_gate_ptr + o_j[:, None] * HEAD_DIM + o_c[None, :], mask=m_first, other=0.0).to(tl.float32)
            m_prev = m_prev | m_first
        b_pz += tl.load(bias_ptr + o_j[:, None] * f_width + o_c[None, :], mask=m, other=0.0)
        b_pz = tl.where(m_prev, b_pz, float("-inf"))  # entry 0 with no previous group: weight 0
        b_max = tl.maximum(tl.max(b_z, axis=0), tl.max(b_pz, axis=0))
        b_max = tl.where(b_max == float("-inf"), 0.0, b_max)  # channels past D: nothing to weigh
        b_e = tl.exp(b_z - b_max[None, :])
        b_pe = tl.exp(b_pz - b_max[None, :])
        b_num = tl.sum(b_e * b_kv, axis=0) + tl.sum(b_pe * b_pkv, axis=0)
        b_den = tl.sum(b_e, axis=0) + tl.sum(b_pe, axis=0)
    else:
        b_kv = tl.load(kv_ptr + o_rows[:, None] * s_row + o_c[None, :], mask=m, other=0.0).to(tl.float32)
        b_z = tl.load(gate_ptr + o_rows[:, None] * s_row + o_c[None, :], mask=m, other=0.0).to(tl.float32)
        b_z += tl.load(bias_ptr + o_j[:, None] * HEAD_DIM + o_c[None, :], mask=m, other=0.0)
        b_z = tl.where(m, b_z, float("-inf"))
        b_max = tl.max(b_z, axis=0)
        b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
        b_e = tl.exp(b_z - b_max[None, :])
        b_num = tl.sum(b_e * b_kv, axis=0)
        b_den = tl.sum(b_e, axis=0)
    b_out = b_num / tl.where(b_den > 0, b_den, 1.0)
    tl.store(out_ptr + i_w * s_out + o_c, b_out.to(out_ptr.dtype.element_ty), mask=m_c)


def _check(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, prev_kv: torch.Tensor | None, prev_gate: torch.Tensor | None, overlapping: bool) -> tuple[int, int]:
    if kv.dim() != 2 or gate.shape != kv.shape or kv.dtype != gate.dtype or kv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"kv and gate must be one float [n r, F] shape and dtype; got {kv.dtype} {tuple(kv.shape)}, {gate.dtype} {tuple(gate.shape)}")
    if bias.dim() != 2 or bias.shape[1] != kv.shape[1] or bias.dtype != torch.float32 or not bias.is_contiguous():
        raise ValueError(f"bias must be a contiguous float32 [r, F={kv.shape[1]}] tensor; got {bias.dtype} {tuple(bias.shape)}")
    ratio, width = bias.shape
    if overlapping and width % 2:
        raise ValueError(f"an overlapping compressor's rows are 2 D wide; got F = {width}")
    head_dim = width // 2 if overlapping else width
    if kv.shape[0] % ratio:
        raise ValueError(f"{kv.shape[0]} rows are not whole groups of {ratio}")
    for name, t in (("kv", kv), ("gate", gate)):
        if t.stride(1) != 1 or t.stride(0) != kv.stride(0):
            raise ValueError(f"{name} must be row-major with kv's row stride (strides {t.stride()})")
    if (prev_kv is None) != (prev_gate is None):
        raise ValueError("prev_kv and prev_gate go together")
    if prev_kv is not None and prev_gate is not None:
        if not overlapping:
            raise ValueError("only an overlapping compressor has a previous group")
        for name, t in (("prev_kv", prev_kv), ("prev_gate", prev_gate)):
            if t.shape != (ratio, head_dim) or t.dtype != kv.dtype or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {kv.dtype} [r={ratio}, D={head_dim}] tensor; got {t.dtype} {tuple(t.shape)}")
    if len({t.device for t in (kv, gate, bias, *(x for x in (prev_kv, prev_gate) if x is not None))}) != 1:
        raise ValueError("every tensor must be on one device")
    return ratio, head_dim


@on_tensor_device
def compress_pool(
    kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, *, overlapping: bool,
    prev_kv: torch.Tensor | None = None, prev_gate: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The pooled entries ``[n, D]`` of the groups in ``kv`` / ``gate`` (see the module docstring).

    Raises:
        ValueError: shapes, dtypes, strides or devices that do not match the layouts; rows that
            are not whole groups; a previous group for a non-overlapping compressor.
    """
    ratio, head_dim = _check(kv, gate, bias, prev_kv, prev_gate, overlapping)
    n = kv.shape[0] // ratio
    out = torch.empty((n, head_dim), dtype=kv.dtype, device=kv.device)
    if n == 0:
        return out
    has_prev = prev_kv is not None
    _pool_kernel[(n, triton.cdiv(head_dim, BLOCK_D))](
        kv, gate, bias, prev_kv if has_prev else kv, prev_gate if has_prev else gate, out, kv.stride(0), out.stride(0),
        RATIO=ratio, HEAD_DIM=head_dim, OVERLAPPING=overlapping, HAS_PREV=has_prev,
        R_PAD=triton.next_power_of_2(ratio), BLOCK_D=BLOCK_D,
    )  # fmt: skip
    return out


def compress_pool_ref(
    kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, *, overlapping: bool,
    prev_kv: torch.Tensor | None = None, prev_gate: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The plain-torch fp32 reference of :func:`compress_pool`; returns fp32 ``[n, D]``."""
    ratio, d = _check(kv, gate, bias, prev_kv, prev_gate, overlapping)
    n = kv.shape[0] // ratio
    group_kv = kv.float().view(n, ratio, -1)
    group_gate = gate.float().view(n, ratio, -1) + bias
    if overlapping:
        slot_kv = group_kv.new_zeros((n, 2 * ratio, d))
        slot_gate = group_gate.new_full((n, 2 * ratio, d), float("-inf"))
        slot_kv[:, ratio:], slot_gate[:, ratio:] = group_kv[..., d:], group_gate[..., d:]
        slot_kv[1:, :ratio], slot_gate[1:, :ratio] = group_kv[:-1, :, :d], group_gate[:-1, :, :d]
        if prev_kv is not None and prev_gate is not None and n:
            slot_kv[0, :ratio] = prev_kv.float()
            slot_gate[0, :ratio] = prev_gate.float() + bias[:, :d]
        group_kv, group_gate = slot_kv, slot_gate
    return (group_kv * group_gate.softmax(dim=1)).sum(dim=1)


@on_tensor_device
def compressor_decode_step(
    row_kv: torch.Tensor, row_gate: torch.Tensor, pending_kv: torch.Tensor, pending_gate: torch.Tensor, count: int,
    bias: torch.Tensor, *, overlapping: bool, prev_kv: torch.Tensor | None = None, prev_gate: torch.Tensor | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """One decode token: write its projected row ``row_kv`` / ``row_gate`` ``[F]`` into the
    pending rows ``[r, F]`` at ``count`` (the rows the open group already holds); if that
    completes the group, return its pooled entry ``[1, D]`` (the caller then starts a new group
    and, overlapping, keeps this group's first halves as the next ``prev``), else None.

    Raises:
        ValueError: ``count`` outside ``0 .. r-1``, or rows whose width or dtype do not match.
    """
    ratio = pending_kv.shape[0]
    if not 0 <= count < ratio:
        raise ValueError(f"count must be in 0..{ratio - 1}, got {count}")
    if row_kv.shape != pending_kv.shape[1:] or row_gate.shape != pending_gate.shape[1:] or row_kv.dtype != pending_kv.dtype:
        raise ValueError(f"a row must be [F={pending_kv.shape[1]}] {pending_kv.dtype}; got {row_kv.dtype} {tuple(row_kv.shape)}")
    pending_kv[count].copy_(row_kv)
    pending_gate[count].copy_(row_gate)
    if count + 1 < ratio:
        return None
    return compress_pool(pending_kv, pending_gate, bias, overlapping=overlapping, prev_kv=prev_kv, prev_gate=prev_gate)
