"""DeepSeek-V4 attention: ``sliding_attention``, ``compressed_sparse_attention`` (CSA) and
``heavily_compressed_attention`` (HCA), numerically as transformers' ``DeepseekV4Attention``.

Every kind (paper §2.3; one sequence of T tokens, H heads of D channels, C hidden):

* queries through a low-rank path: ``q = RMSNorm_unweighted(q_b(RMSNorm(q_a(x))))`` ``[T, H, D]``;
* one shared key/value head (multi-query attention with K = V): ``kv = RMSNorm(kv_proj(x))``
  ``[T, D]``; queries and kv are rotated on their trailing ``rope_head_dim`` channels;
* a window branch: query p sees the kv rows of positions k with ``0 ≤ p − k < W``;
* a learned sink logit per head in the softmax denominator (as in gpt-oss);
* the output's rotary channels are rotated back by the query's angle (so each value contributes
  by relative position), then projected in ``o_groups`` groups (``o_a_proj``) and mixed
  (``o_b_proj``).

HCA adds every compressed entry whose group ended at or before p (entries w < ⌊(p + 1)/r⌋);
CSA adds only those the indexer picks among them. Sliding layers keep their window through
:meth:`SequenceState.attention_kv` (the ``swa_window`` form, one KV head of D, K stored as V);
CSA/HCA layers keep window, compressor and indexer state in a
:class:`~engine.model.state.CompressedLayerState`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.model import kernel_backend as kb
from engine.model.attention import attention_mask
from engine.model.deepseek_v4_compressor import (
    Compressor,
    CompressorWithIndexer,
    apply_rope,
    hca_compressor,
    rope_cos_sin,
)
from engine.model.deepseek_v4_config import DeepseekV4Config
from engine.model.layers import RMSNorm
from engine.model.state import AttentionKV, CompressedLayerSpec, CompressedLayerState, SequenceState


class GroupedLinear(nn.Module):
    """Block-diagonal projection of ``x [T, G, I]`` → ``[T, G, O]``: group g uses rows
    ``[g·O, (g+1)·O)`` of ``weight [G·O, I]`` (V4's grouped output projection, paper §2.3.1)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight.view(self.groups, -1, self.weight.shape[-1]).transpose(1, 2)  # [G, I, O]
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def unweighted_rms_norm(x: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x², -1) + eps)`` with the statistic in float32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sink_attention(q: Tensor, keys: Tensor, visible: Tensor, sinks: Tensor, scale: float) -> Tensor:
    """Softmax attention of ``q [T, H, D]`` over shared ``keys [S, D]`` (also the values), with
    ``visible [T, S]`` (bool) and one extra sink logit per head ``sinks [H]`` that takes
    probability mass but contributes no value. Returns ``[T, H, D]``."""
    h, t = q.shape[1], q.shape[0]
    logits = torch.matmul(q.transpose(0, 1), keys.transpose(0, 1)) * scale  # [H, T, S]
    logits = logits.masked_fill(~visible, float("-inf"))
    sink = sinks.to(logits.dtype).view(h, 1, 1).expand(h, t, 1)
    combined = torch.cat((logits, sink), dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True).detach()  # a constant shift: no gradient needed
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys).transpose(0, 1)


class DeepseekV4Attention(nn.Module):
    """One V4 attention layer of kind ``config.layer_types[layer]``.

    forward: ``x [T, C]`` at ``positions [T]`` (consecutive, continuing the sequence's state)
    → ``[T, C]``; updates the layer's state in ``state``.

    Parameters (transformers' names): ``q_a_proj``, ``q_a_norm``, ``q_b_proj``, ``kv_proj``,
    ``kv_norm``, ``o_a_proj``, ``o_b_proj``, ``sinks [H]``, and for CSA/HCA ``compressor.*``
    (CSA: with ``compressor.indexer.*``).

    With the Triton backend the attention runs in ``sparse_compressed_attention`` (window rows
    plus the indexer's picks or HCA's ended groups), the compressors' pooling in
    ``compress_pool`` and the indexer's choice in ``indexer_topk``.
    """

    kernel_backend: kb.KernelBackend = "torch"

    def __init__(self, config: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.kind = config.layer_types[layer]
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        self.o_groups = config.o_groups
        self.eps = config.rms_norm_eps
        self.rope_dim = config.rope_head_dim
        self.rope_theta = config.rope_theta if self.kind == "sliding_attention" else config.compress_rope_theta
        self.scale = self.head_dim**-0.5
        c, hd = config.hidden_size, self.num_heads * self.head_dim
        self.q_a_proj = nn.Linear(c, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, hd, bias=False)
        self.kv_proj = nn.Linear(c, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_a_proj = GroupedLinear(hd // config.o_groups, config.o_groups * config.o_lora_rank, config.o_groups)
        self.o_b_proj = nn.Linear(config.o_groups * config.o_lora_rank, c, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.compressor: Compressor | None = None
        if self.kind == "compressed_sparse_attention":
            self.compressor = CompressorWithIndexer(config)
        elif self.kind == "heavily_compressed_attention":
            self.compressor = hca_compressor(config)

    def state_spec(self) -> CompressedLayerSpec:
        """The geometry of this CSA/HCA layer's state (dtype: the layer's weights')."""
        if self.compressor is None:
            raise RuntimeError(f"layer {self.layer} ({self.kind}) keeps no compressed state")
        indexer = self.compressor.indexer if isinstance(self.compressor, CompressorWithIndexer) else None
        return CompressedLayerSpec(
            window=self.window,
            head_dim=self.head_dim,
            compressor=self.compressor.spec,
            indexer=None if indexer is None else indexer.spec,
            dtype=self.kv_proj.weight.dtype,
        )

    def forward(self, x: Tensor, positions: Tensor, state: SequenceState) -> Tensor:
        t = x.shape[0]
        cos, sin = rope_cos_sin(positions, self.rope_dim, self.rope_theta)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_residual).view(t, self.num_heads, self.head_dim), self.eps)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, D]
        if self.kernel_backend == "triton":
            out = self._kernel_attention(q, x, q_residual, positions, kv, state)
        else:
            out = self._torch_attention(q, x, q_residual, positions, kv, state)
        out = apply_rope(out, cos, -sin)
        grouped = self.o_a_proj(out.reshape(t, self.o_groups, -1))
        return self.o_b_proj(grouped.flatten(1))

    def _torch_attention(self, q: Tensor, x: Tensor, q_residual: Tensor, positions: Tensor, kv: Tensor, state: SequenceState) -> Tensor:
        if self.compressor is None:
            stored = state.attention_kv(self.layer, positions, kv[:, None], kv[:, None])
            keys = stored.keys[:, 0]
            visible = attention_mask(positions, stored.positions, self.window)
        else:
            keys, visible = self._window_and_compressed(self.compressor, x, q_residual, positions, kv, state)
        return sink_attention(q, keys, visible, self.sinks, self.scale)

    def _kernel_attention(self, q: Tensor, x: Tensor, q_residual: Tensor, positions: Tensor, kv: Tensor, state: SequenceState) -> Tensor:
        """The same attention through the kernels (the window rows stay gathered from the
        layer's pages: the sparse kernel reads them as one ``[S, D]`` tensor)."""
        compressor = self.compressor
        if compressor is None:
            stored = state.attention_kv(self.layer, positions, kv[:, None], kv[:, None])
            entries = kv.new_zeros((0, self.head_dim))
            return kb.compressed_attention(q, stored.keys[:, 0], stored.positions, entries, positions, self.sinks, scale=self.scale, window=self.window)
        cstate, stored = self._advance(compressor, x, positions, kv, state)
        entries = cstate.compressor.entries
        if isinstance(compressor, CompressorWithIndexer):
            assert cstate.indexer is not None  # checked by _advance
            indices, valid = compressor.indexer.select_topk(x, q_residual, positions, cstate.indexer.entries)
            return kb.compressed_attention(
                q, stored.keys[:, 0], stored.positions, entries, positions, self.sinks, scale=self.scale, window=self.window,
                indices=indices, valid=valid,
            )  # fmt: skip
        return kb.compressed_attention(
            q, stored.keys[:, 0], stored.positions, entries, positions, self.sinks, scale=self.scale, window=self.window,
            ratio=compressor.spec.ratio,
        )  # fmt: skip

    def _advance(self, compressor: Compressor, x: Tensor, positions: Tensor, kv: Tensor, state: SequenceState) -> tuple[CompressedLayerState, AttentionKV]:
        """Store the chunk's window rows and advance the layer's compressed state (and its
        indexer's) by the chunk; returns the state and the window's stored rows."""
        cstate = state.compressed(self.layer, self.state_spec())
        start, t = cstate.num_tokens, x.shape[0]
        if int(positions[0]) != start:
            raise RuntimeError(f"layer {self.layer}: chunk starts at {int(positions[0])}, its state holds {start} tokens")
        # the local branch's rows (shared K = V) live with every other window's KV (swa_window)
        stored = state.attention_kv(self.layer, positions, kv[:, None], kv[:, None])
        compressor.update(x, cstate.compressor)
        if isinstance(compressor, CompressorWithIndexer):
            if cstate.indexer is None:
                raise RuntimeError(f"layer {self.layer}: CSA state without its indexer state")
            compressor.indexer.update(x, cstate.indexer)
        cstate.num_tokens = start + t
        return cstate, stored

    def _window_and_compressed(
        self,
        compressor: Compressor,
        x: Tensor,
        q_residual: Tensor,
        positions: Tensor,
        kv: Tensor,
        state: SequenceState,
    ) -> tuple[Tensor, Tensor]:
        """Keys ``[S, D]`` = the window rows then the compressed entries, and ``visible
        [T, S]``; advances the layer's compressed state by the chunk."""
        cstate, stored = self._advance(compressor, x, positions, kv, state)
        window_visible = attention_mask(positions, stored.positions, self.window)
        entries = cstate.compressor.entries
        if isinstance(compressor, CompressorWithIndexer):
            assert cstate.indexer is not None  # checked by _advance
            compressed_visible = compressor.indexer.select(x, q_residual, positions, cstate.indexer.entries)
        else:
            visible_count = torch.div(positions + 1, compressor.spec.ratio, rounding_mode="floor")
            compressed_visible = torch.arange(entries.shape[0], device=x.device)[None, :] < visible_count[:, None]
        return torch.cat((stored.keys[:, 0], entries)), torch.cat((window_visible, compressed_visible), dim=1)
