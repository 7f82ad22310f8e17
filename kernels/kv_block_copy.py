"""Block copies between a cache pool and a staging buffer: the data path of swap-out (gather
pool blocks into a staging buffer bound for host or disk) and swap-in (scatter a staging buffer
back into pool blocks), for every form's layout.

What is computed, for ``i < N``::

    dst[dst_ids[i], ...] = src[src_ids[i], ...]

Layouts. Every pool tensor of the cache keeps its block (page, slot) index first and the block's
elements contiguous behind it, whatever the form:

* ``full_kv`` / ``swa_window`` pages: ``[num_blocks, layers, 2, U, H_kv, D]``;
* ``compressed_kv`` / ``indexer_state`` entry pages: ``[num_blocks, layers, page_entries, D]``;
* ``uncompressed_tail`` / indexer pending rows: ``[num_slots, layers, rows, D]``;
* ``linear_state`` checkpoints: conv ``[num_slots, layers, channels, K - 1]`` and recurrent
  ``[num_slots, layers, H, K, V]``.

So a copy sees ``src [S, *block]`` and ``dst [T, *block]`` as rows of ``E = prod(block)``
elements with row strides ``src.stride(0)`` / ``dst.stride(0)``; a staging buffer is simply a
tensor with ``N`` rows of the same block shape. ``src_ids`` / ``dst_ids`` are ``[N]`` int32 or
int64 row indices on the tensors' device. One program copies ``BLOCK`` elements of one row
(grid ``(N, cdiv(E, BLOCK))``); the loads and stores are masked at the row's end. The same as
vLLM's ``swap_blocks`` / ``copy_blocks`` cache ops, as one Triton kernel for every layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import on_tensor_device

BLOCK = 1024
"""Elements one program copies."""


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, row_elems, src_row_stride, dst_row_stride, BLOCK: tl.constexpr):
    i_n = tl.program_id(0)
    i_e = tl.program_id(1)
    i_src = tl.load(src_ids_ptr + i_n).to(tl.int64)
    i_dst = tl.load(dst_ids_ptr + i_n).to(tl.int64)
    o_e = i_e * BLOCK + tl.arange(0, BLOCK)
    m_e = o_e < row_elems
    b_x = tl.load(src_ptr + i_src * src_row_stride + o_e, mask=m_e)
    tl.store(dst_ptr + i_dst * dst_row_stride + o_e, b_x, mask=m_e)


def _check(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    if src.dtype != dst.dtype:
        raise ValueError(f"src is {src.dtype} but dst is {dst.dtype}")
    if src.dim() < 1 or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must share their block shape (all but dim 0)")
    if src.device != dst.device or src_ids.device != src.device or dst_ids.device != src.device:
        raise ValueError("src, dst and both id tensors must be on one device")
    for name, t in (("src", src), ("dst", dst)):
        if t[0:1].numel() and not t[0].is_contiguous():
            raise ValueError(f"{name}'s blocks must be contiguous behind the block index (strides {t.stride()})")
    for name, ids, rows in (("src_ids", src_ids, src.shape[0]), ("dst_ids", dst_ids, dst.shape[0])):
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D int32 or int64 tensor, got {ids.dtype} {tuple(ids.shape)} strides {ids.stride()}")
        if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < rows):
            raise ValueError(f"{name} must index rows 0..{rows - 1}, got {int(ids.min())}..{int(ids.max())}")
    if src_ids.numel() != dst_ids.numel():
        raise ValueError(f"src_ids has {src_ids.numel()} ids but dst_ids {dst_ids.numel()}")
    if dst_ids.unique().numel() != dst_ids.numel():
        raise ValueError("dst_ids repeats a row: two copies would race for it")
    if src.data_ptr() == dst.data_ptr() and set(src_ids.tolist()) & set(dst_ids.tolist()):
        raise ValueError("a copy within one tensor may not read a row it writes")


@on_tensor_device
def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every ``i`` (in place on ``dst``).

    Args:
        src: ``[S, *block]`` pool or staging tensor.
        dst: ``[T, *block]``, the same dtype, block shape and device.
        src_ids, dst_ids: ``[N]`` int32/int64 row indices; ``dst_ids`` distinct.

    Raises:
        ValueError: dtypes, block shapes or devices differ; a block is not contiguous behind its
            index; an id is out of range or the id tensors' lengths differ; ``dst_ids`` repeats
            a row; a copy within one tensor reads a row it writes.
    """
    _check(src, dst, src_ids, dst_ids)
    n = src_ids.numel()
    row_elems = src[0].numel() if src.shape[0] else 0
    if n == 0 or row_elems == 0:
        return
    grid = (n, triton.cdiv(row_elems, BLOCK))
    _copy_blocks_kernel[grid](src, dst, src_ids, dst_ids, row_elems, src.stride(0), dst.stride(0), BLOCK=BLOCK)


def copy_blocks_ref(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """The plain-torch reference of :func:`copy_blocks` (same arguments, same checks)."""
    _check(src, dst, src_ids, dst_ids)
    dst[dst_ids.long()] = src[src_ids.long()]


@on_tensor_device
def gather_blocks(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Swap-out: a new staging tensor ``[N, *block]`` holding ``pool[block_ids]`` in order."""
    staging = torch.empty((block_ids.numel(), *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    copy_blocks(pool, staging, block_ids, torch.arange(block_ids.numel(), device=pool.device, dtype=block_ids.dtype))
    return staging


@on_tensor_device
def scatter_blocks(staging: torch.Tensor, pool: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Swap-in: ``pool[block_ids[i]] = staging[i]`` for every row of ``staging [N, *block]``."""
    copy_blocks(staging, pool, torch.arange(block_ids.numel(), device=pool.device, dtype=block_ids.dtype), block_ids)
