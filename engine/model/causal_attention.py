"""Softmax attention of one sequence's chunk over its keys, on the fast causal path where the
positions allow it (the torch backend of the attention layers).

A chunk's queries at positions ``q_positions [T]`` attend to keys at ``k_positions [S]`` with
k ≤ p (and p − k < W for a window W). When the keys are consecutive and end at the chunk's last
query (a prefill chunk over the prefix before it: the usual case), no ``[T, S]`` mask is needed:

* no prefix (S = T): one causal call (``is_causal``; the kernel skips the blocks above the
  diagonal);
* a prefix of P = S − T keys: the chunk over the prefix (every key visible, no mask) and over
  itself (causal) as two calls, merged by their log-sum-exps — the same split as
  flash-attention's split-KV decoding and vLLM's cascade / prefix-prefill attention
  (``o = Σ_i e^{lse_i − lse} o_i`` with ``lse = log Σ_i e^{lse_i}``).

Both use PyTorch's CPU flash-attention kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``,
which also returns the log-sum-exp). Everything else (a window that cuts into the keys, keys
that are not consecutive, another device) takes the masked path, with the boolean mask built
once per (positions, window) and reused by every layer of the forward.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor, nn

_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

_MASKS: dict[tuple[object, ...], Tensor] = {}
_MASKS_LOCK = threading.Lock()
_MASKS_KEPT = 4
_MASK_MAX_ELEMENTS = 1 << 24
"""Masks larger than this (16 MiB of bool) are built per call, not kept."""


def attention_mask(q_positions: Tensor, k_positions: Tensor, window: int | None) -> Tensor:
    """Boolean ``[T, S]`` mask, True where the query may attend to the key."""
    diff = q_positions[:, None] - k_positions[None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def _consecutive(positions: Tensor) -> int | None:
    """The first position when ``positions`` is ``first, first + 1, …``; else None."""
    n = positions.shape[0]
    first = int(positions[0])
    if int(positions[-1]) - first != n - 1:
        return None
    if n > 2 and not torch.equal(positions, torch.arange(first, first + n, device=positions.device, dtype=positions.dtype)):
        return None
    return first


def _shared_mask(q_positions: Tensor, k_positions: Tensor, window: int | None, q0: int | None, k0: int | None) -> Tensor:
    """:func:`attention_mask`, built once for consecutive positions (its value depends only on
    ``q0, T, k0, S, window``) and kept for the other layers of the forward."""
    if q0 is None or k0 is None or q_positions.shape[0] * k_positions.shape[0] > _MASK_MAX_ELEMENTS:
        return attention_mask(q_positions, k_positions, window)
    key = (q_positions.device, q0, q_positions.shape[0], k0, k_positions.shape[0], window)
    mask = _MASKS.get(key)
    if mask is None:
        mask = attention_mask(q_positions, k_positions, window)
        with _MASKS_LOCK:
            if len(_MASKS) >= _MASKS_KEPT:
                _MASKS.pop(next(iter(_MASKS)))
            _MASKS[key] = mask
    return mask


def causal_attention(
    q: Tensor, keys: Tensor, values: Tensor, q_positions: Tensor, k_positions: Tensor, *, scale: float, window: int | None = None
) -> Tensor:
    """Attention of ``q [T, H, D]`` over ``keys / values [S, H_kv, D]`` (grouped: query head h
    reads KV head ``h // (H / H_kv)``) with the causal (and window) rule of the positions.

    Returns ``[T, H, D]`` in q's dtype. Raises nothing of its own (shape errors come from torch).
    With autograd on (training) it always takes the masked path.
    """
    t, s = q.shape[0], keys.shape[0]
    q0, k0 = _consecutive(q_positions), _consecutive(k_positions)
    aligned = q0 is not None and k0 is not None and s >= t and k0 + s == q0 + t
    uncut = window is None or (q0 is not None and k0 is not None and q0 + t - 1 - k0 < window)
    if aligned and uncut and _flash_cpu is not None and q.device.type == "cpu" and t > 1 and not torch.is_grad_enabled():
        group = q.shape[1] // keys.shape[1]  # the kernel takes no grouping: KV heads repeated

        def heads(x: Tensor, repeat: int = group) -> Tensor:  # [S, H, D] -> [1, H·repeat, S, D]
            x = x.transpose(0, 1)
            return (x.repeat_interleave(repeat, dim=0) if repeat > 1 else x).unsqueeze(0)

        qh, kh, vh = heads(q, 1), heads(keys), heads(values)
        prefix = s - t
        if prefix == 0:
            out, _ = _flash_cpu(qh, kh, vh, 0.0, True, scale=scale)
        else:
            o1, lse1 = _flash_cpu(qh, kh[:, :, :prefix], vh[:, :, :prefix], 0.0, False, scale=scale)
            o2, lse2 = _flash_cpu(qh, kh[:, :, prefix:], vh[:, :, prefix:], 0.0, True, scale=scale)
            lse = torch.logaddexp(lse1, lse2)
            out = (torch.exp(lse1 - lse).unsqueeze(-1) * o1.float() + torch.exp(lse2 - lse).unsqueeze(-1) * o2.float()).to(q.dtype)
        return out.squeeze(0).transpose(0, 1)
    mask = _shared_mask(q_positions, k_positions, window, q0, k0)
    out = nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)
