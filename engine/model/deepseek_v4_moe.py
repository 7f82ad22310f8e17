"""DeepSeek-V4's MLPs: the clamped SwiGLU, and the mixture of experts with learned or hash routing.

Per token x ``[C]`` of a ``moe`` / ``hash_moe`` layer (DeepSeek-V4 paper §2.1, as transformers'
``DeepseekV4SparseMoeBlock`` computes it):

    s = score(x · W_gateᵀ)                           [E]   score = sqrt∘softplus or sigmoid
    chosen = top-k(s + b)  (moe: b = ``e_score_correction_bias``)
           | tid2eid[token id]  (hash_moe: a frozen token → experts table)
    w_i = s_i / Σ_chosen s · routed_scaling_factor   (i ∈ chosen)
    y = Σ_chosen w_i · expert_i(x) + shared_expert(x)

Each expert and the shared expert is ``down(silu(min(gate(x), l)) · clamp(up(x), −l, l))`` with
l = ``swiglu_limit``. Experts are kept one module each (``experts.<i>.gate_proj`` / ``up_proj`` /
``down_proj``), as released checkpoints store them (``ffn.experts.<i>.w1`` / ``w3`` / ``w2``), so
each weight (and an FP8 weight's block scales) loads by name.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.model.deepseek_v4_config import DeepseekV4Config


class DeepseekV4MLP(nn.Module):
    """``down(silu(min(gate(x), l)) · clamp(up(x), −l, l))`` with l = ``swiglu_limit``;
    ``x [T, C]`` → ``[T, C]`` (transformers' ``DeepseekV4MLP``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(nn.functional.silu(gate) * up)


def _score(logits: Tensor, scoring_func: str) -> Tensor:
    if scoring_func == "sqrtsoftplus":
        return nn.functional.softplus(logits).sqrt()
    return torch.sigmoid(logits)


class Router(nn.Module):
    """Chooses ``num_experts_per_tok`` experts per token and their weights.

    Parameters: ``weight [E, C]``; buffers: ``e_score_correction_bias [E]`` (float32; learned
    top-k) or ``tid2eid [vocab, k]`` (int64; hash routing).
    """

    def __init__(self, config: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        self.hashed = hashed
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.scoring_func = config.scoring_func
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.tid2eid: Tensor
        self.e_score_correction_bias: Tensor
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: Tensor, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``x [T, C]``, ``input_ids [T]`` → ``(experts [T, k] int64, weights [T, k])`` (the
        weights in the scores' dtype)."""
        scores = _score(nn.functional.linear(x, self.weight), self.scoring_func)
        if self.hashed:
            chosen = self.tid2eid[input_ids].long()
        else:
            chosen = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * self.scaling


class SparseMoE(nn.Module):
    """A ``moe`` or ``hash_moe`` layer: ``gate`` (the router), ``experts.<i>``,
    ``shared_experts``; forward ``x [T, C]``, ``input_ids [T]`` → ``[T, C]``.

    Experts run on the tokens routed to them (a loop over the experts any token chose)."""

    def __init__(self, config: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.gate = Router(config, hashed=config.mlp_kind(layer) == "hash_moe")
        width, limit = config.moe_intermediate_size, config.swiglu_limit
        self.experts: nn.ModuleList = nn.ModuleList(DeepseekV4MLP(config.hidden_size, width, limit) for _ in range(config.n_routed_experts))
        self.shared_experts: DeepseekV4MLP = DeepseekV4MLP(config.hidden_size, width, limit)

    def forward(self, x: Tensor, input_ids: Tensor) -> Tensor:
        chosen, weights = self.gate(x, input_ids)
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == expert)
            routed = self.experts[expert](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, routed.to(out.dtype))
        return out + self.shared_experts(x)
