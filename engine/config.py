"""Model configurations and the named presets.

A config names its layer kinds the way the transformers configs of the models they come from do
(``full_attention``, ``sliding_attention``, ``linear_attention``); DESIGN.md §3 lists them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


HF_BOOKKEEPING_KEYS = frozenset({"architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path"})
"""config.json keys written by tools that carry no model information."""


def config_fields_from_dict(cls: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of dataclass ``cls`` found in ``raw`` (a config.json mapping).

    Lists become tuples where the field is a tuple. Bookkeeping keys are ignored.

    Raises:
        ValueError: an unknown key, or a value of the wrong JSON type, naming the field.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in HF_BOOKKEEPING_KEYS:
            continue
        if key not in fields:
            raise ValueError(f"unknown field {key!r} for {cls.__name__}")
        default = fields[key].default
        if isinstance(default, tuple):
            if not isinstance(value, list | tuple):
                raise ValueError(f"field {key!r} must be a list, got {value!r:.60}")
            value = tuple(value)
        elif isinstance(default, bool) and not isinstance(value, bool):
            raise ValueError(f"field {key!r} must be true or false, got {value!r:.60}")
        elif isinstance(default, int) and not isinstance(default, bool) and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"field {key!r} must be an integer, got {value!r:.60}")
        elif isinstance(default, float) and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"field {key!r} must be a number, got {value!r:.60}")
        elif isinstance(default, str) and not isinstance(value, str):
            raise ValueError(f"field {key!r} must be a string, got {value!r:.60}")
        out[key] = float(value) if isinstance(default, float) else value
    return out


def hybrid_config_from_dict(raw: Mapping[str, Any]) -> HybridConfig:
    """A :class:`HybridConfig` from a ``config.json`` mapping (``model_type`` must match)."""
    if raw.get("model_type", "kvscope_hybrid") != "kvscope_hybrid":
        raise ValueError(f"model_type {raw.get('model_type')!r} is not kvscope_hybrid")
    return HybridConfig(**config_fields_from_dict(HybridConfig, raw))


def hybrid_config_to_dict(config: HybridConfig) -> dict[str, Any]:
    out = dataclasses.asdict(config)
    out["layer_types"] = list(config.layer_types)
    return out
