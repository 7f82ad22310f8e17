"""Every launcher refuses a strided 1-D index, length or position tensor (the kernels read them
as contiguous: a column of a [N, 2] mapping would be read wrongly, silently), and CSA indices
taken as a row-major slice of a wider tensor give the reference's result (review findings)."""

from __future__ import annotations

import pytest
import torch

from kernels.gated_delta_rule import fused_recurrent_gated_delta_rule
from kernels.indexer_topk import indexer_topk
from kernels.kv_block_copy import copy_blocks
from kernels.paged_decode_attention import paged_decode_attention
from kernels.paged_prefill_attention import paged_prefill_attention
from kernels.sparse_compressed_attention import (
    sparse_compressed_attention,
    sparse_compressed_attention_ref,
)
from tests.helpers import TOLERANCE


def column(values: list[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    """``values`` as the first column of a [N, 2] tensor: right values, stride 2."""
    wide = torch.tensor([[v, -7] for v in values], dtype=dtype, device=device)
    return wide[:, 0]


def test_copy_blocks(device: str) -> None:
    src, dst = torch.zeros(4, 8, device=device), torch.zeros(4, 8, device=device)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        copy_blocks(src, dst, column([0, 1], torch.int64, device), torch.tensor([2, 3], device=device))


def test_decode_and_prefill(device: str) -> None:
    q = torch.zeros(2, 2, 64, device=device)
    cache = torch.zeros(4, 16, 1, 64, device=device)
    tables = torch.tensor([[1], [2]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="seq_lens must be a contiguous"):
        paged_decode_attention(q, cache, cache, tables, column([3, 5], torch.int32, device), scale=0.1)
    cu = column([0, 1, 2], torch.int32, device)
    with pytest.raises(ValueError, match="contiguous int32"):
        paged_prefill_attention(q, cache, cache, tables, torch.tensor([3, 5], dtype=torch.int32, device=device), cu, scale=0.1)


def test_gated_delta_rule_and_indexer(device: str) -> None:
    q = torch.zeros(3, 1, 64, device=device)
    g = torch.zeros(3, 1, device=device)
    with pytest.raises(ValueError, match="contiguous int32"):
        fused_recurrent_gated_delta_rule(q, q, q, g, g, torch.zeros(1, 1, 64, 64, device=device), column([0, 3], torch.int32, device))
    with pytest.raises(ValueError, match="positions must be a contiguous"):
        indexer_topk(q, torch.zeros(5, 64, device=device), torch.zeros(3, 1, device=device), column([0, 1, 2], torch.int64, device), ratio=4, k=2, scale=0.1)


def test_sparse_attention_positions_and_sliced_indices(device: str) -> None:
    g = torch.Generator().manual_seed(4)
    t, n, d = 6, 5, 64
    q = torch.randn((t, 4, d), generator=g).to(device)
    window_kv = torch.randn((8, d), generator=g).to(device)
    entries = torch.randn((n, d), generator=g).to(device)
    positions = torch.arange(14, 20, device=device)
    window_positions = torch.arange(12, 20, device=device)
    sinks = torch.zeros(4, device=device)
    with pytest.raises(ValueError, match="contiguous integers"):
        sparse_compressed_attention(q, window_kv, column(list(range(12, 20)), torch.int64, device), entries, positions, sinks, scale=0.1, window=8, ratio=4)
    distinct = torch.rand((t, n), generator=g).argsort(dim=1)[:, :3].to(torch.int32)  # as a top-k gives them
    wide = torch.cat((distinct, torch.zeros_like(distinct)), dim=1).to(device)
    indices = wide[:, :3]  # row-major, row stride 6
    valid = torch.rand((t, 3), generator=g).to(device) > 0.3
    kwargs = {"scale": 0.125, "window": 8, "indices": indices, "valid": valid}
    out = sparse_compressed_attention(q, window_kv, window_positions, entries, positions, sinks, **kwargs)  # type: ignore[arg-type]
    want = sparse_compressed_attention_ref(q, window_kv, window_positions, entries, positions, sinks, **kwargs)  # type: ignore[arg-type]
    assert (out - want).abs().max().item() <= TOLERANCE[torch.float32]
