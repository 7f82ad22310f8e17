"""Qwen3-Next's sparse mixture-of-experts block: a softmax router choosing the top-k of E experts
(optionally renormalising their weights), SwiGLU experts, and a shared SwiGLU
expert scaled by ``sigmoid(shared_expert_gate(x))`` (the Qwen2-MoE / Qwen3-Next layout; names
and numerics as transformers' ``Qwen3NextSparseMoeBlock``).

Shapes: T tokens, C hidden size, E experts, k experts per token, I expert intermediate size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.model.layers import SwiGLU
from engine.model.qwen3_next_config import Qwen3NextConfig


class Qwen3NextExperts(nn.ModuleList):
    """E SwiGLU experts, ``experts.{e}.{gate_proj,up_proj}.weight [I, C]`` and
    ``experts.{e}.down_proj.weight [C, I]``: the layout of Qwen3-Next checkpoints and of what
    transformers' ``save_pretrained`` writes (transformers packs them into ``gate_up_proj`` /
    ``down_proj`` tensors in memory only, converting on load and save).

    forward: ``x [T, C]``, ``expert_ids [T, k]`` (distinct per token), ``weights [T, k]`` →
    ``Σ_j weights[t, j] · expert_{ids[t, j]}(x_t)`` as ``[T, C]``, accumulated in ascending expert
    order (as transformers does, so float sums round the same way).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(SwiGLU(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for expert in torch.unique(expert_ids).tolist():
            tokens, slots = torch.where(expert_ids == expert)
            y = self[expert](x[tokens]) * weights[tokens, slots, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class Qwen3NextSparseMoe(nn.Module):
    """The MoE block of a sparse layer. Parameters: ``gate.weight [E, C]`` (the router),
    ``experts.{e}.{gate,up,down}_proj``, ``shared_expert.{gate,up,down}_proj`` and
    ``shared_expert_gate.weight [1, C]``.

    forward: ``x [T, C]`` → ``[T, C]``: router probabilities ``softmax(x Wᵀ)`` in float32, the
    top-k of them (divided by their sum when ``norm_topk_prob``), the weighted experts, plus the
    shared expert gated by a sigmoid.
    """

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        c = config.hidden_size
        self.gate = nn.Linear(c, config.num_experts, bias=False)
        self.experts = Qwen3NextExperts(config.num_experts, c, config.moe_intermediate_size)
        self.shared_expert = SwiGLU(c, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(c, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        shared = self.shared_expert(x)
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top_weights, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        routed = self.experts(x, top_ids, top_weights.to(x.dtype))
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * shared
