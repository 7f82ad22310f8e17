"""Configuration of the ``deepseek_v4`` family: DeepSeek-V4 as released, and kvscope's attention stack.

Field names and meanings are transformers' ``DeepseekV4Config`` (``configuration_deepseek_v4.py``),
which cites the DeepSeek-V4 paper: §2.1 the mixture of experts (``moe`` layers routed by learned
top-k, ``hash_moe`` layers by the frozen ``tid2eid`` table), §2.2 manifold-constrained
hyper-connections (mHC, ``hc_mult`` residual streams), §2.3.1 compressed sparse attention, §2.3.2
heavily compressed attention. Two kvscope extensions keep the project's own attention-stack preset
(``deepseek_v4-tiny``) expressible: ``mlp_layer_types`` entry ``dense`` (one SwiGLU MLP of
``intermediate_size``) and ``hyper_connections: false`` (a plain pre-norm residual instead of mHC).
:func:`engine.model.deepseek_v4_config_io.config_from_dict` reads a ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass

DEEPSEEK_V4_LAYER_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
COMPRESSED_KINDS = ("compressed_sparse_attention", "heavily_compressed_attention")
MLP_KINDS = ("dense", "moe", "hash_moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
"""Router scoring functions: ``sqrt(softplus(logits))`` (V4's) and ``sigmoid(logits)``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepseekV4Config:
    """DeepSeek-V4; field names as in transformers' config.

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

    MLP per layer (``mlp_layer_types``; empty = every layer ``dense``): ``moe`` and
    ``hash_moe`` layers hold ``n_routed_experts`` SwiGLU experts of ``moe_intermediate_size``
    (gate and up clamped at ``swiglu_limit``), ``num_experts_per_tok`` of them per token with
    weights ``scoring_func(router logits)`` renormalised and scaled by ``routed_scaling_factor``,
    plus one shared expert of the same width. Residual: ``hc_mult`` streams mixed by mHC
    (Sinkhorn–Knopp for ``hc_sinkhorn_iters`` iterations, floor ``hc_eps``), or with
    ``hyper_connections: false`` a plain residual. ``num_nextn_predict_layers`` MTP modules
    are built and loaded (not run by ``generate``).

    Raises:
        ValueError: naming the field, on an unknown layer kind, a bad size, or a value kvscope
            does not implement (``hidden_act``, ``mlp_bias``, ``num_key_value_heads``,
            ``scoring_func``, ``n_shared_experts``, ``norm_topk_prob``).
    """

    model_type: str = "deepseek_v4"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    """Width of ``dense`` MLP layers (kvscope's); experts use ``moe_intermediate_size``."""
    num_hidden_layers: int = 3
    layer_types: tuple[str, ...] = DEEPSEEK_V4_LAYER_KINDS
    mlp_layer_types: tuple[str, ...] = ()
    """Per layer ``dense`` (kvscope), ``moe`` or ``hash_moe``; empty means every layer is dense."""
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
    moe_intermediate_size: int = 64
    n_routed_experts: int = 4
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    hyper_connections: bool = True
    """kvscope: false replaces mHC by a plain pre-norm residual (then ``hc_mult`` must be 1)."""
    hc_mult: int = 1
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    num_nextn_predict_layers: int = 0
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
            "hc_mult",
            "hc_sinkhorn_iters",
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
        self._check_mlp()
        if not self.hyper_connections and self.hc_mult != 1:
            raise ValueError(f"hc_mult = {self.hc_mult} needs hyper_connections (a plain residual has one stream)")
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers = {self.num_nextn_predict_layers} must not be negative")
        if self.num_key_value_heads != 1:
            raise ValueError(f"num_key_value_heads = {self.num_key_value_heads}: DeepSeek-V4 attention has one shared KV head")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act = {self.hidden_act!r}: only 'silu' is supported")
        if self.mlp_bias:
            raise ValueError("mlp_bias = true is not supported (V4's MLPs have no bias)")
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

    def _check_mlp(self) -> None:
        unknown = sorted(set(self.mlp_layer_types) - set(MLP_KINDS))
        if unknown:
            raise ValueError(f"mlp_layer_types entries {unknown}: expected one of {MLP_KINDS}")
        if self.mlp_layer_types and len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"mlp_layer_types has {len(self.mlp_layer_types)} entries but num_hidden_layers = {self.num_hidden_layers}"
            )
        if not self.has_experts:
            return
        for name in ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} = {getattr(self, name)} must be positive")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok = {self.num_experts_per_tok} exceeds n_routed_experts = {self.n_routed_experts}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func = {self.scoring_func!r} is not supported; supported: {', '.join(SCORING_FUNCS)}")
        if self.n_shared_experts != 1:
            raise ValueError(f"n_shared_experts = {self.n_shared_experts} is not supported (V4 has one shared expert)")
        if not self.norm_topk_prob:
            raise ValueError("norm_topk_prob = false is not supported (V4 always renormalises the chosen experts' weights)")

    @property
    def has_experts(self) -> bool:
        """Whether any layer is ``moe`` or ``hash_moe``."""
        return any(k != "dense" for k in self.mlp_layer_types)

    def mlp_kind(self, layer: int) -> str:
        """``dense``, ``moe`` or ``hash_moe`` for one layer."""
        return self.mlp_layer_types[layer] if self.mlp_layer_types else "dense"

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
