"""The ``kvscope_hybrid`` decoder: embeddings, pre-norm layers of mixed kinds, final norm, LM head.

Each layer is ``x + mixer(norm(x))`` followed by ``x + mlp(norm(x))``; the mixer is
:class:`~engine.model.attention.Attention` (full or sliding) or
:class:`~engine.model.gated_deltanet.GatedDeltaNet`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from engine.config import COMPRESSED_KINDS, HybridConfig, hybrid_config_from_dict
from engine.model.attention import Attention
from engine.model.base import WINDOW_KINDS, CausalLM, ModelLayout
from engine.model.decode_batch import DecodeBatch
from engine.model.deepseek_v4_attention import DeepseekV4Attention
from engine.model.gated_deltanet import GatedDeltaNet
from engine.model.layers import RMSNorm, SwiGLU, rotary_cos_sin
from engine.model.state import DenseState, PackedStates, SequenceState, per_sequence


class DecoderLayer(nn.Module):
    def __init__(self, config: HybridConfig, layer: int) -> None:
        super().__init__()
        kind = config.layer_types[layer]
        self.kind = kind
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer: Attention | GatedDeltaNet | DeepseekV4Attention
        if kind == "linear_attention":
            self.mixer = GatedDeltaNet(config, layer)
        elif kind in COMPRESSED_KINDS:
            self.mixer = DeepseekV4Attention(config.deepseek_v4_config(), layer)
        else:
            window = config.sliding_window if kind == "sliding_attention" else None
            self.mixer = Attention(config, layer, window)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor], state: SequenceState | PackedStates) -> Tensor:
        x = x + per_sequence(self._mix, self.input_layernorm(x), positions, rope, state)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _mix(self, h: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor] | None, state: SequenceState | DecodeBatch) -> Tensor:
        if isinstance(self.mixer, GatedDeltaNet):
            return self.mixer(h, state)
        if isinstance(self.mixer, DeepseekV4Attention):
            if isinstance(state, DecodeBatch):  # no batched path: each live row on its own state
                return state.per_row(self.mixer, h)
            return self.mixer(h, positions, state)
        assert rope is not None
        return self.mixer(h, positions, rope, state)


class HybridForCausalLM(CausalLM):
    """forward: ``input_ids [T]`` at ``positions [T]`` with a :class:`SequenceState` →
    logits ``[T, vocab]`` (float32)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def init_random(self, seed: int) -> None:
        """Deterministic random weights: normal(0, initializer_range) for matrices, the Gated
        DeltaNet decay ``A_log = log(U(1, 16))`` and ``dt_bias`` for a decay time in [1e-3, 0.1]
        (as Mamba2 / Qwen3-Next initialise them)."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith("norm_weight"):
                    p.fill_(1.0)
                elif name.endswith("sinks") or name.endswith("position_bias"):
                    p.zero_()  # V4's attention sinks and compressor positional biases start at 0
                elif name.endswith("A_log"):
                    p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
                elif name.endswith("dt_bias"):
                    dt = torch.exp(
                        torch.rand(p.shape, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
                    )
                    p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
                elif name.endswith("conv_weight"):
                    bound = 1.0 / math.sqrt(p.shape[1])
                    p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def linear_state_shapes(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per linear layer: (conv state shape, recurrent state shape)."""
        shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for i, layer in enumerate(self.layers):
            mixer = layer.mixer
            if isinstance(mixer, GatedDeltaNet):
                shapes[i] = (mixer.conv_state_shape, mixer.recurrent_state_shape)
        return shapes

    @property
    def layout(self) -> ModelLayout:
        c = self.config
        compressed = {i: layer.mixer for i, layer in enumerate(self.layers) if isinstance(layer.mixer, DeepseekV4Attention)}
        # the modules' own KV heads: a tensor-parallel rank's shard keeps fewer than the config
        kv_heads = next((layer.mixer.num_kv_heads for layer in self.layers if isinstance(layer.mixer, Attention)), c.num_key_value_heads)
        return ModelLayout(
            model_type=c.model_type,
            revision=c.revision,
            vocab_size=c.vocab_size,
            layer_types=c.layer_types,
            num_kv_heads=kv_heads,
            kv_head_dim=c.head_dim,
            sliding_window=c.sliding_window if set(c.layer_types) & WINDOW_KINDS else None,
            linear_state_shapes=self.linear_state_shapes(),
            compressed_state_specs={i: mixer.state_spec() for i, mixer in compressed.items()},
            kv_geometry={i: (1, mixer.head_dim) for i, mixer in compressed.items()},
        )

    def new_dense_state(self) -> DenseState:
        return DenseState(self.linear_state_shapes(), self.lm_head.weight.device)

    def forward(self, input_ids: Tensor, positions: Tensor, state: SequenceState | PackedStates) -> Tensor:
        x = self.embed_tokens(input_ids)
        rope = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        for layer in self.layers:
            x = layer(x, positions, rope, state)
        return self.lm_head(self.norm(x)).float()


config_from_dict = hybrid_config_from_dict
"""The loader's entry: a :class:`HybridConfig` from a ``config.json`` mapping."""


def build(config: HybridConfig) -> HybridForCausalLM:
    """The loader's entry: an uninitialised model of ``config`` (weights come from a checkpoint
    or :meth:`HybridForCausalLM.init_random`)."""
    return HybridForCausalLM(config)
