"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4.

The residual of every decoder layer is ``N = hc_mult`` parallel streams ``[T, N, C]`` instead of
one ``[T, C]`` (DeepSeek-V4 paper §2.2; Xie et al. 2026, "mHC"). Around each block (attention,
then MLP) the streams are weighed by three maps computed from the streams themselves:

    f = RMSNorm_unweighted(flatten(streams)) · fnᵀ               [T, 2N + N²]   (float32)
    pre  = sigmoid(f_pre  · s_pre  + b_pre)  + ε                  [T, N]
    post = 2 · sigmoid(f_post · s_post + b_post)                  [T, N]
    comb = SinkhornKnopp(softmax(f_comb · s_comb + b_comb) + ε)  [T, N, N]

    block input  = Σ_n pre[n] · streams[n]                        [T, C]
    new streams  = post ⊗ block(input) + combᵀ · streams          [T, N, C]

Sinkhorn–Knopp alternately normalises columns and rows (``hc_sinkhorn_iters`` passes, the first
a column pass) so the residual mix is doubly stochastic and signal norms cannot grow with depth.
After the last layer a head collapses the streams with its own ``pre`` weights (no Sinkhorn).
The weights and this arithmetic are float32 whatever the model's dtype, as in transformers'
``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` whose parameter names these keep.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.model.deepseek_v4_attention import unweighted_rms_norm


class HyperConnection(nn.Module):
    """The mHC maps around one block.

    Parameters (float32): ``fn [(2 + N)·N, N·C]``, ``base [(2 + N)·N]``, ``scale [3]``.
    """

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(width, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``streams [T, N, C]`` → ``(post [T, N], comb [T, N, N], block input [T, C])``; post and
        comb are float32, the block input has the streams' dtype."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = nn.functional.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: Tensor, block_out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """New streams ``[T, N, C]``: ``post ⊗ block_out + combᵀ · streams`` in the streams' dtype
        (``block_out [T, C]``; comb is applied transposed, summing over its first stream axis)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The final collapse of the streams: ``Σ_n (sigmoid(f · s + b) + ε)[n] · streams[n]``.

    Parameters (float32): ``hc_fn [N, N·C]``, ``hc_base [N]``, ``hc_scale [1]``.
    """

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: Tensor) -> Tensor:
        """``streams [T, N, C]`` → ``[T, C]`` in the streams' dtype."""
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = nn.functional.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
