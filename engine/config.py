"""Model configurations and the named presets.

A config names its layer kinds the way the transformers configs of the models they come from do
(``full_attention``, ``sliding_attention``, ``linear_attention``); DESIGN.md §3 lists them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

LAYER_KINDS = ("full_attention", "sliding_attention", "linear_attention")


@dataclass(frozen=True, slots=True, kw_only=True)
class HybridConfig:
    """The ``kvscope_hybrid`` research model: a decoder mixing layer kinds.

    Attention layers are GQA with rotary embeddings (RoPE, half-split convention as in Llama);
    ``sliding_attention`` layers attend to the last ``sliding_window`` tokens including the
    current one. ``linear_attention`` layers are Gated DeltaNet (short causal conv + gated
    delta-rule recurrence, as in Qwen3-Next).

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
        "full_attention",
        "linear_attention",
        "sliding_attention",
        "full_attention",
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

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers of one kind, in model order."""
        return tuple(i for i, k in enumerate(self.layer_types) if k == kind)


PRESETS: Mapping[str, HybridConfig] = MappingProxyType(
    {
        "kvscope_hybrid-tiny": HybridConfig(),
    }
)
"""Named presets; ``engine.LLM(model=NAME)`` accepts these names."""


def resolve_preset(name: str) -> HybridConfig:
    """The config of a named preset.

    Raises:
        ValueError: the name is not a preset (the message lists the presets).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}: not a preset ({', '.join(sorted(PRESETS))}) "
            "and not a model directory"
        ) from None
