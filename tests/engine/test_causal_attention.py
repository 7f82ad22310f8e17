"""Issue 26, item 0: the causal fast path of the attention layers (no materialised mask; a prefix
merged by log-sum-exp) against the masked reference, and the masks kept for the other layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.model import causal_attention as ca
from engine.model.causal_attention import attention_mask, causal_attention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qp: torch.Tensor, kp: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """Plain softmax attention in float64 with an explicit mask (GQA by repeating KV heads)."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    scores = scores.masked_fill(~attention_mask(qp, kp, window)[None], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), vv)


CASES = [
    # (T, prefix, heads, kv heads, window, calls of the flash kernel)
    (64, 0, 4, 2, None, 1),  # no prefix: one causal call
    (48, 80, 4, 2, None, 2),  # a prefix: two calls merged
    (33, 200, 4, 4, None, 2),  # no grouping, odd lengths
    (40, 24, 4, 1, 100, 2),  # a window that cuts nothing
    (40, 120, 4, 2, 64, 0),  # a window that cuts: the masked path
]


@pytest.mark.parametrize(("t", "prefix", "h", "h_kv", "window", "flash_calls"), CASES)
def test_the_fast_path_equals_masked_attention(
    t: int, prefix: int, h: int, h_kv: int, window: int | None, flash_calls: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ca._flash_cpu is not None, "this torch has no CPU flash kernel: the fast path is never taken"
    calls: list[bool] = []
    real = ca._flash_cpu

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(ca, "_flash_cpu", counted)
    gen = torch.Generator().manual_seed(t + prefix)
    d, start = 32, 7
    q = torch.randn(t, h, d, generator=gen)
    k = torch.randn(prefix + t, h_kv, d, generator=gen)
    v = torch.randn(prefix + t, h_kv, d, generator=gen)
    qp = torch.arange(start + prefix, start + prefix + t)
    kp = torch.arange(start, start + prefix + t)
    with torch.no_grad():
        got = causal_attention(q, k, v, qp, kp, scale=d**-0.5, window=window)
    want = reference(q, k, v, qp, kp, d**-0.5, window)
    assert len(calls) == flash_calls
    assert got.shape == (t, h, d)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5)


def test_keys_that_are_not_consecutive_take_the_masked_path() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(8, 2, 16, generator=gen), torch.randn(12, 2, 16, generator=gen), torch.randn(12, 2, 16, generator=gen)
    kp = torch.tensor([0, 1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13])  # a hole: 3 and 4 missing
    qp = torch.arange(6, 14)
    with torch.no_grad():
        got = causal_attention(q, k, v, qp, kp, scale=0.25)
    torch.testing.assert_close(got.double(), reference(q, k, v, qp, kp, 0.25, None), atol=2e-6, rtol=2e-5)


def test_half_precision_on_the_fast_path_stays_within_its_rounding() -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, 4, 32, generator=gen) for n in (32, 96, 96))
    qp, kp = torch.arange(64, 96), torch.arange(0, 96)
    with torch.no_grad():
        got = causal_attention(q.half(), k.half(), v.half(), qp, kp, scale=32**-0.5)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), reference(q, k, v, qp, kp, 32**-0.5, None), atol=5e-3, rtol=5e-3)


def test_a_mask_is_built_once_for_every_layer_of_a_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple[int, int]] = []
    real = ca.attention_mask

    def counting(qp: torch.Tensor, kp: torch.Tensor, window: int | None) -> torch.Tensor:
        built.append((qp.shape[0], kp.shape[0]))
        return real(qp, kp, window)

    monkeypatch.setattr(ca, "attention_mask", counting)
    monkeypatch.setattr(ca, "_MASKS", {})
    q, k, v = torch.randn(16, 2, 8), torch.randn(80, 2, 8), torch.randn(80, 2, 8)
    qp, kp = torch.arange(64, 80), torch.arange(0, 80)
    with torch.no_grad():
        first = causal_attention(q, k, v, qp, kp, scale=0.3, window=32)  # the window cuts: masked
        for _ in range(5):  # the other layers of the forward: their own (equal) positions tensors
            again = causal_attention(q, k, v, qp.clone(), kp.clone(), scale=0.3, window=32)
    assert built == [(16, 80)]
    torch.testing.assert_close(again, first)


def test_with_autograd_on_it_is_the_public_masked_call() -> None:
    q = torch.randn(8, 2, 8, requires_grad=True)
    k, v = torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    p = torch.arange(8)
    out = causal_attention(q, k, v, p, p, scale=0.5)
    out.sum().backward()
    assert q.grad is not None
    want = nn.functional.scaled_dot_product_attention(
        q.detach().transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=0.5
    )[0].transpose(0, 1)
    torch.testing.assert_close(out.detach(), want)
