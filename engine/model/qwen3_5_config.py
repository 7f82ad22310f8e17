"""Qwen3.5 (Qwen team, 2026) as transformers 5.x implements it: the text decoders
``Qwen3_5ForCausalLM`` (``qwen3_5_text``, dense MLPs) and ``Qwen3_5MoeForCausalLM``
(``qwen3_5_moe_text``, a sparse MoE block with a shared expert in every layer), and the released
vision-language layout (``qwen3_5`` / ``qwen3_5_moe``: the text decoder's config under
``text_config``, its tensors under ``model.language_model.``, a vision tower under
``model.visual.`` this engine does not run).

The text decoder is Qwen3-Next's (:class:`~engine.model.qwen3_next_config.Qwen3NextConfig` with
its ``model_type``): the same gated attention, zero-centred norms and Gated DeltaNet, whose input
projections are split (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). Its
M-RoPE (``mrope_section``) rotates a text token's three position streams by the same position, so
for text it is Qwen3-Next's partial RoPE. Defaults are transformers' ``Qwen3_5TextConfig`` /
``Qwen3_5MoeTextConfig`` ones; the fields those classes delete are refused by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engine.model.config_fields import HF_BOOKKEEPING_KEYS
from engine.model.qwen3_next_config import Qwen3NextConfig
from engine.model.qwen3_next_config import config_from_dict as qwen3_next_config_from_dict

TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
"""Vision-language ``model_type`` → the text decoder's."""

DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "qwen3_5_text": {
        "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
        "num_key_value_heads": 4,
    },
    "qwen3_5_moe_text": {
        "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_experts_per_tok": 8,
        "num_experts": 256,
    },
}  # fmt: skip
"""Where transformers' Qwen3.5 defaults differ from Qwen3-Next's (for keys a config leaves out)."""

REMOVED: Mapping[str, tuple[str, ...]] = {
    "qwen3_5_text": (
        "decoder_sparse_step", "norm_topk_prob", "mlp_only_layers", "moe_intermediate_size",
        "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts",
    ),
    "qwen3_5_moe_text": ("intermediate_size", "decoder_sparse_step", "norm_topk_prob", "mlp_only_layers"),
}  # fmt: skip
"""Qwen3-Next fields the Qwen3.5 config classes delete (the architecture fixes them)."""

FIXED: Mapping[str, Mapping[str, Any]] = {
    "qwen3_5_text": {"num_experts": 0},  # a dense MLP in every layer
    "qwen3_5_moe_text": {"decoder_sparse_step": 1, "mlp_only_layers": (), "norm_topk_prob": True},
}
"""What the removed fields amount to."""

RELEASED_FIXED: Mapping[str, Any] = {"attn_output_gate": True, "output_gate_type": "swish", "mamba_ssm_dtype": "float32"}
"""Keys released Qwen3.5 configs carry that describe this decoder as it is (the attention output
gate, the gated norm's activation, float32 recurrent state); another value is refused."""

VISION_KEYS = frozenset(
    {"vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"}
)
"""Top-level keys of the vision-language config that only the vision tower reads."""


def config_from_dict(raw: Mapping[str, Any]) -> Qwen3NextConfig:
    """A :class:`Qwen3NextConfig` for a Qwen3.5 ``config.json`` (text decoder or the released
    vision-language layout).

    Raises:
        ValueError: naming the key: an unknown ``model_type``, a missing or malformed
            ``text_config``, a field Qwen3.5 does not have, anything
            :func:`engine.model.qwen3_next_config.config_from_dict` refuses.
    """
    data = dict(raw)
    model_type = str(data.get("model_type"))
    if model_type in TEXT_TYPES:
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"text_config must be an object (model_type {model_type!r} keeps the text decoder there)")
        allowed = VISION_KEYS | HF_BOOKKEEPING_KEYS | {"text_config", "model_type", "tie_word_embeddings", "revision", "language_model_only"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r} for the {model_type} vision-language config")
        outer: dict[str, Any] = {k: data[k] for k in ("tie_word_embeddings", "revision") if k in data}
        data = {**text, **outer, "model_type": text.get("model_type", TEXT_TYPES[model_type])}
        model_type = str(data["model_type"])
    if model_type not in DEFAULTS:
        raise ValueError(f"model_type {model_type!r} is not a Qwen3.5 decoder ({', '.join([*DEFAULTS, *TEXT_TYPES])})")
    for key, value in RELEASED_FIXED.items():  # what released configs state that this decoder always is
        if key in data and data.pop(key) != value:
            raise ValueError(f"{key} = {raw.get(key, (raw.get('text_config') or {}).get(key))!r} is not supported (only {value!r})")
    for key in REMOVED[model_type]:
        if key in data:
            raise ValueError(f"{key} is not a {model_type} field (Qwen3.5 fixes it: {FIXED[model_type]})")
    data = {**DEFAULTS[model_type], **data}
    rope = data.get("rope_parameters")
    if isinstance(rope, dict):  # M-RoPE: for text, every section rotates by the same position
        data["rope_parameters"] = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
    config = qwen3_next_config_from_dict(data, model_type=model_type)
    return dataclasses.replace(config, **FIXED[model_type])


def checkpoint_name(name: str) -> str | None:
    """The engine's name for a tensor of a Qwen3.5 checkpoint, None for one it does not load
    (the vision tower): ``model.language_model.X`` → ``model.X``."""
    if name.startswith("model.visual."):
        return None
    return "model." + name.removeprefix("model.language_model.") if name.startswith("model.language_model.") else name
