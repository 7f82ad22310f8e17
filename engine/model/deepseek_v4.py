"""The ``deepseek_v4`` family: DeepSeek-V4 as released (mHC, MoE, hash-MoE, MTP), and kvscope's
attention stack with dense MLPs.

``DeepseekV4ForCausalLM`` = token embeddings, copied into ``hc_mult`` residual streams → per layer
attention then MLP, each entered through mHC's ``pre`` collapse and left through its ``post`` /
``comb`` merge (:mod:`engine.model.hyper_connections`) → the streams' head → RMSNorm → LM head.
The attention layers (sliding, CSA, HCA) are :mod:`engine.model.deepseek_v4_attention`; the MLPs
:mod:`engine.model.deepseek_v4_moe`. With ``hyper_connections: false`` each block is a plain
pre-norm residual (kvscope's ``deepseek_v4-tiny``). Parameter names are transformers' module
names (``model.layers.<i>.self_attn.*``, ``.mlp.*``, ``.attn_hc.*``, ``model.hc_head.*``) except the
experts, one module each (``mlp.experts.<i>.gate_proj``) as checkpoints store them;
:mod:`engine.model.deepseek_v4_names` maps DeepSeek-native and transformers-saved names here.

Sources: DeepSeek-V4 paper (§2.1 MoE, §2.2 mHC, §2.3.1 CSA, §2.3.2 HCA, as cited by
transformers' config docstrings); transformers ``models/deepseek_v4/modeling_deepseek_v4.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.model.base import CausalLM, ModelLayout
from engine.model.deepseek_v4_attention import DeepseekV4Attention
from engine.model.deepseek_v4_config import DeepseekV4Config
from engine.model.deepseek_v4_config_io import config_from_dict, config_to_dict
from engine.model.deepseek_v4_decoder import DeepseekV4DecoderLayer
from engine.model.deepseek_v4_mtp import DeepseekV4MTP
from engine.model.deepseek_v4_names import checkpoint_name
from engine.model.hyper_connections import HyperHead
from engine.model.layers import RMSNorm
from engine.model.state import (
    CompressedLayerSpec,
    DenseState,
    PackedStates,
    SequenceState,
)

__all__ = ["DeepseekV4Config", "DeepseekV4ForCausalLM", "build", "checkpoint_name", "config_from_dict", "config_to_dict"]


class DeepseekV4Model(nn.Module):
    """Embeddings, decoder layers, the streams' head (mHC) and the final norm (transformers'
    ``model.*`` names)."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_mult = config.hc_mult
        self.hc_head: HyperHead | None = None
        if config.hyper_connections:
            self.hc_head = HyperHead(config.hidden_size, config.hc_mult, config.hc_eps, config.rms_norm_eps)

    def hidden_states(self, input_ids: Tensor, positions: Tensor, state: SequenceState | PackedStates) -> Tensor:
        """The final norm's input ``[T, C]`` (the streams collapsed)."""
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, state)
        return streams[:, 0] if self.hc_head is None else self.hc_head(streams)


class DeepseekV4ForCausalLM(CausalLM):
    """forward: ``input_ids [T]`` at ``positions [T]`` with a :class:`SequenceState` → logits
    ``[T, vocab]`` (float32). Positions must continue the state: chunked prefill and decode
    pass consecutive chunks with the same state object.

    Raises:
        RuntimeError: a chunk that does not start where a compressed layer's state ends.
    """

    float32_names = ("hc.fn", "hc.base", "hc.scale", "hc_fn", "hc_base", "hc_scale", "e_score_correction_bias")
    """mHC weights and the routers' bias stay float32 (transformers keeps them so too)."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV4Model(config)
        self.attach_lm_head(config.hidden_size, config.vocab_size, self.model.embed_tokens, config.tie_word_embeddings)
        self.mtp = DeepseekV4MTP(config) if config.num_nextn_predict_layers else None
        """The released checkpoints' multi-token-prediction modules (``mtp.<k>.*``); loaded and
        kept for speculative decoding, not run by ``generate``."""

    def check_weights(self) -> None:
        """Every hash-MoE layer's ``tid2eid`` names experts in ``[0, n_routed_experts)``.

        Raises:
            ValueError: naming the table and the first bad entry.
        """
        for name, table in self.named_buffers():
            if name.endswith("tid2eid") and table.numel():
                low, high = int(table.min()), int(table.max())
                if low < 0 or high >= self.config.n_routed_experts:
                    bad = low if low < 0 else high
                    raise ValueError(f"tensor {name} routes to expert {bad}; n_routed_experts = {self.config.n_routed_experts}")

    def init_random(self, seed: int) -> None:
        """Deterministic random weights as transformers initialises V4: normal(0,
        initializer_range) for matrices and embeddings, ones for norms and mHC scales, zeros for
        the attention sinks, the compressors' positional biases and mHC biases; a hash-MoE
        layer's ``tid2eid`` sends each token to ``num_experts_per_tok`` distinct random experts
        (transformers leaves it zero: its real values come from the checkpoint)."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith(("hc.scale", "hc_scale")):
                    p.fill_(1.0)
                elif name.endswith(("sinks", "position_bias", "hc.base", "hc_base")):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
            for name, buffer in self.named_buffers():
                if name.endswith("tid2eid"):
                    ranks = torch.rand((buffer.shape[0], self.config.n_routed_experts), generator=gen)
                    buffer.copy_(ranks.argsort(dim=-1)[:, : buffer.shape[1]])
                elif name.endswith("e_score_correction_bias"):
                    buffer.zero_()

    def compressed_state_specs(self) -> dict[int, CompressedLayerSpec]:
        """Per CSA/HCA layer index, the geometry of the state it keeps."""
        specs: dict[int, CompressedLayerSpec] = {}
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            if isinstance(attn, DeepseekV4Attention) and attn.compressor is not None:
                specs[i] = attn.state_spec()
        return specs

    @property
    def layout(self) -> ModelLayout:
        """Every layer stores one shared K = V head of ``head_dim`` in the ``swa_window`` form
        with window ``sliding_window`` (sliding layers, and the local branch of CSA/HCA
        layers); CSA/HCA layers also keep compressor state
        (:class:`~engine.model.state.CompressedLayerState`: ``compressed_kv``,
        ``uncompressed_tail``, ``indexer_state``)."""
        c = self.config
        return ModelLayout(
            model_type=c.model_type,
            revision=c.revision,
            vocab_size=c.vocab_size,
            layer_types=c.layer_types,
            num_kv_heads=1,
            kv_head_dim=c.head_dim,
            sliding_window=c.sliding_window,  # every V4 layer has a window
            compressed_state_specs=self.compressed_state_specs(),
        )

    def new_dense_state(self) -> DenseState:
        return DenseState({}, self.lm_head.weight.device)

    def forward(self, input_ids: Tensor, positions: Tensor, state: SequenceState | PackedStates) -> Tensor:
        return self.lm_head(self.model.norm(self.model.hidden_states(input_ids, positions, state))).float()


def build(config: DeepseekV4Config) -> DeepseekV4ForCausalLM:
    """The loader's entry: an uninitialised model of ``config`` (weights come from a checkpoint
    or :meth:`DeepseekV4ForCausalLM.init_random`)."""
    return DeepseekV4ForCausalLM(config)
