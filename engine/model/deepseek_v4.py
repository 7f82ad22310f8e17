"""The ``deepseek_v4`` family: DeepSeek-V4's attention stack with a dense SwiGLU MLP per layer.

``DeepseekV4ForCausalLM`` = token embeddings → per layer ``x + attn(RMSNorm(x))`` then
``x + mlp(RMSNorm(x))`` → RMSNorm → LM head. The attention layers (sliding, CSA, HCA) match
transformers' ``DeepseekV4Attention`` on the same weights (parameter names included, under
``model.layers.<i>.self_attn``); the MLP is V4's SwiGLU with its clamp (``swiglu_limit``), as
V4's shared expert computes it. Hyper-connections and mixture-of-experts routing are not
implemented (see :mod:`engine.model.deepseek_v4_config`, which refuses configs needing them).

Sources: DeepSeek-V4 paper (§2.3.1 CSA, §2.3.2 HCA, as cited by transformers' config
docstrings); transformers ``models/deepseek_v4/modeling_deepseek_v4.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.model.base import CausalLM, ModelLayout
from engine.model.deepseek_v4_attention import DeepseekV4Attention
from engine.model.deepseek_v4_config import DeepseekV4Config, config_from_dict, config_to_dict
from engine.model.layers import RMSNorm
from engine.model.state import (
    CompressedLayerSpec,
    DenseState,
    PackedStates,
    SequenceState,
    per_sequence,
)

__all__ = ["DeepseekV4Config", "DeepseekV4ForCausalLM", "build", "config_from_dict", "config_to_dict"]


class DeepseekV4MLP(nn.Module):
    """``down(silu(min(gate(x), l)) · clamp(up(x), −l, l))`` with l = ``swiglu_limit``;
    ``x [T, C]`` → ``[T, C]`` (transformers' ``DeepseekV4MLP``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(nn.functional.silu(gate) * up)


class DeepseekV4DecoderLayer(nn.Module):
    """Pre-norm residual block: V4 attention of the layer's kind, then the dense MLP."""

    def __init__(self, config: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.self_attn = DeepseekV4Attention(config, layer)
        self.mlp = DeepseekV4MLP(config.hidden_size, config.intermediate_size, config.swiglu_limit)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, positions: Tensor, state: SequenceState | PackedStates) -> Tensor:
        x = x + per_sequence(lambda h, p, _, s: self.self_attn(h, p, s), self.input_layernorm(x), positions, None, state)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV4Model(nn.Module):
    """Embeddings, decoder layers and the final norm (transformers' ``model.*`` names)."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV4ForCausalLM(CausalLM):
    """forward: ``input_ids [T]`` at ``positions [T]`` with a :class:`SequenceState` → logits
    ``[T, vocab]`` (float32). Positions must continue the state: chunked prefill and decode
    pass consecutive chunks with the same state object.

    Raises:
        RuntimeError: a chunk that does not start where a compressed layer's state ends.
    """

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV4Model(config)
        self.attach_lm_head(config.hidden_size, config.vocab_size, self.model.embed_tokens, config.tie_word_embeddings)

    def init_random(self, seed: int) -> None:
        """Deterministic random weights as transformers initialises V4: normal(0,
        initializer_range) for matrices and embeddings, ones for norms, zeros for the attention
        sinks and the compressors' positional biases."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    p.fill_(1.0)
                elif name.endswith("sinks") or name.endswith("position_bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

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
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, state)
        return self.lm_head(self.model.norm(x)).float()


def build(config: DeepseekV4Config) -> DeepseekV4ForCausalLM:
    """The loader's entry: an uninitialised model of ``config`` (weights come from a checkpoint
    or :meth:`DeepseekV4ForCausalLM.init_random`)."""
    return DeepseekV4ForCausalLM(config)
