"""Qwen3-Next's sparse mixture-of-experts block: a softmax router choosing the top-k of E experts
(optionally renormalising their weights), SwiGLU experts, and a shared SwiGLU
expert scaled by ``sigmoid(shared_expert_gate(x))`` (the Qwen2-MoE / Qwen3-Next layout; names
and numerics as transformers' ``Qwen3NextSparseMoeBlock``).

Shapes: T tokens, C hidden size, E experts, k experts per token, I expert intermediate size.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor, nn

from engine.model import kernel_backend as kb
from engine.model.layers import SwiGLU
from engine.model.qwen3_next_config import Qwen3NextConfig


class Qwen3NextExperts(nn.Module):
    """E SwiGLU experts, packed in memory as transformers keeps them: ``gate_up_proj [E, 2I, C]``
    (each expert's gate rows, then its up rows) and ``down_proj [E, C, I]``, so one kernel can
    address every expert (:func:`kernels.fused_moe.fused_moe`). Checkpoints keep the Qwen3-Next
    layout, ``experts.{e}.{gate_proj,up_proj}.weight [I, C]`` and ``experts.{e}.down_proj.weight
    [C, I]``: ``state_dict`` (whose entries are slices of the packed tensors, also with
    ``keep_vars``) and ``load_state_dict`` (``assign=True`` included) convert, as transformers
    does on save and load.

    forward: ``x [T, C]``, ``expert_ids [T, k]`` (distinct per token), ``weights [T, k]`` →
    ``Σ_j weights[t, j] · expert_{ids[t, j]}(x_t)`` as ``[T, C]``, accumulated in ascending expert
    order (as transformers does, so float sums round the same way). The (token, slot) pairs are
    grouped by expert with one stable sort, and each used expert runs its gate and up
    projections as one matmul over its tokens (transformers' ``gate_up_proj`` layout). The
    group sizes are read back to the host: a CUDA graph cannot capture this path.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def expert(self, e: int) -> dict[str, Tensor]:
        """Expert ``e``'s checkpoint tensors as views of the packed parameters."""
        i = self.intermediate_size
        return dict(zip(_CHECKPOINT_NAMES, (self.gate_up_proj[e, :i], self.gate_up_proj[e, i:], self.down_proj[e]), strict=True))

    def forward(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, slot_weights = order // k, weights.reshape(-1)[order]
        i = self.intermediate_size
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            idx = tokens[start : start + n]
            gate_up = nn.functional.linear(x[idx], self.gate_up_proj[expert])  # one matmul: [n, 2I]
            y = nn.functional.linear(nn.functional.silu(gate_up[:, :i]) * gate_up[:, i:], self.down_proj[expert])
            out.index_add_(0, idx, (y * slot_weights[start : start + n, None]).to(out.dtype))
            start += n
        return out

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        for e in range(self.num_experts):
            for name, t in self.expert(e).items():
                destination[f"{prefix}{e}.{name}.weight"] = t if keep_vars else t.detach()

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], strict: bool,
        missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
    ) -> None:  # fmt: skip
        for hook in self._load_state_dict_pre_hooks.values():  # as nn.Module's own loader does
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        found: dict[tuple[int, str], Tensor] = {}  # (expert, name) -> the checkpoint's tensor
        for e in range(self.num_experts):
            for name, view in self.expert(e).items():
                key = f"{prefix}{e}.{name}.weight"
                if key not in state_dict:
                    missing_keys.append(key)
                elif tuple(state_dict[key].shape) != tuple(view.shape):
                    error_msgs.append(f"size mismatch for {key}: {tuple(state_dict[key].shape)} in the checkpoint, {tuple(view.shape)} here")
                else:
                    found[(e, name)] = state_dict[key]
        if strict:
            mine = {f"{prefix}{e}.{name}.weight" for e, name in itertools.product(range(self.num_experts), _CHECKPOINT_NAMES)}
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in mine)
        assign = local_metadata.get("assign_to_params_buffers", False)  # load_state_dict(assign=True)
        if assign and len(found) == len(_CHECKPOINT_NAMES) * self.num_experts:  # new packed tensors, the checkpoint's dtype
            gate_up = torch.stack([torch.cat((found[(e, "gate_proj")], found[(e, "up_proj")])) for e in range(self.num_experts)])
            down = torch.stack([found[(e, "down_proj")] for e in range(self.num_experts)])
            self.gate_up_proj = nn.Parameter(gate_up, requires_grad=self.gate_up_proj.requires_grad)
            self.down_proj = nn.Parameter(down, requires_grad=self.down_proj.requires_grad)
        elif assign and (self.gate_up_proj.is_meta or self.down_proj.is_meta):  # nowhere to keep the others
            error_msgs.append(f"{prefix or 'experts'}: assign=True needs every expert's gate_proj, up_proj and down_proj to build the packed tensors")
        else:  # copied into the packed tensors; experts not in the checkpoint keep their values
            with torch.no_grad():
                for (e, name), tensor in found.items():
                    self.expert(e)[name].copy_(tensor)


_CHECKPOINT_NAMES = ("gate_proj", "up_proj", "down_proj")
"""Each expert's tensors in a checkpoint (``experts.{e}.{name}.weight``)."""


class Qwen3NextSparseMoe(nn.Module):
    """The MoE block of a sparse layer. Parameters: ``gate.weight [E, C]`` (the router),
    ``experts.{e}.{gate,up,down}_proj``, ``shared_expert.{gate,up,down}_proj`` and
    ``shared_expert_gate.weight [1, C]``.

    forward: ``x [T, C]`` → ``[T, C]``: router probabilities ``softmax(x Wᵀ)`` in float32, the
    top-k of them (divided by their sum when ``norm_topk_prob``), the weighted experts, plus the
    shared expert gated by a sigmoid. With the Triton backend the routed experts run in
    :func:`kernels.fused_moe.fused_moe` (fixed shapes: a CUDA graph can capture it).
    """

    kernel_backend: kb.KernelBackend = "torch"

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
        if self.kernel_backend == "triton":
            routed = kb.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, top_ids, top_weights.to(x.dtype))
        else:
            routed = self.experts(x, top_ids, top_weights.to(x.dtype))
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * shared
