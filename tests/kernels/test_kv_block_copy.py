"""kv_block_copy against its torch reference for every form's pool layout: gather (swap-out)
and scatter (swap-in), fp32 and fp16, one block and odd counts, rows of a size that is not a
multiple of the kernel's tile, destinations pre-filled with NaN (an unwritten element stays NaN,
a written one must equal its source bit for bit), and every launcher check."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_block_copy import BLOCK, copy_blocks, copy_blocks_ref, gather_blocks, scatter_blocks

LAYOUTS = {
    "full_kv page [blocks, layers, 2, U, H_kv, D=64]": (2, 2, 16, 2, 64),
    "swa_window page, head dim 60": (1, 2, 16, 3, 60),
    "compressed_kv entry page [blocks, layers, entries, D]": (2, 4, 60),
    "uncompressed_tail rows [slots, layers, rows, D]": (2, 31, 64),
    "linear_state conv [slots, layers, channels, K-1]": (2, 96, 3),
    "linear_state recurrent [slots, layers, H, K, V]": (1, 2, 32, 32),
}


def nan_like(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_gather_then_scatter_matches_the_reference(block: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
    g = torch.Generator().manual_seed(0)
    pool = torch.randn((9, *block), generator=g).to(dtype=dtype, device=device)
    for ids in ([4], [1, 7, 3], [8, 0, 2, 5, 6]):  # one block, odd counts, the first and last rows
        block_ids = torch.tensor(ids, device=device)
        staging = gather_blocks(pool, block_ids)
        assert torch.equal(staging, pool[block_ids])
        # swap-in into a NaN pool: the rows named are the staged blocks, every other row untouched
        target = nan_like(tuple(pool.shape), dtype, device)
        into = torch.tensor(list(reversed(range(9)))[: len(ids)], device=device)
        scatter_blocks(staging, target, into)
        expected = nan_like(tuple(pool.shape), dtype, device)
        copy_blocks_ref(staging, expected, torch.arange(len(ids), device=device), into)
        assert torch.equal(target.isnan(), expected.isnan())
        assert torch.equal(target[into], staging)


def test_rows_longer_than_one_tile_and_int32_ids(device: str) -> None:
    row = BLOCK * 2 + 37  # three tiles, the last one mostly masked
    src = torch.arange(5 * row, dtype=torch.float32, device=device).reshape(5, row)
    dst = nan_like((4, row), torch.float32, device)
    copy_blocks(src, dst, torch.tensor([4, 0], dtype=torch.int32, device=device), torch.tensor([1, 3], dtype=torch.int32, device=device))
    assert torch.equal(dst[1], src[4]) and torch.equal(dst[3], src[0])
    assert dst[0].isnan().all() and dst[2].isnan().all()


def test_within_one_pool_and_empty_copies(device: str) -> None:
    pool = torch.randn(6, 2, 8, device=device)
    before = pool.clone()
    copy_blocks(pool, pool, torch.tensor([0, 1], device=device), torch.tensor([4, 5], device=device))
    assert torch.equal(pool[4:], before[:2]) and torch.equal(pool[:4], before[:4])
    copy_blocks(pool, pool, torch.tensor([], dtype=torch.int64, device=device), torch.tensor([], dtype=torch.int64, device=device))
    assert torch.equal(pool[:4], before[:4])


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("dtype", "src is torch.float32 but dst is torch.float16"),
        ("block shape", "must share their block shape"),
        ("ids dtype", "must be a contiguous 1-D int32 or int64 tensor"),
        ("id out of range", "must index rows 0..5"),
        ("lengths", "src_ids has 2 ids but dst_ids 1"),
        ("repeated destination", "dst_ids repeats a row"),
        ("overlap", "may not read a row it writes"),
        ("not contiguous", "blocks must be contiguous"),
    ],
)
def test_the_launcher_refuses_bad_arguments(case: str, message: str, device: str) -> None:
    src = torch.zeros(6, 4, 8, device=device)
    dst = torch.zeros(6, 4, 8, device=device)
    ids = torch.tensor([0, 1], device=device)
    args = {
        "dtype": (src, dst.half(), ids, ids),
        "block shape": (src, torch.zeros(6, 4, 9, device=device), ids, ids),
        "ids dtype": (src, dst, ids.float(), ids),
        "id out of range": (src, dst, ids, torch.tensor([0, 6], device=device)),
        "lengths": (src, dst, ids, ids[:1]),
        "repeated destination": (src, dst, ids, torch.tensor([3, 3], device=device)),
        "overlap": (src, src, ids, torch.tensor([1, 2], device=device)),
        "not contiguous": (torch.zeros(6, 8, 4, device=device).transpose(1, 2), dst, ids, ids),
    }[case]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        copy_blocks(*args)
    with pytest.raises(ValueError):
        copy_blocks_ref(*args)
