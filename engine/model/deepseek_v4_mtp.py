"""DeepSeek-V4's multi-token-prediction (MTP) modules, ``mtp.<k>.*`` of released checkpoints.

Layout as DeepSeek's V4 reference code builds it (``MTPBlock(Block)`` in its ``inference/model.py``,
as its released tensor names show: ``mtp.0.enorm``, ``hnorm``, ``e_proj``, ``h_proj``, ``norm``,
``hc_head_{fn,base,scale}``, and a whole decoder block's ``attn.*``, ``ffn.*``, ``attn_norm``,
``ffn_norm``, ``hc_attn_*``, ``hc_ffn_*``): one decoder block (sliding-window attention, a
learned top-k MoE) with its own entry projections and its own mHC head; the embedding and the LM
head are the main model's. For depth k, from the main model's last streams ``h [T, N, C]`` and
the next tokens' embeddings ``e [T, C]``:

    x = e_proj(enorm(e)) ⊕ h_proj(hnorm(h))     (e broadcast over the N streams)  [T, N, C]
    x = block(x);  hidden = norm(hc_head(x))                                         [T, C]

transformers ignores ``mtp.*`` (``_keys_to_ignore_on_load_unexpected``), so there is no reference
to compare the forward with; the engine loads and keeps these weights for a later
speculative-decoding issue and ``generate`` does not call them.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor, nn

from engine.model.deepseek_v4_config import DeepseekV4Config
from engine.model.deepseek_v4_decoder import DeepseekV4DecoderLayer
from engine.model.hyper_connections import HyperHead
from engine.model.layers import RMSNorm
from engine.model.state import SequenceState

MTP_ATTENTION = "sliding_attention"
MTP_MLP = "moe"


def mtp_config(config: DeepseekV4Config) -> DeepseekV4Config:
    """``config`` with one more layer per MTP depth (``sliding_attention``, ``moe`` — or
    ``dense`` for kvscope's dense stack), so the blocks are built at indices
    ``num_hidden_layers + k``."""
    k = config.num_nextn_predict_layers
    mlp = MTP_MLP if config.has_experts else "dense"
    return dataclasses.replace(
        config,
        num_hidden_layers=config.num_hidden_layers + k,
        layer_types=(*config.layer_types, *[MTP_ATTENTION] * k),
        mlp_layer_types=(*(config.mlp_layer_types or ["dense"] * config.num_hidden_layers), *[mlp] * k),
        num_nextn_predict_layers=0,
    )


class DeepseekV4MTPLayer(DeepseekV4DecoderLayer):
    """One MTP depth: the decoder block's parameters plus ``enorm``, ``hnorm`` ``[C]``,
    ``e_proj``, ``h_proj`` ``[C, C]``, ``norm`` ``[C]`` and ``hc_head.*``.

    forward: next-token embeddings ``[T, C]``, the main model's last streams ``[T, N, C]``,
    their ids and positions ``[T]`` and a state for the block's attention (layer index
    ``num_hidden_layers + k``) → hidden states ``[T, C]`` for the LM head.
    """

    def __init__(self, config: DeepseekV4Config, depth: int) -> None:
        extended = mtp_config(config)
        super().__init__(extended, config.num_hidden_layers + depth)
        c, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm, self.norm = RMSNorm(c, eps), RMSNorm(c, eps), RMSNorm(c, eps)
        self.e_proj = nn.Linear(c, c, bias=False)
        self.h_proj = nn.Linear(c, c, bias=False)
        self.hc_head = HyperHead(c, config.hc_mult, config.hc_eps, eps) if config.hyper_connections else None

    def predict(self, embeds: Tensor, streams: Tensor, input_ids: Tensor, positions: Tensor, state: SequenceState) -> Tensor:
        x = self.e_proj(self.enorm(embeds)).unsqueeze(1) + self.h_proj(self.hnorm(streams))
        x = super().forward(x, input_ids, positions, state)
        return self.norm(x[:, 0] if self.hc_head is None else self.hc_head(x))


class DeepseekV4MTP(nn.ModuleList):
    """The ``num_nextn_predict_layers`` MTP depths, ``mtp.<k>``."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__(DeepseekV4MTPLayer(config, k) for k in range(config.num_nextn_predict_layers))
