"""paged_decode_attention against its fp32 torch reference: grouped-query heads, head dims 64
and 60, sequences of 1, 63 and 500 tokens in shuffled pages, a padding row on the sentinel page,
sliding window and attention sink on and off, fp32 and fp16, outputs pre-filled with NaN; and
the launcher's checks."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from tests.helpers import TOLERANCE

PAGE = 16


def paged_batch(lengths: list[int], h_q: int, h_kv: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    """q, k/v caches and block tables for sequences of ``lengths`` tokens (0: a padding row whose
    table stays on the sentinel page 0), their pages scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    pages_each = [(n + PAGE - 1) // PAGE for n in lengths]
    num_blocks = 1 + sum(pages_each) + 3  # the sentinel, the pages, a few unused
    k_cache = torch.randn((num_blocks, PAGE, h_kv, d), generator=g).to(dtype=dtype, device=device)
    v_cache = torch.randn((num_blocks, PAGE, h_kv, d), generator=g).to(dtype=dtype, device=device)
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros((len(lengths), max([*pages_each, 1])), dtype=torch.int32)
    for i, n in enumerate(pages_each):
        for j in range(n):
            tables[i, j] = order.pop()
    q = torch.randn((len(lengths), h_q, d), generator=g).to(dtype=dtype, device=device)
    return q, k_cache, v_cache, tables.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("h_q", "h_kv", "d"), [(4, 2, 64), (6, 2, 60), (2, 2, 64)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_matches_the_reference(dtype: torch.dtype, h_q: int, h_kv: int, d: int, window: int | None, with_sinks: bool, device: str) -> None:
    lengths = [1, 63, 0, 500]  # 0: a padding row of a captured decode batch
    q, k_cache, v_cache, tables, seq_lens = paged_batch(lengths, h_q, h_kv, d, dtype, device)
    sinks = torch.linspace(-1.0, 2.0, h_q, device=device) if with_sinks else None
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=d**-0.5, window=window, sinks=sinks, out=out)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, scale=d**-0.5, window=window, sinks=sinks)
    assert not out.isnan().any()
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # the padding row
    err = (out.float() - expected).abs().max().item()
    assert err <= TOLERANCE[dtype], err


def test_the_window_and_the_sink_change_the_result(device: str) -> None:
    """A check that the options reach the kernel: each changes the output of a 500-token row."""
    q, k_cache, v_cache, tables, seq_lens = paged_batch([500], 2, 1, 64, torch.float32, device, seed=3)
    plain = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    windowed = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125, window=16)
    sunk = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125, sinks=torch.tensor([5.0, 5.0], device=device))
    assert (plain - windowed).abs().max() > 1e-2 and (plain - sunk).abs().max() > 1e-2
    # a window of one token returns that token's value
    one = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale=0.125, window=1)
    last_page, row = int(tables[0, 499 // 16]), 499 % 16
    assert torch.allclose(one[0], v_cache[last_page, row, 0].expand(2, 64), atol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("heads", "cannot be grouped"),
        ("dtype", "must share one float dtype"),
        ("table dtype", "row-contiguous int32"),
        ("too long", "does not fit"),
        ("block id", "block ids in 0.."),
        ("sinks", "sinks must be a float32"),
        ("window", "window must be >= 1"),
        ("head dim stride", "head dim must be contiguous"),
    ],
)
def test_the_launcher_refuses_bad_arguments(change: str, message: str, device: str) -> None:
    q, k_cache, v_cache, tables, seq_lens = paged_batch([20, 5], 4, 2, 64, torch.float32, device)
    kwargs: dict[str, object] = {"scale": 0.125}
    if change == "heads":
        q = q[:, :3]
    elif change == "dtype":
        k_cache = k_cache.half()
    elif change == "table dtype":
        tables = tables.long()
    elif change == "too long":
        seq_lens = torch.tensor([20, 33], dtype=torch.int32, device=device)
    elif change == "block id":
        tables = tables.clone()
        tables[0, 0] = k_cache.shape[0]
    elif change == "sinks":
        kwargs["sinks"] = torch.zeros(3, device=device)
    elif change == "window":
        kwargs["window"] = 0
    elif change == "head dim stride":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, **kwargs)  # type: ignore[arg-type]
