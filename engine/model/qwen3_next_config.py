"""Configuration of the ``qwen3_next`` family: Qwen3-Next (Qwen team, 2025) as transformers
implements it (``Qwen3NextConfig``, transformers 5.x).

Field names and defaults are transformers' own, so a ``config.json`` written by
``save_pretrained`` maps onto :class:`Qwen3NextConfig` key for key, and a key left out means what
it means there (for example ``num_experts`` = 512). :func:`config_from_dict` is the loader's entry:
it ignores keys that carry no model information (:data:`IGNORED_KEYS`), reads the RoPE settings
from ``rope_parameters`` (or the legacy top-level ``rope_theta`` / ``partial_rotary_factor`` /
``rope_scaling``), derives ``layer_types`` from ``full_attention_interval`` when it is absent,
and refuses everything else it does not implement, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.model.config_fields import HF_BOOKKEEPING_KEYS, config_fields_from_dict

MODEL_TYPE = "qwen3_next"
MODEL_TYPES = (MODEL_TYPE, "qwen3_5_text", "qwen3_5_moe_text")
"""The text decoders this config describes: Qwen3-Next, and Qwen3.5 dense and MoE (the same
layers, Gated DeltaNet with one input projection per output; :mod:`engine.model.qwen3_5_config`)."""
LAYER_KINDS = ("linear_attention", "full_attention")
"""The layer kinds Qwen3-Next mixes (DESIGN.md §3 names)."""

DEFAULT_FULL_ATTENTION_INTERVAL = 4
"""transformers' default: every 4th layer (1-based) is full attention when ``layer_types`` is absent."""

DEFAULT_NUM_HIDDEN_LAYERS = 48
"""transformers' ``num_hidden_layers`` when the key is absent."""

IGNORED_KEYS = HF_BOOKKEEPING_KEYS | frozenset(
    {
        # training-only settings: no effect on the logits of an inference forward
        "attention_dropout",
        "output_router_logits",
        "router_aux_loss_coef",
        "use_cache",
        # special token ids: the tokenizer's business (pad_token_id only marks an embedding row
        # whose weights come from the checkpoint anyway)
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        # default RoPE does not depend on the trained context length
        "max_position_embeddings",
    }
)
"""``config.json`` keys that carry no information the forward pass needs."""

_SLIDING_WINDOW_KEYS = ("sliding_window", "max_window_layers")
"""Read by nothing unless ``use_sliding_window`` is true (which is refused)."""


def default_layer_types(num_layers: int, full_attention_interval: int = DEFAULT_FULL_ATTENTION_INTERVAL) -> tuple[str, ...]:
    """transformers' pattern when ``layer_types`` is absent: layer i is ``full_attention`` when
    ``(i + 1) % full_attention_interval == 0``, else ``linear_attention``."""
    return tuple(
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention" for i in range(num_layers)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Qwen3NextConfig:
    """A Qwen3-Next decoder: Gated DeltaNet (``linear_attention``) and gated softmax attention
    (``full_attention``) layers, each followed by a sparse MoE block with a shared expert or,
    where ``mlp_only_layers`` / ``decoder_sparse_step`` say so, a dense SwiGLU MLP.

    Attributes beyond transformers' names:
        rope_theta, partial_rotary_factor: transformers keeps them in ``rope_parameters``; the
            first ``rotary_dim = int(head_dim · partial_rotary_factor)`` dims of each query/key
            head are rotated, the rest pass through.
        layer_types: empty means transformers' default pattern for ``num_hidden_layers``
            (:func:`default_layer_types`); filled in at construction.
        revision: names the weights (part of every prefix hash).
        seed: the seed of :meth:`Qwen3NextForCausalLM.init_random` for random-weight presets.

    Raises:
        ValueError: naming the field, on a value the model cannot run (non-positive sizes, head
            counts that do not divide, an unknown layer kind, an activation other than SiLU, ...).
    """

    model_type: str = MODEL_TYPE
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = DEFAULT_NUM_HIDDEN_LAYERS
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: tuple[str, ...] = ()
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 512
    num_experts_per_tok: int = 10
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    """Decoder layers of the multi-token-prediction module released checkpoints carry (``mtp.*``;
    also read from ``num_nextn_predict_layers``); 0: none."""
    initializer_range: float = 0.02
    revision: str = "random-init-0"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type = {self.model_type!r}; this family is one of {MODEL_TYPES}")
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "decoder_sparse_step",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} = {value!r} must be a positive integer")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act = {self.hidden_act!r} is not supported (only 'silu')")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} = {getattr(self, name)!r} must be positive")
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
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor = {self.partial_rotary_factor} must be in (0, 1]")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor = {self.partial_rotary_factor} gives rotary_dim = {self.rotary_dim} "
                f"for head_dim = {self.head_dim}; it must be even and at least 2"
            )
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers = {self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_KINDS:
                raise ValueError(f"layer_types[{i}] = {kind!r} is not supported by qwen3_next; expected one of {LAYER_KINDS}")
        for i, layer in enumerate(self.mlp_only_layers):
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_hidden_layers:
                raise ValueError(f"mlp_only_layers[{i}] = {layer!r} is not a layer index in [0, {self.num_hidden_layers})")
        if isinstance(self.mtp_num_hidden_layers, bool) or self.mtp_num_hidden_layers < 0:
            raise ValueError(f"mtp_num_hidden_layers = {self.mtp_num_hidden_layers!r} must be an integer ≥ 0")
        if self.num_experts < 0:
            raise ValueError(f"num_experts = {self.num_experts} must be ≥ 0 (0: dense MLP in every layer)")
        if any(self.is_sparse_layer(i) for i in range(self.num_hidden_layers)):
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok = {self.num_experts_per_tok} must be in [1, num_experts = {self.num_experts}]"
                )
            for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"{name} = {getattr(self, name)} must be positive when MoE layers exist")

    # -- derived values ----------------------------------------------------------------------------
    @property
    def split_linear_projections(self) -> bool:
        """Qwen3.5's Gated DeltaNet projections (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
        ``in_proj_a``) instead of Qwen3-Next's head-grouped ``in_proj_qkvz`` / ``in_proj_ba``."""
        return self.model_type != MODEL_TYPE

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (transformers truncates with ``int``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` uses the sparse MoE block (transformers' rule: not listed in
        ``mlp_only_layers``, experts exist, and ``(layer + 1)`` is a multiple of
        ``decoder_sparse_step``); otherwise it uses the dense MLP of ``intermediate_size``."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers of one kind, in model order."""
        return tuple(i for i, k in enumerate(self.layer_types) if k == kind)


def config_from_dict(raw: Mapping[str, Any], model_type: str = MODEL_TYPE) -> Qwen3NextConfig:
    """A :class:`Qwen3NextConfig` from a ``config.json`` mapping as transformers'
    ``save_pretrained`` writes it (older layouts with top-level RoPE keys are accepted too).

    Raises:
        ValueError: naming the key: another ``model_type``, an unknown key, a value of the wrong
            type, or a feature this engine does not implement (RoPE scaling, sliding windows,
            quantization, an activation other than SiLU, ...).
    """
    data = dict(raw)
    if data.get("model_type", model_type) != model_type:
        raise ValueError(f"model_type {data.get('model_type')!r} is not {model_type}")
    for key in IGNORED_KEYS:
        data.pop(key, None)
    if "quantization_config" in data:
        raise ValueError("quantization_config: quantized checkpoints are not supported (float weights only)")
    if data.pop("use_sliding_window", False) not in (False, None):
        raise ValueError("use_sliding_window = true is not supported for qwen3_next")
    for key in _SLIDING_WINDOW_KEYS:
        data.pop(key, None)
    if data.pop("mtp_use_dedicated_embeddings", False) not in (False, None):
        raise ValueError("mtp_use_dedicated_embeddings = true is not supported (the MTP module shares the embedding)")
    if "num_nextn_predict_layers" in data:  # another name for the same count
        n = data.pop("num_nextn_predict_layers")
        if data.setdefault("mtp_num_hidden_layers", n) != n:
            raise ValueError(f"num_nextn_predict_layers = {n} disagrees with mtp_num_hidden_layers = {data['mtp_num_hidden_layers']}")
    rope = _rope_fields(data)
    interval = data.pop("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
    for key in ("layer_types", "mlp_only_layers"):  # transformers treats null as absent
        if key in data and data[key] is None:
            del data[key]
    fields: dict[str, Any] = config_fields_from_dict(Qwen3NextConfig, data)
    if "layer_types" not in fields:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
            raise ValueError(f"full_attention_interval = {interval!r} must be a positive integer")
        num_layers = fields.get("num_hidden_layers", DEFAULT_NUM_HIDDEN_LAYERS)
        if isinstance(num_layers, int) and num_layers > 0:
            fields["layer_types"] = default_layer_types(num_layers, interval)
    fields.update(rope)
    return Qwen3NextConfig(**fields)


def _rope_fields(data: dict[str, Any]) -> dict[str, float]:
    """Pop every RoPE key from ``data`` and return ``rope_theta`` / ``partial_rotary_factor``.

    Sources: ``rope_parameters`` (transformers 5), ``rope_scaling`` (older configs, null or the
    default type) and the top-level ``rope_theta`` / ``partial_rotary_factor``. Two sources that
    disagree are refused rather than silently ranked.
    """
    out: dict[str, float] = {}

    def put(source: str, key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{source} must be a number, got {value!r:.60}")
        if key in out and out[key] != float(value):
            raise ValueError(f"{source} = {value} disagrees with {key} = {out[key]} given elsewhere in the config")
        out[key] = float(value)

    for name in ("rope_parameters", "rope_scaling"):
        mapping = data.pop(name, None)
        if mapping is None:
            continue
        if not isinstance(mapping, dict):
            raise ValueError(f"{name} must be an object, got {mapping!r:.60}")
        for key, value in mapping.items():
            if key in ("rope_type", "type"):
                if value != "default":
                    raise ValueError(f"{name}.{key} = {value!r} is not supported (only the 'default' RoPE)")
            elif key in ("rope_theta", "partial_rotary_factor"):
                put(f"{name}.{key}", key, value)
            else:
                raise ValueError(f"{name}.{key} is not supported (only the 'default' RoPE without scaling)")
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in data:
            put(key, key, data.pop(key))
    return out
