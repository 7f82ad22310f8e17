"""Named models: tiny random-weight configs of every family, and trained checkpoints shipped with
kvscope (``engine/weights/<name>/``, each with a MODEL_CARD.md; trained by ``python -m
engine.train`` from ``engine/train_configs/<name>.json``). ``engine.LLM(model=NAME)`` accepts
these names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


@dataclass(frozen=True, slots=True, kw_only=True)
class Preset:
    """A random-weight config (``model_type`` plus the fields that differ from the family's
    defaults) or a checkpoint directory."""

    model_type: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    directory: Path | None = None


_DEEPSEEK_V4_TINY_ATTENTION: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 6,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] * 2,
    "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 32, "partial_rotary_factor": 0.5,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 16, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 4,
}  # fmt: skip
"""The attention geometry both DeepSeek-V4 presets share."""

_QWEN3_5_TINY: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "revision": "random-init-0",
}  # fmt: skip
"""What the Qwen3.5 tiny presets share (the decoder of Qwen3.5's 3:1 linear:full pattern)."""
_QWEN3_5_MOE_TINY: dict[str, Any] = {
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
}  # fmt: skip

PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        "kvscope_hybrid-small": Preset(model_type="kvscope_hybrid", directory=WEIGHTS_DIR / "kvscope_hybrid-small"),
        "qwen3_next-small": Preset(model_type="qwen3_next", directory=WEIGHTS_DIR / "qwen3_next-small"),
        "qwen3_next-hd64": Preset(model_type="qwen3_next", directory=WEIGHTS_DIR / "qwen3_next-hd64"),
        "kvscope_hybrid-tiny": Preset(model_type="kvscope_hybrid"),
        "qwen3_next-tiny": Preset(
            model_type="qwen3_next",
            fields={
                "vocab_size": 256,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 6,
                "layer_types": [
                    "linear_attention",
                    "linear_attention",
                    "full_attention",
                    "linear_attention",
                    "linear_attention",
                    "full_attention",
                ],
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 64,
                "shared_expert_intermediate_size": 64,
                "mlp_only_layers": [],
                "decoder_sparse_step": 1,
                "norm_topk_prob": True,
                "revision": "random-init-0",
            },
        ),
        "qwen3_5-tiny": Preset(model_type="qwen3_5_text", fields=_QWEN3_5_TINY | {"intermediate_size": 128}),
        "qwen3_5_moe-tiny": Preset(
            model_type="qwen3_5_moe_text",
            fields=_QWEN3_5_TINY | _QWEN3_5_MOE_TINY,
        ),
        "deepseek_v4-tiny": Preset(
            model_type="deepseek_v4",
            fields={
                **_DEEPSEEK_V4_TINY_ATTENTION,
                "intermediate_size": 128,
                "mlp_layer_types": ["dense"] * 6,
                "hyper_connections": False,
                "revision": "random-init-0",
            },
        ),
        "deepseek_v4_moe-tiny": Preset(
            model_type="deepseek_v4",
            fields={
                **_DEEPSEEK_V4_TINY_ATTENTION,
                "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
                "moe_intermediate_size": 64,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_shared_experts": 1,
                "scoring_func": "sqrtsoftplus",
                "routed_scaling_factor": 1.5,
                "hc_mult": 2,
                "hc_sinkhorn_iters": 20,
                "num_nextn_predict_layers": 1,
                "revision": "random-init-0",
            },
        ),
    }
)


def preset_names() -> list[str]:
    return sorted(PRESETS)


def check_model_ref(ref: str | Path) -> None:
    """Fail early (before anything is started) on a reference that names no preset and no
    directory.

    Raises:
        ValueError: naming the reference and the presets.
    """
    if str(ref) in PRESETS or Path(ref).is_dir():
        return
    raise ValueError(f"unknown model {str(ref)!r}: not a preset ({', '.join(preset_names())}) and not a model directory")
