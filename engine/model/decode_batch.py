"""One decode step for a padded batch of sequences, over static buffers (the serving runtime's
model runner; vLLM's persistent batch and CUDA-graph decode, SGLang's decode batch).

Every row is one sequence's next token. Rows ``[B, B_pad)`` are padding: their block tables and
write pages point at each KV pool's sentinel page (block 0), their recurrent state index at the
sentinel decode slot (slot 0), and their ``seq_lens`` are 0, so whatever they compute and write
lands where no request reads (case C10: a padding row must never alias a live request's slot).

What the mixers see instead of a :class:`~engine.model.state.SequenceState`:

* :meth:`DecodeBatch.write_kv` — write every row's new key and value through the slot mapping
  and return the layer's pool views, block tables ``[B_pad, max_pages]`` and ``seq_lens``;
* :attr:`DecodeBatch.slot_ids` and :meth:`DecodeBatch.linear` — each row's decode slot in the
  static ``conv [S, C, K − 1]`` / ``recurrent [S, H, D_k, D_v]`` tensors of a linear layer,
  updated in place;
* :meth:`DecodeBatch.per_row` — for DeepSeek-V4's layers in a ``kvscope_hybrid`` (their
  compressor, indexer and window state is per sequence): the layer once per live row on that
  row's :class:`~engine.model.state.SequenceState`, zeros for padding rows.

The math is the per-sequence path's (:mod:`engine.model.attention`,
:mod:`engine.model.gated_deltanet`, the rule's step
:func:`kernels.gated_delta_rule_torch.delta_rule_step`), one token per row, in torch or through
the kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from kernels.gated_delta_rule_torch import delta_rule_step
from kernels.launch import graph_safe

if TYPE_CHECKING:
    from engine.model.state import SequenceState


@dataclass(frozen=True, slots=True)
class LayerPages:
    """One attention layer's paged KV for the batch: ``k_cache / v_cache [num_blocks, P, H_kv,
    D]`` (views of the pool), ``block_tables [B_pad, max_pages]`` int32, ``seq_lens [B_pad]``
    int32 (0 on padding rows)."""

    k_cache: Tensor
    v_cache: Tensor
    block_tables: Tensor
    seq_lens: Tensor


class DecodeBatch:
    """The batch's view of the cache for one step (module docstring). Built by the runtime's
    model runner from its persistent buffers; every tensor here is a prefix slice ``[:B_pad]``
    of a buffer whose address never changes."""

    def __init__(
        self,
        *,
        size: int,
        kv_of_layer: dict[int, tuple[Tensor, int, int]],
        block_tables: list[Tensor],
        seq_lens: list[Tensor],
        write_pages: list[Tensor],
        write_offsets: list[Tensor],
        slot_ids: Tensor,
        conv: dict[int, Tensor],
        recurrent: dict[int, Tensor],
    ) -> None:
        self.size = size
        """B_pad, rows in the batch (padding included)."""
        self._kv_of_layer = kv_of_layer  # layer -> (pool kv tensor, layer slot, form index)
        self._tables, self._lens = block_tables, seq_lens
        self._pages, self._offsets = write_pages, write_offsets
        self.slot_ids = slot_ids
        """``[B_pad]`` int64: each row's decode slot (0, the sentinel, on padding rows)."""
        self._conv, self._recurrent = conv, recurrent
        self.sequences: tuple[tuple[SequenceState, Tensor], ...] = ()
        """Rows ``[0, B)`` for this step as (sequence state, its chunk's positions ``[1]``), set by
        the runner before each step: the mixers without a batched path (DeepSeek-V4's) run per
        row on them."""

    def per_row(self, mix: Callable[[Tensor, Tensor, SequenceState], Tensor], h: Tensor) -> Tensor:
        """``mix(h[i:i+1], positions_i, state_i)`` for each live row ``i`` on its own sequence
        state; padding rows get zeros and touch no state. ``h [B_pad, C]`` → ``[B_pad, C_out]``."""
        outputs = [mix(h[i : i + 1], positions, state) for i, (state, positions) in enumerate(self.sequences)]
        pad = self.size - len(self.sequences)
        if pad:
            outputs.append(h.new_zeros((pad, h.shape[1])))  # a mixer maps the hidden size to itself
        return torch.cat(outputs)

    def write_kv(self, layer: int, keys: Tensor, values: Tensor) -> LayerPages:
        """Store ``keys / values [B_pad, H_kv, D]`` at each row's slot-mapping position and
        return the layer's pages for attention."""
        kv, slot, form = self._kv_of_layer[layer]
        pages, offsets = self._pages[form], self._offsets[form]
        kv[pages, slot, 0, offsets] = keys.to(kv.dtype)
        kv[pages, slot, 1, offsets] = values.to(kv.dtype)
        return LayerPages(kv[:, slot, 0], kv[:, slot, 1], self._tables[form], self._lens[form])

    def linear(self, layer: int) -> tuple[Tensor, Tensor]:
        """The static ``conv [S, C, K − 1]`` and ``recurrent [S, H, D_k, D_v]`` of a linear
        layer (index them with :attr:`slot_ids`)."""
        return self._conv[layer], self._recurrent[layer]


def paged_decode(q: Tensor, pages: LayerPages, *, scale: float, window: int | None, backend: str, sinks: Tensor | None = None) -> Tensor:
    """Attention of each row's query ``q [B_pad, H_q, D]`` over its pages: the
    ``paged_decode_attention`` kernel, or the same in torch (gather the table's pages, mask
    positions ``≥ seq_len`` and outside the window; inside :func:`kernels.launch.graph_safe`, over
    the table's whole width rather than the pages the longest row uses). Padding rows give zeros."""
    dtype = pages.k_cache.dtype
    if backend == "triton":
        from kernels.paged_decode_attention import paged_decode_attention

        out = paged_decode_attention(q.to(dtype), pages.k_cache, pages.v_cache, pages.block_tables, pages.seq_lens, scale=scale, window=window, sinks=sinks)
        return out.to(q.dtype)
    b, h_q, d = q.shape
    page, h_kv = pages.k_cache.shape[1], pages.k_cache.shape[2]
    if graph_safe(pages.seq_lens):  # no host read of the lengths: every page of the table
        used = pages.block_tables.shape[1]
    else:
        used = max(1, math.ceil(int(pages.seq_lens.max()) / page)) if b else 1
    tables = pages.block_tables[:, :used].long()
    keys = pages.k_cache[tables].reshape(b, used * page, h_kv, d).float()
    values = pages.v_cache[tables].reshape(b, used * page, h_kv, d).float()
    group = h_q // h_kv
    scores = torch.einsum("bhd,bshd->bhs", q.float(), keys.repeat_interleave(group, dim=2)) * scale
    j = torch.arange(used * page, device=q.device)
    lens = pages.seq_lens.long()[:, None]
    visible = j[None, :] < lens
    if window is not None:
        visible &= j[None, :] >= lens - window
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.float().view(1, h_q, 1).expand(b, h_q, 1)), dim=-1)
    probs = torch.nan_to_num(scores.softmax(dim=-1))  # a padding row sees nothing: zeros
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.einsum("bhs,bshd->bhd", probs, values.repeat_interleave(group, dim=2))
    return out.to(q.dtype)


def conv_decode(x: Tensor, weight: Tensor, conv: Tensor, slot_ids: Tensor, *, backend: str) -> Tensor:
    """The causal conv's decode step for every row: ``x [B_pad, C]``, ``weight [C, K]``, the
    static ``conv [S, C, K − 1]`` read and shifted in place at each row's slot. Returns
    ``[B_pad, C]`` (SiLU applied)."""
    state = conv[slot_ids]  # [B_pad, C, K-1], a copy
    if backend == "triton":
        from kernels.gated_delta_rule import causal_conv1d_update

        state = state.to(x.dtype).contiguous()
        y = causal_conv1d_update(x, weight.contiguous(), state)
        conv[slot_ids] = state.to(conv.dtype)
        return y
    window = torch.cat((state.to(x.dtype), x[:, :, None]), dim=2)  # [B_pad, C, K]
    y = nn.functional.silu((window * weight.to(x.dtype)).sum(-1))
    conv[slot_ids] = window[:, :, 1:].to(conv.dtype)
    return y


def delta_rule_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, recurrent: Tensor, slot_ids: Tensor, *, backend: str) -> Tensor:
    """One gated-delta-rule step per row (``q, k [B_pad, H, D_k]`` L2-normalised, ``v [B_pad,
    H, D_v]``, ``g, beta [B_pad, H]``) on the static ``recurrent [S, H, D_k, D_v]`` at each row's
    slot, updated in place. Returns ``o [B_pad, H, D_v]`` float32."""
    state = recurrent[slot_ids].float()  # [B_pad, H, K, V], a copy
    if backend == "triton":
        from kernels.gated_delta_rule import fused_recurrent_gated_delta_rule

        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        o, final = fused_recurrent_gated_delta_rule(q, k, v.float(), g.contiguous(), beta.contiguous(), state.contiguous(), cu)
        recurrent[slot_ids] = final
        return o.float()
    q32 = q.float() / math.sqrt(q.shape[-1])
    o, state = delta_rule_step(q32, k.float(), v.float(), g.float().exp(), beta.float(), state)
    recurrent[slot_ids] = state
    return o
