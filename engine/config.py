"""Model configurations and the named presets.

A config names its layer kinds the way the transformers configs of the models they come from do
(``full_attention``, ``sliding_attention``, ``linear_attention``); DESIGN.md §3 lists them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.model.config_fields import config_fields_from_dict
from engine.model.deepseek_v4_config import COMPRESSED_KINDS, DeepseekV4Config

LAYER_KINDS = (
    "full_attention",
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "linear_attention",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class HybridConfig:
    """The ``kvscope_hybrid`` research model: a decoder mixing every layer kind, so one model
    exercises every cache form.

    ``full_attention`` / ``sliding_attention`` layers are GQA with rotary embeddings (RoPE,
    half-split convention as in Llama); sliding layers attend to the last ``sliding_window``
    tokens including the current one. ``compressed_sparse_attention`` /
    ``heavily_compressed_attention`` layers are DeepSeek-V4's (shared-KV MQA with a window of
    ``sliding_window``, sinks, a compressor of ratio ``compress_ratio_csa`` / ``_hca``, and for
    CSA an indexer keeping ``index_topk`` entries); their geometry is the ``compressed_*``,
    ``q_lora_rank``, ``o_*`` and ``index_*`` fields. ``linear_attention`` layers are Gated
    DeltaNet (short causal conv + gated delta-rule recurrence, as in Qwen3-Next).

    Raises:
        ValueError: on an unknown layer kind or an inconsistent head layout.
    """

    model_type: str = "kvscope_hybrid"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    layer_types: tuple[str, ...] = (
        "linear_attention",
        "sliding_attention",
        "compressed_sparse_attention",
        "full_attention",
        "linear_attention",
        "heavily_compressed_attention",
    )
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10_000.0
    sliding_window: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    compressed_head_dim: int = 32
    compressed_rotary_factor: float = 0.5
    compress_rope_theta: float = 160_000.0
    compress_ratio_csa: int = 4
    compress_ratio_hca: int = 16
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 16
    index_n_heads: int = 4
    index_head_dim: int = 16
    index_topk: int = 4
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    seed: int = 0
    revision: str = "random-init-0"

    def __post_init__(self) -> None:
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_KINDS:
                raise ValueError(f"layer_types[{i}] = {kind!r}; expected one of {LAYER_KINDS}")
        if not self.layer_types:
            raise ValueError("layer_types is empty")
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "sliding_window",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "compressed_head_dim",
            "compress_ratio_csa",
            "compress_ratio_hca",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} = {getattr(self, name)} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads = {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads = {self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads = {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads = {self.linear_num_key_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim = {self.head_dim} must be even for rotary embeddings")

        if any(k in COMPRESSED_KINDS for k in self.layer_types):
            self.deepseek_v4_config()  # validates the compressed layers' geometry now

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def deepseek_v4_config(self) -> DeepseekV4Config:
        """The V4 attention geometry of this model's CSA/HCA layers. V4 knows only its own three
        kinds, so the other layers appear as ``sliding_attention`` there (only CSA/HCA layers are
        built from it; the layer index stays the model's)."""
        return DeepseekV4Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            layer_types=tuple(k if k in COMPRESSED_KINDS else "sliding_attention" for k in self.layer_types),
            num_attention_heads=self.num_attention_heads,
            head_dim=self.compressed_head_dim,
            q_lora_rank=self.q_lora_rank,
            partial_rotary_factor=self.compressed_rotary_factor,
            rope_theta=self.rope_theta,
            compress_rope_theta=self.compress_rope_theta,
            compress_rate_csa=self.compress_ratio_csa,
            compress_rate_hca=self.compress_ratio_hca,
            sliding_window=self.sliding_window,
            o_groups=self.o_groups,
            o_lora_rank=self.o_lora_rank,
            index_n_heads=self.index_n_heads,
            index_head_dim=self.index_head_dim,
            index_topk=self.index_topk,
            rms_norm_eps=self.rms_norm_eps,
        )

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers of one kind, in model order."""
        return tuple(i for i, k in enumerate(self.layer_types) if k == kind)


def hybrid_config_from_dict(raw: Mapping[str, Any]) -> HybridConfig:
    """A :class:`HybridConfig` from a ``config.json`` mapping (``model_type`` must match)."""
    if raw.get("model_type", "kvscope_hybrid") != "kvscope_hybrid":
        raise ValueError(f"model_type {raw.get('model_type')!r} is not kvscope_hybrid")
    return HybridConfig(**config_fields_from_dict(HybridConfig, raw))


def hybrid_config_to_dict(config: HybridConfig) -> dict[str, Any]:
    out = dataclasses.asdict(config)
    out["layer_types"] = list(config.layer_types)
    return out
