"""Reading and writing the ``config.json`` of a ``deepseek_v4`` model.

Reads what transformers' ``DeepseekV4Config.save_pretrained`` writes, the legacy keys it folds in
(``compress_ratios``, ``compress_rate_csa`` / ``compress_rate_hca``, ``num_hash_layers``,
``qk_rope_head_dim``), and kvscope's own presets. Every other key is a field of
:class:`~engine.model.deepseek_v4_config.DeepseekV4Config` or refused by name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from engine.model.config_fields import config_fields_from_dict
from engine.model.deepseek_v4_config import COMPRESSED_KINDS, DeepseekV4Config

_IGNORED_KEYS = frozenset(
    {
        # generation / training settings that do not change the forward pass
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "router_aux_loss_coef",
        "router_jitter_noise",
        "attention_dropout",
        "max_position_embeddings",
        # unused by V4's attention (its projections have no bias)
        "attention_bias",
    }
)
"""config.json keys accepted and ignored: they do not change the logits of a forward pass."""

_LEGACY_RATIO_KINDS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
"""``compress_ratios`` entries (per layer) as transformers reads them."""

DEFAULT_HASH_LAYERS = 3
"""transformers' default: without ``mlp_layer_types``, the first 3 layers are ``hash_moe``."""


def config_from_dict(raw: Mapping[str, Any]) -> DeepseekV4Config:
    """A :class:`DeepseekV4Config` from a ``config.json`` mapping as transformers'
    ``DeepseekV4Config.save_pretrained`` writes it (or a kvscope preset's fields).

    ``compress_rates`` (``{"compressed_sparse_attention": m, "heavily_compressed_attention":
    m'}``) sets ``compress_rate_csa`` / ``compress_rate_hca``; ``rope_parameters`` and
    ``qk_rope_head_dim`` must agree with ``rope_theta``, ``compress_rope_theta`` and
    ``partial_rotary_factor`` (plain RoPE only; YaRN is refused). Without ``mlp_layer_types``,
    a config with routed experts (``n_routed_experts``, as every released one has) follows
    transformers — ``num_hash_layers`` (default 3) ``hash_moe`` layers, then ``moe`` — and one
    without is kvscope's all-``dense`` stack.

    Raises:
        ValueError: an unknown key, a value of the wrong type, an inconsistent derived key, or
            an unsupported feature — each naming the field.
    """
    data = {k: v for k, v in raw.items() if k not in _IGNORED_KEYS}
    if data.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ValueError(f"model_type {data.get('model_type')!r} is not deepseek_v4")
    _fold_compress_rates(data)
    ratios = data.pop("compress_ratios", None)
    if ratios is not None and "layer_types" not in data:
        if not isinstance(ratios, list) or any(r not in _LEGACY_RATIO_KINDS for r in ratios):
            raise ValueError(f"compress_ratios must list 0, 4 or 128 per layer, got {ratios!r:.80}")
        data["layer_types"] = [_LEGACY_RATIO_KINDS[r] for r in ratios]
        for ratio in set(ratios) - {0}:  # the ratios themselves, as transformers reads them
            data.setdefault("compress_rate_csa" if ratio == 4 else "compress_rate_hca", ratio)
    num_hash = data.pop("num_hash_layers", None)
    if num_hash is not None and (isinstance(num_hash, bool) or not isinstance(num_hash, int) or num_hash < 0):
        raise ValueError(f"num_hash_layers must be a non-negative integer, got {num_hash!r:.60}")
    rope_parameters = data.pop("rope_parameters", None)
    rope_head_dim = data.pop("qk_rope_head_dim", None)
    if "layer_types" in data and "num_hidden_layers" not in data and isinstance(data["layer_types"], list | tuple):
        data["num_hidden_layers"] = len(data["layer_types"])
    if "num_hidden_layers" in data and "layer_types" not in data:
        raise ValueError("num_hidden_layers without layer_types: give layer_types (or compress_ratios) explicitly")
    if "mlp_layer_types" not in data and ("n_routed_experts" in data or num_hash is not None):
        n = data.get("num_hidden_layers", len(DeepseekV4Config().layer_types))
        n_hash = DEFAULT_HASH_LAYERS if num_hash is None else num_hash
        data["mlp_layer_types"] = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    if rope_head_dim is not None and "partial_rotary_factor" not in data and isinstance(data.get("head_dim"), int):
        data["partial_rotary_factor"] = rope_head_dim / data["head_dim"]
    config = DeepseekV4Config(**config_fields_from_dict(DeepseekV4Config, data))
    if rope_head_dim is not None and rope_head_dim != config.rope_head_dim:
        raise ValueError(
            f"qk_rope_head_dim = {rope_head_dim} disagrees with head_dim·partial_rotary_factor = {config.rope_head_dim}"
        )
    if rope_parameters is not None:
        _check_rope_parameters(rope_parameters, config)
    return config


def _fold_compress_rates(data: dict[str, Any]) -> None:
    """``compress_rates`` → ``compress_rate_csa`` / ``compress_rate_hca`` (in place)."""
    rates = data.pop("compress_rates", None)
    if rates is None:
        return
    if not isinstance(rates, Mapping) or set(rates) - set(COMPRESSED_KINDS):
        raise ValueError(f"compress_rates must map {COMPRESSED_KINDS} to ratios, got {rates!r:.80}")
    if "compressed_sparse_attention" in rates:
        data.setdefault("compress_rate_csa", rates["compressed_sparse_attention"])
    if "heavily_compressed_attention" in rates:
        data.setdefault("compress_rate_hca", rates["heavily_compressed_attention"])


def _check_rope_parameters(rope_parameters: Any, config: DeepseekV4Config) -> None:
    """``rope_parameters`` as transformers nests it (``{"main": {...}, "compress": {...}}``) must
    describe plain RoPE with this config's thetas and rotary fraction."""
    if not isinstance(rope_parameters, Mapping):
        raise ValueError(f"rope_parameters must be an object, got {rope_parameters!r:.80}")
    nested = {k: v for k, v in rope_parameters.items() if isinstance(v, Mapping)}
    if set(nested) != {"main", "compress"}:
        nested = {"main": rope_parameters, "compress": rope_parameters}
    for label, theta in (("main", config.rope_theta), ("compress", config.compress_rope_theta)):
        params = nested[label]
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_parameters.{label}.rope_type = {rope_type!r}: only plain ('default') RoPE is supported")
        if "rope_theta" in params and not math.isclose(float(params["rope_theta"]), theta):
            raise ValueError(f"rope_parameters.{label}.rope_theta = {params['rope_theta']} disagrees with {theta}")
        factor = params.get("partial_rotary_factor")
        if factor is not None and not math.isclose(float(factor), config.partial_rotary_factor):
            raise ValueError(
                f"rope_parameters.{label}.partial_rotary_factor = {factor} disagrees with {config.partial_rotary_factor}"
            )


def config_to_dict(config: DeepseekV4Config) -> dict[str, Any]:
    """A ``config.json`` mapping that :func:`config_from_dict` reads back to ``config``."""
    out = dataclasses.asdict(config)
    out["layer_types"] = list(config.layer_types)
    out["mlp_layer_types"] = list(config.mlp_layer_types) or ["dense"] * config.num_hidden_layers
    return out
