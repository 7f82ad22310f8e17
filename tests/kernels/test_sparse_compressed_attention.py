"""sparse_compressed_attention against the engine's sink_attention (over the same window rows,
compressed entries and visibility the engine builds) and its fp32 reference: CSA with the
indexer's selection (invalid slots included) and HCA with every ended group, a prefill chunk
whose window holds rows after early queries, a single decode query, 4 and 20 heads, head dims
64 and 60, fp32 and fp16; the launcher checks."""

from __future__ import annotations

import pytest
import torch

from engine.model.deepseek_v4_attention import sink_attention
from kernels.sparse_compressed_attention import (
    sparse_compressed_attention,
    sparse_compressed_attention_ref,
)
from tests.helpers import TOLERANCE

RATIO, WINDOW = 4, 16


def case(t: int, first: int, heads: int, d: int, csa: bool, dtype: torch.dtype, device: str, seed: int = 0):
    """A chunk of t queries at positions first..first+t-1: the window rows stored for positions
    max(0, first - WINDOW + 1)..first+t-1, entries of every group ended by the chunk's end."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(first, first + t, device=device)
    window_positions = torch.arange(max(0, first - WINDOW + 1), first + t, device=device)
    n = (first + t) // RATIO
    q = torch.randn((t, heads, d), generator=g).to(dtype=dtype, device=device)
    window_kv = torch.randn((window_positions.numel(), d), generator=g).to(dtype=dtype, device=device)
    entries = torch.randn((n, d), generator=g).to(dtype=dtype, device=device)
    sinks = torch.randn((heads,), generator=g).to(device)
    extra: dict[str, object] = {"ratio": RATIO}
    if csa:
        k = 5
        visible = torch.div(positions + 1, RATIO, rounding_mode="floor")
        scores = torch.rand((t, max(n, 1)), generator=g).to(device)
        indices = scores.argsort(dim=1, descending=True)[:, :k].to(torch.int32) if n else torch.zeros((t, k), dtype=torch.int32, device=device)
        valid = indices < visible[:, None]
        extra = {"indices": indices, "valid": valid}
    return q, window_kv, window_positions, entries, positions, sinks, extra


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("csa", [True, False], ids=["csa", "hca"])
@pytest.mark.parametrize(("t", "first", "heads", "d"), [(63, 0, 4, 64), (1, 500, 20, 60), (20, 37, 4, 60)])
def test_matches_the_engine_and_the_reference(t: int, first: int, heads: int, d: int, csa: bool, dtype: torch.dtype, device: str) -> None:
    q, window_kv, window_positions, entries, positions, sinks, extra = case(t, first, heads, d, csa, dtype, device)
    out = sparse_compressed_attention(q, window_kv, window_positions, entries, positions, sinks, scale=d**-0.5, window=WINDOW, **extra)  # type: ignore[arg-type]
    expected = sparse_compressed_attention_ref(q, window_kv, window_positions, entries, positions, sinks, scale=d**-0.5, window=WINDOW, **extra)  # type: ignore[arg-type]
    assert not out.isnan().any()
    assert (out.float() - expected).abs().max().item() <= TOLERANCE[dtype]
    if dtype == torch.float32:  # the engine's own function on the keys and mask it would build
        delta = positions[:, None] - window_positions[None, :]
        window_visible = (delta >= 0) & (delta < WINDOW)
        if csa:
            chosen = torch.zeros((t, entries.shape[0]), dtype=torch.bool, device=device)
            if entries.shape[0]:
                chosen.scatter_(1, extra["indices"].long(), extra["valid"])  # type: ignore[union-attr]
        else:
            chosen = torch.arange(entries.shape[0], device=device)[None, :] < torch.div(positions + 1, RATIO, rounding_mode="floor")[:, None]
        engine = sink_attention(q, torch.cat((window_kv, entries)), torch.cat((window_visible, chosen), dim=1), sinks, d**-0.5)
        assert (out - engine).abs().max().item() <= TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("indices without valid", "go together"),
        ("hca without ratio", "needs ratio"),
        ("window", "window must be >= 1"),
        ("sinks", "sinks must be float32"),
        ("index out of range", "outside 0.."),
    ],
)
def test_the_launcher_refuses_bad_arguments(change: str, message: str, device: str) -> None:
    q, window_kv, window_positions, entries, positions, sinks, extra = case(8, 8, 4, 64, True, torch.float32, device)
    kwargs: dict[str, object] = {"scale": 0.125, "window": WINDOW, **extra}
    if change == "indices without valid":
        del kwargs["valid"]
    elif change == "hca without ratio":
        del kwargs["indices"], kwargs["valid"]
    elif change == "window":
        kwargs["window"] = 0
    elif change == "sinks":
        sinks = sinks.half()
    elif change == "index out of range":
        indices = extra["indices"].clone()  # type: ignore[union-attr]
        indices[0, 0] = entries.shape[0]
        kwargs["indices"], kwargs["valid"] = indices, torch.ones_like(indices, dtype=torch.bool)
    with pytest.raises(ValueError, match=message):
        sparse_compressed_attention(q, window_kv, window_positions, entries, positions, sinks, **kwargs)  # type: ignore[arg-type]
