"""One DeepSeek-V4 decoder block: attention of the layer's kind and its MLP, wrapped by mHC.

Sources: DeepSeek-V4 paper §2 (block), §2.2 (mHC); transformers' ``DeepseekV4DecoderLayer``.
"""

from __future__ import annotations

from torch import Tensor, nn

from engine.model.deepseek_v4_attention import DeepseekV4Attention
from engine.model.deepseek_v4_config import DeepseekV4Config
from engine.model.deepseek_v4_moe import DeepseekV4MLP, SparseMoE
from engine.model.hyper_connections import HyperConnection
from engine.model.layers import RMSNorm
from engine.model.state import PackedStates, SequenceState, per_sequence


class DeepseekV4DecoderLayer(nn.Module):
    """One V4 block: attention of the layer's kind, then its MLP (``dense``, ``moe`` or
    ``hash_moe``), each wrapped by mHC (``attn_hc`` / ``ffn_hc``) or, with
    ``hyper_connections: false``, by a plain pre-norm residual.

    forward: ``streams [T, N, C]`` (N = ``hc_mult``; N = 1 for the plain residual) → the same."""

    def __init__(self, config: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.self_attn = DeepseekV4Attention(config, layer)
        c = config.hidden_size
        self.mlp: nn.Module
        if config.mlp_kind(layer) == "dense":
            self.mlp = DeepseekV4MLP(c, config.intermediate_size, config.swiglu_limit)
        else:
            self.mlp = SparseMoE(config, layer)
        self.input_layernorm = RMSNorm(c, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c, config.rms_norm_eps)
        self.attn_hc: HyperConnection | None = None
        self.ffn_hc: HyperConnection | None = None
        if config.hyper_connections:
            args = (c, config.hc_mult, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
            self.attn_hc, self.ffn_hc = HyperConnection(*args), HyperConnection(*args)

    def _mlp(self, x: Tensor, input_ids: Tensor) -> Tensor:
        return self.mlp(x, input_ids) if isinstance(self.mlp, SparseMoE) else self.mlp(x)

    def _attention(self, x: Tensor, positions: Tensor, state: SequenceState | PackedStates) -> Tensor:
        return per_sequence(lambda h, p, _, s: self.self_attn(h, p, s), self.input_layernorm(x), positions, None, state)

    def forward(self, streams: Tensor, input_ids: Tensor, positions: Tensor, state: SequenceState | PackedStates) -> Tensor:
        if self.attn_hc is None or self.ffn_hc is None:
            x = streams[:, 0]
            x = x + self._attention(x, positions, state)
            return (x + self._mlp(self.post_attention_layernorm(x), input_ids)).unsqueeze(1)
        post, comb, collapsed = self.attn_hc(streams)
        streams = HyperConnection.merge(streams, self._attention(collapsed, positions, state), post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        return HyperConnection.merge(streams, self._mlp(self.post_attention_layernorm(collapsed), input_ids), post, comb)
