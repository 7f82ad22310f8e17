"""The ``qwen3_next`` family: Qwen3-Next (Qwen team, 2025) with transformers' parameter names and
numerics (``Qwen3NextForCausalLM``, transformers 5.x), checked by logits parity in
``tests/models/test_qwen3_next_parity.py``.

A decoder of pre-norm layers ``x + mixer(norm(x))`` then ``x + mlp(norm(x))`` with zero-centred
RMSNorms; the mixer is Gated DeltaNet (``linear_attn``) or gated attention (``self_attn``), the
MLP a sparse MoE with a shared expert or a dense SwiGLU. Modules: the config in
:mod:`engine.model.qwen3_next_config`, the mixers in :mod:`engine.model.qwen3_next_layers`, the
MoE block in :mod:`engine.model.qwen3_next_moe`. Everything runs in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.model.base import CausalLM, ModelLayout, StateShapes
from engine.model.layers import SwiGLU, rotary_cos_sin
from engine.model.qwen3_next_config import Qwen3NextConfig, config_from_dict
from engine.model.qwen3_next_layers import (
    GatedRMSNorm,
    Qwen3NextAttention,
    Qwen3NextGatedDeltaNet,
    ZeroCentredRMSNorm,
)
from engine.model.qwen3_next_moe import Qwen3NextExperts, Qwen3NextSparseMoe
from engine.model.state import DenseState, PackedStates, SequenceState, per_sequence

__all__ = ["Qwen3NextConfig", "Qwen3NextForCausalLM", "build", "config_from_dict"]


class Qwen3NextDecoderLayer(nn.Module):
    """One layer. Parameters under ``linear_attn.*`` or ``self_attn.*``, ``mlp.*``,
    ``input_layernorm.weight`` and ``post_attention_layernorm.weight``.

    forward: ``x [T, C]``, ``positions [T]``, rotary tables ``[T, R]``, state → ``[T, C]``.
    """

    def __init__(self, config: Qwen3NextConfig, layer: int, *, kind: str | None = None, sparse: bool | None = None) -> None:
        super().__init__()
        self.kind = kind or config.layer_types[layer]
        self.linear_attn: Qwen3NextGatedDeltaNet | None = None
        self.self_attn: Qwen3NextAttention | None = None
        if self.kind == "linear_attention":
            self.linear_attn = Qwen3NextGatedDeltaNet(config, layer)
        else:
            self.self_attn = Qwen3NextAttention(config, layer)
        self.mlp: Qwen3NextSparseMoe | SwiGLU
        if config.is_sparse_layer(layer) if sparse is None else sparse:
            self.mlp = Qwen3NextSparseMoe(config)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor], state: SequenceState | PackedStates) -> Tensor:
        x = x + per_sequence(self._mix, self.input_layernorm(x), positions, rope, state)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _mix(self, h: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor] | None, state: SequenceState) -> Tensor:
        if self.linear_attn is not None:
            return self.linear_attn(h, state)
        assert self.self_attn is not None and rope is not None
        return self.self_attn(h, positions, rope, state)


class Qwen3NextMTP(nn.Module):
    """Multi-token prediction (``mtp.*`` of released Qwen3-Next and Qwen3.5 checkpoints;
    layout as vLLM's ``Qwen3NextMultiTokenPredictor`` reads it): ``pre_fc_norm_embedding`` and
    ``pre_fc_norm_hidden`` (zero-centred RMSNorms), ``fc [C, 2C]`` over the concatenated
    ``[embedding, hidden]``, ``mtp_num_hidden_layers`` full-attention decoder layers (the main
    model's MLP kind: MoE when its layers are sparse) and a final ``norm``. The embedding and the
    LM head are the main model's.

    forward: next-token embeddings ``[T, C]``, the main model's last hidden states ``[T, C]``,
    ``positions [T]``, rotary tables and a state for its attention layers (indices
    ``num_hidden_layers + i``) → hidden states ``[T, C]``. Not yet checked against a reference
    (transformers skips ``mtp.*``); nothing in the engine calls it yet.
    """

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        c, eps, n = config.hidden_size, config.rms_norm_eps, config.num_hidden_layers
        sparse = config.num_experts > 0 and any(config.is_sparse_layer(i) for i in range(n))
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(c, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(c, eps)
        self.fc = nn.Linear(2 * c, c, bias=False)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(config, n + i, kind="full_attention", sparse=sparse) for i in range(config.mtp_num_hidden_layers)
        )
        self.norm = ZeroCentredRMSNorm(c, eps)

    def forward(self, embeds: Tensor, hidden: Tensor, positions: Tensor, rope: tuple[Tensor, Tensor], state: SequenceState, step: int = 0) -> Tensor:
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1))
        x = self.layers[step % len(self.layers)](x, positions, rope, state)
        return self.norm(x)


class Qwen3NextModel(nn.Module):
    """The decoder stack (transformers' ``Qwen3NextModel``, the ``model.*`` prefix):
    ``embed_tokens``, ``layers``, final ``norm``. forward returns hidden states ``[T, C]``."""

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_dim = config.rotary_dim
        self.rope_theta = config.rope_theta

    def forward(self, input_ids: Tensor, positions: Tensor, state: SequenceState | PackedStates) -> Tensor:
        x = self.embed_tokens(input_ids)
        rope = rotary_cos_sin(positions, self.rotary_dim, self.rope_theta)
        for layer in self.layers:
            x = layer(x, positions, rope, state)
        return self.norm(x)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next: one sequence, or several packed (:class:`~engine.model.state.PackedStates`).

    Parameter names are transformers' (``model.embed_tokens.weight``,
    ``model.layers.{i}.linear_attn.in_proj_qkvz.weight``, ``model.layers.{i}.mlp.experts.{e}.up_proj.weight``,
    ``lm_head.weight``, ...), so a ``save_pretrained`` directory loads as it is. With
    ``tie_word_embeddings`` the LM head shares the embedding matrix and ``tied_weights`` says so
    to the loader (the checkpoint may then omit ``lm_head.weight``).

    forward: ``input_ids [T]`` (int64) at absolute ``positions [T]`` with a
    :class:`SequenceState` → logits ``[T, vocab]`` (float32). Full-attention layers store their
    keys (after ``k_norm`` and RoPE) and values through ``state.attention_kv``; linear layers
    read and replace ``state.linear(layer)``. The same state carries over across prefill chunks
    and decode steps.

    Raises:
        ValueError: ``input_ids`` not one-dimensional or ``positions`` of another shape.
    """

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3NextModel(config)
        self.attach_lm_head(config.hidden_size, config.vocab_size, self.model.embed_tokens, config.tie_word_embeddings)
        self.mtp = Qwen3NextMTP(config) if config.mtp_num_hidden_layers else None
        """The released checkpoints' multi-token-prediction module (``mtp.*``); loaded and kept,
        not run by ``forward`` (speculative decoding will call it)."""

    def init_random(self, seed: int) -> None:
        """Deterministic random weights, initialised as transformers initialises Qwen3-Next:
        normal(0, initializer_range) for every projection, expert, router, conv and embedding
        matrix, zero biases, zeros for the zero-centred norms (an identity scale), ones for the
        gated norm and ``dt_bias``, and ``A_log = log(U(0.01, 16))``."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range

        def normal(p: Tensor) -> None:
            p.copy_(torch.randn(p.shape, generator=gen) * std)

        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, ZeroCentredRMSNorm):
                    module.weight.zero_()
                elif isinstance(module, GatedRMSNorm):
                    module.weight.fill_(1.0)
                elif isinstance(module, nn.Linear | nn.Conv1d):
                    normal(module.weight)
                    if module.bias is not None:
                        module.bias.zero_()
                elif isinstance(module, nn.Embedding):
                    normal(module.weight)
                elif isinstance(module, Qwen3NextExperts):
                    for e in range(module.num_experts):  # the checkpoint layout's order
                        for view in module.expert(e).values():
                            normal(view)
                elif isinstance(module, Qwen3NextGatedDeltaNet):
                    module.dt_bias.fill_(1.0)
                    module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(0.01, 16.0, generator=gen).log())

    def linear_state_shapes(self) -> dict[int, StateShapes]:
        """Per linear layer: (conv state ``[C_conv, K − 1]``, recurrent state ``[H_v, D_k, D_v]``)."""
        shapes: dict[int, StateShapes] = {}
        for module in self.modules():
            if isinstance(module, Qwen3NextGatedDeltaNet):
                shapes[module.layer] = (module.conv_state_shape, module.recurrent_state_shape)
        return shapes

    @property
    def layout(self) -> ModelLayout:
        c = self.config
        # the modules' own KV heads: a tensor-parallel rank's shard keeps fewer than the config
        kv_heads = next((m.num_kv_heads for m in self.model.layers.modules() if isinstance(m, Qwen3NextAttention)), c.num_key_value_heads)
        return ModelLayout(
            model_type=c.model_type,
            revision=c.revision,
            vocab_size=c.vocab_size,
            layer_types=c.layer_types,
            num_kv_heads=kv_heads,
            kv_head_dim=c.head_dim,
            sliding_window=None,
            linear_state_shapes=self.linear_state_shapes(),
        )

    def new_dense_state(self) -> DenseState:
        return DenseState(self.linear_state_shapes(), self.lm_head.weight.device)

    def forward(self, input_ids: Tensor, positions: Tensor, state: SequenceState | PackedStates) -> Tensor:
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"expected input_ids [T] and positions [T], got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        return self.lm_head(self.model(input_ids, positions, state)).float()


def build(config: Qwen3NextConfig) -> Qwen3NextForCausalLM:
    """The loader's entry: a model of ``config`` whose weights come from a checkpoint or from
    :meth:`Qwen3NextForCausalLM.init_random`."""
    return Qwen3NextForCausalLM(config)
