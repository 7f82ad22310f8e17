"""paged_prefill_attention against its fp32 torch reference: a varlen batch whose chunks are 1,
63 and 500 tokens (one with no cached prefix, one with a length-1 chunk after a long prefix),
grouped-query heads, head dims 64 and 60, sliding window on and off, fp32 and fp16, outputs
pre-filled with NaN; and the launcher's checks."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from tests.helpers import TOLERANCE

PAGE = 16


def varlen_batch(cached: list[int], new: list[int], h_q: int, h_kv: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [c + n for c, n in zip(cached, new, strict=True)]
    pages_each = [(n + PAGE - 1) // PAGE for n in lengths]
    num_blocks = 1 + sum(pages_each) + 2
    k_cache = torch.randn((num_blocks, PAGE, h_kv, d), generator=g).to(dtype=dtype, device=device)
    v_cache = torch.randn((num_blocks, PAGE, h_kv, d), generator=g).to(dtype=dtype, device=device)
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros((len(lengths), max(pages_each)), dtype=torch.int32)
    for i, n in enumerate(pages_each):
        for j in range(n):
            tables[i, j] = order.pop()
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn((int(cu[-1]), h_q, d), generator=g).to(dtype=dtype, device=device)
    return q, k_cache, v_cache, tables.to(device), torch.tensor(lengths, dtype=torch.int32, device=device), cu.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("h_q", "h_kv", "d"), [(4, 2, 64), (2, 1, 60)])
@pytest.mark.parametrize("window", [None, 48])
def test_matches_the_reference(dtype: torch.dtype, h_q: int, h_kv: int, d: int, window: int | None, device: str) -> None:
    # chunks of 63 (no prefix), 1 (after 500 cached), 500 (after 37 cached), 17 (after 16)
    q, k_cache, v_cache, tables, seq_lens, cu = varlen_batch([0, 500, 37, 16], [63, 1, 500, 17], h_q, h_kv, d, dtype, device)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, cu, scale=d**-0.5, window=window, out=out)
    expected = paged_prefill_attention_ref(q, k_cache, v_cache, tables, seq_lens, cu, scale=d**-0.5, window=window)
    assert not out.isnan().any()
    err = (out.float() - expected).abs().max().item()
    assert err <= TOLERANCE[dtype], err


def test_the_first_token_of_a_fresh_sequence_returns_its_own_value(device: str) -> None:
    q, k_cache, v_cache, tables, seq_lens, cu = varlen_batch([0], [20], 2, 2, 64, torch.float32, device)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, cu, scale=0.125)
    assert torch.allclose(out[0], v_cache[int(tables[0, 0]), 0], atol=1e-6)  # causal: it sees only itself
    windowed = paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, cu, scale=0.125, window=1)
    rows = torch.stack([v_cache[int(tables[0, i // 16]), i % 16] for i in range(20)])
    assert torch.allclose(windowed, rows, atol=1e-6)  # a one-token window: each token's own value


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("cu not from 0", "cu_seqlens must rise from 0"),
        ("chunk longer than sequence", "must include its chunk"),
        ("page 8", "power of two >= 16"),
        ("dtype", "must share one float dtype"),
        ("window", "window must be >= 1"),
        ("block id", "block ids must be in"),
    ],
)
def test_the_launcher_refuses_bad_arguments(change: str, message: str, device: str) -> None:
    q, k_cache, v_cache, tables, seq_lens, cu = varlen_batch([4, 0], [5, 3], 2, 1, 64, torch.float32, device)
    kwargs: dict[str, object] = {"scale": 0.125}
    if change == "cu not from 0":
        cu = cu + 1
    elif change == "chunk longer than sequence":
        seq_lens = torch.tensor([4, 3], dtype=torch.int32, device=device)
    elif change == "page 8":
        k_cache = k_cache.reshape(-1, 8, 1, 64)
        v_cache = v_cache.reshape(-1, 8, 1, 64)
    elif change == "dtype":
        v_cache = v_cache.half()
    elif change == "window":
        kwargs["window"] = 0
    elif change == "block id":
        tables = tables.clone()
        tables[1, 0] = -1
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, cu, **kwargs)  # type: ignore[arg-type]
