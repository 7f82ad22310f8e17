"""Configuration of the ``deepseek_v4`` family: DeepSeek-V4's attention stack with a dense MLP.

The attention layers follow transformers' ``DeepseekV4`` (``configuration_deepseek_v4.py``) and
the DeepSeek-V4 paper it cites (§2.3.1 compressed sparse attention, §2.3.2 heavily compressed
attention). What kvscope does not implement — manifold-constrained hyper-connections (mHC,
paper §2.2, ``hc_mult > 1``) and the mixture-of-experts MLPs (paper §2.1, ``mlp_layer_types``
``hash_moe`` / ``moe``) — is refused by :func:`config_from_dict` with the field named; in their
place every layer has a plain pre-norm residual and a dense SwiGLU MLP (``mlp_layer_types``
entries ``dense``, width ``intermediate_size``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.model.config_fields import config_fields_from_dict

DEEPSEEK_V4_LAYER_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
COMPRESSED_KINDS = ("compressed_sparse_attention", "heavily_compressed_attention")

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
        # transformers never instantiates the multi-token-prediction layers either
        "num_nextn_predict_layers",
        # unused by transformers' V4 attention (its projections have no bias)
        "attention_bias",
    }
)
"""config.json keys accepted and ignored: they do not change the logits of a forward pass."""

_MOE_KEYS = (
    "moe_intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "scoring_func",
    "norm_topk_prob",
    "routed_scaling_factor",
    "hc_sinkhorn_iters",
    "hc_eps",
)
"""Keys of the MoE / mHC parts, accepted (transformers always writes them) but unused while
``mlp_layer_types`` is all ``dense`` and ``hc_mult`` is 1."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepseekV4Config:
    """DeepSeek-V4 attention stack + dense MLP; field names as in transformers' config.

    Attention (every kind): a low-rank query path (``hidden → q_lora_rank → heads·head_dim``),
    one shared key/value head (K = V, ``num_key_value_heads`` must be 1), partial interleaved
    RoPE on the last ``head_dim·partial_rotary_factor`` channels, a learned sink logit per head,
    a window of ``sliding_window`` tokens (the current one and W − 1 before it), and a grouped
    output projection (``o_groups`` groups, each to ``o_lora_rank``, then to ``hidden_size``).
    ``compressed_sparse_attention`` adds an overlapping compressor of ratio
    ``compress_rate_csa`` and an indexer (``index_n_heads`` heads of ``index_head_dim``)
    keeping the ``index_topk`` best entries per query; ``heavily_compressed_attention`` adds a
    compressor of ratio ``compress_rate_hca`` whose entries are all attended. Sliding layers
    rotate with ``rope_theta``, compressed layers with ``compress_rope_theta``.

    Raises:
        ValueError: naming the field, on an unknown layer kind, a bad size, or a part of V4 that
            kvscope does not implement (``hc_mult``, MoE ``mlp_layer_types``, ``hidden_act``,
            ``mlp_bias``, ``num_key_value_heads``).
    """

    model_type: str = "deepseek_v4"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 3
    layer_types: tuple[str, ...] = DEEPSEEK_V4_LAYER_KINDS
    mlp_layer_types: tuple[str, ...] = ()
    """Per layer ``dense`` (kvscope); empty means every layer is dense."""
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 32
    q_lora_rank: int = 32
    partial_rotary_factor: float = 0.5
    rope_theta: float = 10_000.0
    compress_rope_theta: float = 160_000.0
    compress_rate_csa: int = 4
    compress_rate_hca: int = 16
    sliding_window: int = 16
    o_groups: int = 2
    o_lora_rank: int = 16
    index_n_heads: int = 4
    index_head_dim: int = 16
    index_topk: int = 4
    hc_mult: int = 1
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    mlp_bias: bool = False
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    seed: int = 0
    revision: str = "random-init-0"

    def __post_init__(self) -> None:
        if self.model_type != "deepseek_v4":
            raise ValueError(f"model_type {self.model_type!r} is not deepseek_v4")
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "q_lora_rank",
            "compress_rate_csa",
            "compress_rate_hca",
            "sliding_window",
            "o_groups",
            "o_lora_rank",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} = {getattr(self, name)} must be positive")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers = {self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in DEEPSEEK_V4_LAYER_KINDS:
                raise ValueError(f"layer_types[{i}] = {kind!r}; expected one of {DEEPSEEK_V4_LAYER_KINDS}")
        unknown = sorted(set(self.mlp_layer_types) - {"dense", "moe", "hash_moe"})
        if unknown:
            raise ValueError(f"mlp_layer_types entries {unknown}: expected 'dense' ('moe' / 'hash_moe' are refused)")
        unsupported: list[str] = []
        moe = sorted({k for k in self.mlp_layer_types if k != "dense"})
        if moe:
            unsupported.append(f"mlp_layer_types {moe} (mixture-of-experts MLPs; only 'dense' is implemented)")
        elif self.mlp_layer_types and len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"mlp_layer_types has {len(self.mlp_layer_types)} entries but num_hidden_layers = {self.num_hidden_layers}"
            )
        if self.hc_mult != 1:
            unsupported.append(f"hc_mult = {self.hc_mult} (manifold-constrained hyper-connections; only 1 is implemented)")
        if unsupported:
            raise ValueError("unsupported DeepSeek-V4 config fields: " + "; ".join(unsupported))
        if self.num_key_value_heads != 1:
            raise ValueError(f"num_key_value_heads = {self.num_key_value_heads}: DeepSeek-V4 attention has one shared KV head")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act = {self.hidden_act!r}: only 'silu' is supported")
        if self.mlp_bias:
            raise ValueError("mlp_bias = true is not supported (the dense MLP has no bias)")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(
                f"o_groups = {self.o_groups} does not divide num_attention_heads·head_dim = {self.num_attention_heads * self.head_dim}"
            )
        rope = self.rope_head_dim
        if rope <= 0 or rope % 2 or rope > min(self.head_dim, self.index_head_dim):
            raise ValueError(
                f"partial_rotary_factor = {self.partial_rotary_factor} gives {rope} rotary channels; need an even "
                f"number in (0, min(head_dim, index_head_dim)]"
            )
        if self.sliding_window < 2:
            raise ValueError(f"sliding_window = {self.sliding_window} must be at least 2")

    @property
    def rope_head_dim(self) -> int:
        """Rotary channels at the end of each head (``qk_rope_head_dim`` in transformers)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def compress_rate(self, kind: str) -> int:
        """The compression ratio of a compressed layer kind."""
        return self.compress_rate_csa if kind == "compressed_sparse_attention" else self.compress_rate_hca

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers of one kind, in model order."""
        return tuple(i for i, k in enumerate(self.layer_types) if k == kind)


def config_from_dict(raw: Mapping[str, Any]) -> DeepseekV4Config:
    """A :class:`DeepseekV4Config` from a ``config.json`` mapping as transformers'
    ``DeepseekV4Config.save_pretrained`` writes it (or a kvscope preset's fields).

    ``compress_rates`` (``{"compressed_sparse_attention": m, "heavily_compressed_attention":
    m'}``) sets ``compress_rate_csa`` / ``compress_rate_hca``; ``rope_parameters`` and
    ``qk_rope_head_dim`` must agree with ``rope_theta``, ``compress_rope_theta`` and
    ``partial_rotary_factor`` (plain RoPE only; YaRN is refused).

    Raises:
        ValueError: an unknown key, a value of the wrong type, an inconsistent derived key, or
            an unsupported feature — each naming the field.
    """
    data = {k: v for k, v in raw.items() if k not in _IGNORED_KEYS and k not in _MOE_KEYS}
    if data.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ValueError(f"model_type {data.get('model_type')!r} is not deepseek_v4")
    rates = data.pop("compress_rates", None)
    if rates is not None:
        if not isinstance(rates, Mapping) or set(rates) - set(COMPRESSED_KINDS):
            raise ValueError(f"compress_rates must map {COMPRESSED_KINDS} to ratios, got {rates!r:.80}")
        if "compressed_sparse_attention" in rates:
            data.setdefault("compress_rate_csa", rates["compressed_sparse_attention"])
        if "heavily_compressed_attention" in rates:
            data.setdefault("compress_rate_hca", rates["heavily_compressed_attention"])
    rope_parameters = data.pop("rope_parameters", None)
    rope_head_dim = data.pop("qk_rope_head_dim", None)
    if "layer_types" in data and "num_hidden_layers" not in data and isinstance(data["layer_types"], list | tuple):
        data["num_hidden_layers"] = len(data["layer_types"])
    if "num_hidden_layers" in data and "layer_types" not in data:
        raise ValueError("num_hidden_layers without layer_types: give layer_types explicitly")
    config = DeepseekV4Config(**config_fields_from_dict(DeepseekV4Config, data))
    if rope_head_dim is not None and rope_head_dim != config.rope_head_dim:
        raise ValueError(
            f"qk_rope_head_dim = {rope_head_dim} disagrees with head_dim·partial_rotary_factor = {config.rope_head_dim}"
        )
    if rope_parameters is not None:
        _check_rope_parameters(rope_parameters, config)
    return config


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
