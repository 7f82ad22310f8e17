"""The kernel backend switch: which implementation a layer's attention, gated delta rule, causal
conv, compressor pooling, indexer top-k and routed experts run on.

* ``torch``: the plain PyTorch path on every device (the reference the kernels are checked
  against).
* ``triton``: the kernels of :mod:`kernels` — what the engine uses on CUDA; on CPU it runs only
  under Triton's interpreter (``TRITON_INTERPRET=1`` set before the kernels are imported), which
  is how tests prove the CUDA path without a GPU.
* ``auto``: ``triton`` on CUDA (``torch``, with a warning, when the cache's page size is one the
  kernels cannot walk), ``torch`` elsewhere.

The layers are the same modules for both (a switch, not a copy of the model): each mixer keeps a
``kernel_backend`` attribute that :func:`set_kernel_backend` sets, and calls the functions here
when it is ``"triton"``. The math each kernel implements, with its source, is in its module's
docstring. The kernel modules are imported at the first call, not with the engine: importing
them loads Triton, which reads ``TRITON_INTERPRET`` then.
"""

from __future__ import annotations

import logging
import os
from typing import Literal

import torch
from torch import Tensor, nn

from engine.model.state import AttentionPages, LinearLayerState
from kernels.gated_delta_rule_torch import causal_conv1d as torch_causal_conv1d

log = logging.getLogger(__name__)

KernelBackend = Literal["torch", "triton"]
KERNEL_BACKENDS = ("auto", "torch", "triton")

CHUNKED_MIN_TOKENS = 32
"""A chunk of at least this many tokens takes the gated delta rule's chunked form, a shorter one
(decode) the recurrent form: on both backends."""


def resolve_kernel_backend(requested: str, device: torch.device, page_tokens: int) -> KernelBackend:
    """The backend to run: ``requested`` checked against the device and the cache's page size.

    Args:
        requested: ``"auto"``, ``"torch"`` or ``"triton"``.
        device: where the model runs.
        page_tokens: tokens per KV page (the cache's ``unit_tokens``); the paged kernels need a
            power of two of at least 16.

    Raises:
        ValueError: an unknown name; ``triton`` on a CPU without ``TRITON_INTERPRET=1``; a page
            size the kernels cannot walk.
    """
    if requested not in KERNEL_BACKENDS:
        raise ValueError(
            f"kernel_backend = {requested!r}; expected one of {', '.join(KERNEL_BACKENDS)}"
        )
    paged = page_tokens >= 16 and not page_tokens & (page_tokens - 1)
    if requested == "auto":
        requested = "triton" if device.type == "cuda" else "torch"
        if requested == "triton" and not paged:
            log.warning("unit_tokens = %d is not a power of two >= 16, the Triton kernels' page size: running the torch path", page_tokens)
            requested = "torch"
    if requested == "torch":
        return "torch"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"kernel_backend = 'triton' on {device.type} needs Triton's interpreter: set TRITON_INTERPRET=1 before "
            "starting (slow; for tests), or use kernel_backend = 'torch'"
        )
    if not paged:
        raise ValueError(
            f"kernel_backend = 'triton' needs unit_tokens a power of two >= 16 (the kernels' page size); got {page_tokens}"
        )
    return "triton"


def set_kernel_backend(model: nn.Module, backend: KernelBackend) -> int:
    """Point every layer of ``model`` that has a ``kernel_backend`` attribute at ``backend``;
    returns how many layers that is."""
    count = 0
    for module in model.modules():
        if hasattr(module, "kernel_backend"):
            module.kernel_backend = backend  # type: ignore[assignment]  # a str attribute, not a tensor
            count += 1
    return count


def paged_attention(
    q: Tensor, pages: AttentionPages, *, scale: float, window: int | None
) -> Tensor:
    """Causal attention of one sequence's chunk ``q [T, H_q, D]`` over its pages (the chunk's
    keys and values already written): :func:`kernels.paged_decode_attention.paged_decode_attention`
    for one token, :func:`kernels.paged_prefill_attention.paged_prefill_attention` for more.
    Returns ``[T, H_q, D]`` in q's dtype."""
    from kernels.paged_decode_attention import paged_decode_attention
    from kernels.paged_prefill_attention import paged_prefill_attention

    dtype = pages.k_cache.dtype
    seq_lens = torch.tensor([pages.num_tokens], dtype=torch.int32, device=q.device)
    if q.shape[0] == 1:
        out = paged_decode_attention(
            q.to(dtype),
            pages.k_cache,
            pages.v_cache,
            pages.block_table,
            seq_lens,
            scale=scale,
            window=window,
        )
    else:
        cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        out = paged_prefill_attention(
            q.to(dtype),
            pages.k_cache,
            pages.v_cache,
            pages.block_table,
            seq_lens,
            cu,
            scale=scale,
            window=window,
        )
    return out.to(q.dtype)


def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One sequence's gated delta rule through the kernels: the chunked form for
    :data:`CHUNKED_MIN_TOKENS` tokens or more, the fused recurrent form below.

    Args and returns as :func:`kernels.gated_delta_rule_torch.gated_delta_rule`: ``q, k [T, H, D_k]``
    (L2-normalised), ``v [T, H, D_v]``, ``g, beta [T, H]``, ``state [H, D_k, D_v]`` (not
    modified) → ``(o [T, H, D_v] float32, final_state [H, D_k, D_v] float32)``.
    """
    from kernels.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    rule = (
        chunk_gated_delta_rule
        if q.shape[0] >= CHUNKED_MIN_TOKENS
        else fused_recurrent_gated_delta_rule
    )
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    o, final = rule(
        q, k, v.float(), g.contiguous(), beta.contiguous(), state.float()[None].contiguous(), cu
    )
    return o, final[0]


def causal_conv1d(x: Tensor, weight: Tensor, layer_state: LinearLayerState) -> Tensor:
    """The short causal conv with SiLU over ``x [T, C]`` continuing from ``layer_state.conv
    [C, K − 1]`` (replaced by the new window): one token through
    :func:`kernels.gated_delta_rule.causal_conv1d_update` on a copy of the state; a longer chunk
    through the torch conv (the issue's kernel set has only the decode step). Returns ``[T, C]``."""
    from kernels.gated_delta_rule import causal_conv1d_update

    if x.shape[0] != 1:
        y, layer_state.conv = torch_causal_conv1d(x, weight, layer_state.conv)
        return y
    conv = layer_state.conv.to(x.dtype).clone()[None]  # the checkpoint's tensors are never written
    y = causal_conv1d_update(x, weight.contiguous(), conv)
    layer_state.conv = conv[0].to(layer_state.conv.dtype)
    return y


def compressed_attention(
    q: Tensor, window_kv: Tensor, window_positions: Tensor, entries: Tensor, positions: Tensor, sinks: Tensor,
    *, scale: float, window: int, indices: Tensor | None = None, valid: Tensor | None = None, ratio: int = 1,
) -> Tensor:  # fmt: skip
    """DeepSeek-V4's window-plus-compressed sink attention through
    :func:`kernels.sparse_compressed_attention.sparse_compressed_attention`: ``q [T, H, D]``, the
    window's shared K = V rows ``window_kv [S, D]`` at ``window_positions [S]``, ``entries [N, D]``
    (``[0, D]`` for a sliding layer) → ``[T, H, D]`` in q's dtype. CSA passes the indexer's
    ``indices / valid [T, k]``; HCA its ``ratio``."""
    from kernels.sparse_compressed_attention import sparse_compressed_attention

    dtype = q.dtype
    return sparse_compressed_attention(
        q, window_kv.to(dtype).contiguous(), window_positions.contiguous(), entries.to(dtype).contiguous(), positions.contiguous(),
        sinks.float(), scale=scale, window=window, indices=indices, valid=valid, ratio=None if indices is not None else ratio,
    )  # fmt: skip


def compress_pool(
    kv: Tensor,
    gate: Tensor,
    bias: Tensor,
    *,
    overlapping: bool,
    prev_kv: Tensor | None,
    prev_gate: Tensor | None,
) -> Tensor:
    """The gated pooling of whole groups through :func:`kernels.compressor.compress_pool`
    (``kv / gate [n·r, F]``, ``bias [r, F]`` float32, the previous group's first halves ``[r, D]``
    or None) → ``[n, D]`` in kv's dtype, before the entry's norm and RoPE."""
    from kernels.compressor import compress_pool as pool

    return pool(
        kv.contiguous(),
        gate.to(kv.dtype).contiguous(),
        bias.float().contiguous(),
        overlapping=overlapping,
        prev_kv=prev_kv,
        prev_gate=prev_gate,
    )


def indexer_topk(
    q: Tensor, keys: Tensor, weights: Tensor, positions: Tensor, *, ratio: int, k: int, scale: float
) -> tuple[Tensor, Tensor]:
    """The lightning indexer's top-k through :func:`kernels.indexer_topk.indexer_topk`:
    ``q [T, H_I, D_I]``, ``keys [N, D_I]``, ``weights [T, H_I]`` → ``(indices [T, min(k, N)]
    int32, valid bool)``, ties to the earlier entry as the torch path's stable sort."""
    from kernels.indexer_topk import indexer_topk as topk

    _, indices, valid = topk(
        q.contiguous(),
        keys.to(q.dtype).contiguous(),
        weights.float().contiguous(),
        positions.contiguous(),
        ratio=ratio,
        k=k,
        scale=scale,
    )
    return indices, valid


def fused_moe(x: Tensor, gate_up: Tensor, down: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
    """Qwen3-Next's routed experts through :func:`kernels.fused_moe.fused_moe`: ``x [T, C]``,
    packed ``gate_up [E, 2I, C]`` and ``down [E, C, I]``, the router's ``topk_ids / topk_weights
    [T, k]`` → ``[T, C]`` in x's dtype."""
    from kernels.fused_moe import fused_moe as moe

    return moe(x.contiguous(), gate_up, down, topk_ids, topk_weights)  # weights as they are: no per-step copy
