"""DeepSeek-V4's KV compressors and the lightning indexer, plus its interleaved partial RoPE.

A compressor turns every group of r consecutive tokens into one compressed KV entry
(DeepSeek-V4 paper §2.3.1 eqs. 9–12 and §2.3.2 eqs. 20–23, as transformers'
``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` / ``DeepseekV4Indexer`` compute them):

    C = H·W_kv,  Z = H·W_z                      projected rows and gate logits  [T, F]
    entry_w = RMSNorm( Σ_j softmax_j(Z_j + B_j) ⊙ C_j )     softmax per channel over the group
    entry_w ← RoPE(entry_w, position w·r)        (trailing rotary channels, compress θ)

with a learned positional bias B ``[r, F]``. *Overlapping* compressors (CSA, ratio 4) project
to ``F = 2·D``: the second half of a row feeds its own group's entry, the first half the next
group's, so entry w pools ``2r`` rows — group w − 1's first halves and group w's second halves
(entry 0 has no previous group: those slots get weight 0). *Non-overlapping* compressors (HCA)
project to ``F = D``.

Rows of a group that is not complete yet wait in the state (``pending_kv`` / ``pending_gate``);
an overlapping compressor also keeps the first halves of the last complete group
(``prev_kv`` / ``prev_gate``). Every tensor here is one sequence: T tokens, D channels.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.model import kernel_backend as kb
from engine.model.deepseek_v4_config import DeepseekV4Config
from engine.model.layers import RMSNorm
from engine.model.state import CompressorSpec, CompressorState


def rope_cos_sin(positions: Tensor, rope_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin ``[T, rope_dim / 2]`` (one angle per channel pair) for ``positions [T]``.

    Angle of pair i at position p: ``p · θ^(−2i / rope_dim)`` (RoFormer, Su et al. 2021).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device) / rope_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the trailing ``2·cos.shape[-1]`` channels of ``x [T, ..., D]`` pair by pair
    (interleaved pairs ``(2i, 2i+1)``, as DeepSeek-V4 lays heads out as ``[nope | rope]``);
    the leading channels pass unchanged. ``cos``/``sin`` are ``[T, rope_dim / 2]``; pass
    ``-sin`` for the inverse rotation."""
    rope_dim = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim,)
    cos_full = cos.repeat_interleave(2, dim=-1).view(shape)
    sin_full = sin.repeat_interleave(2, dim=-1).view(shape)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = rope.float().unflatten(-1, (-1, 2))
    swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos_full + swapped * sin_full).to(x.dtype)
    return torch.cat((nope, rotated), dim=-1)


class Compressor(nn.Module):
    """Gated pooling of groups of ``ratio`` projected rows into compressed entries.

    Parameters (transformers' names): ``kv_proj [F, C]``, ``gate_proj [F, C]``,
    ``position_bias [r, F]`` (float32), ``kv_norm.weight [D]``.
    """

    def __init__(self, hidden_size: int, spec: CompressorSpec, rope_dim: int, rope_theta: float, eps: float) -> None:
        super().__init__()
        self.spec = spec
        self.rope_dim = rope_dim
        self.rope_theta = rope_theta
        f = spec.row_width
        self.kv_proj = nn.Linear(hidden_size, f, bias=False)
        self.gate_proj = nn.Linear(hidden_size, f, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(spec.ratio, f, dtype=torch.float32))
        self.kv_norm = RMSNorm(spec.head_dim, eps)

    kernel_backend: kb.KernelBackend = "torch"

    def update(self, x: Tensor, state: CompressorState) -> None:
        """Append the rows of ``x [T, C]`` to ``state``; every group they complete becomes an
        entry (appended to ``state.entries``), the rest stays pending. Mutates ``state``."""
        r, d = self.spec.ratio, self.spec.head_dim
        kv = torch.cat((state.pending_kv, self.kv_proj(x)))
        gate = torch.cat((state.pending_gate, self.gate_proj(x)))
        n_new = kv.shape[0] // r
        usable = n_new * r
        state.pending_kv, state.pending_gate = kv[usable:].clone(), gate[usable:].clone()
        if n_new == 0:
            return
        if self.kernel_backend == "triton":
            prev = state.prev_kv.shape[0] > 0
            pooled = kb.compress_pool(
                kv[:usable], gate[:usable], self.position_bias, overlapping=self.spec.overlapping,
                prev_kv=state.prev_kv.contiguous() if prev else None, prev_gate=state.prev_gate.to(kv.dtype).contiguous() if prev else None,
            )  # fmt: skip
            if self.spec.overlapping:
                state.prev_kv = kv[usable - r : usable, :d].clone()
                state.prev_gate = gate[usable - r : usable, :d].clone()
            self._append_entries(pooled, state, n_new)
            return
        group_kv = kv[:usable].view(n_new, r, -1)
        group_gate_raw = gate[:usable].view(n_new, r, -1)
        group_gate = group_gate_raw + self.position_bias
        if self.spec.overlapping:
            # [n_new, 2r, D]: slots [0, r) take the previous group's first halves, slots
            # [r, 2r) this group's second halves; a missing previous group gets weight 0.
            slot_kv = group_kv.new_zeros((n_new, 2 * r, d))
            slot_gate = group_gate.new_full((n_new, 2 * r, d), float("-inf"))
            slot_kv[:, r:] = group_kv[..., d:]
            slot_gate[:, r:] = group_gate[..., d:]
            slot_kv[1:, :r] = group_kv[:-1, :, :d]
            slot_gate[1:, :r] = group_gate[:-1, :, :d]
            if state.prev_kv.shape[0]:
                slot_kv[0, :r] = state.prev_kv
                slot_gate[0, :r] = state.prev_gate + self.position_bias[:, :d]
            state.prev_kv = group_kv[-1, :, :d].clone()
            state.prev_gate = group_gate_raw[-1, :, :d].clone()
            group_kv, group_gate = slot_kv, slot_gate
        weights = group_gate.softmax(dim=1, dtype=torch.float32).to(group_kv.dtype)
        self._append_entries((group_kv * weights).sum(dim=1), state, n_new)

    def _append_entries(self, pooled: Tensor, state: CompressorState, n_new: int) -> None:
        """Norm and rotate ``pooled [n_new, D]`` (entry w at position ``w·r``) onto the entries."""
        positions = (torch.arange(n_new, device=pooled.device) + state.num_entries) * self.spec.ratio
        cos, sin = rope_cos_sin(positions, self.rope_dim, self.rope_theta)
        state.entries = torch.cat((state.entries, apply_rope(self.kv_norm(pooled), cos, sin)))


class IndexerScorer(nn.Module):
    """Lightning-indexer score ``I[t, s] = Σ_h w[t, h] · ReLU(q[t, h] · K[s]) / √D_I`` with
    per-token head weights ``w = weights_proj(x) / √H_I`` (paper §2.3.1 eq. 16)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.softmax_scale = head_dim**-0.5
        self.weights_scaling = num_heads**-0.5
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def forward(self, q: Tensor, keys: Tensor, x: Tensor) -> Tensor:
        """``q [T, H_I, D_I]``, ``keys [N, D_I]``, ``x [T, C]`` → scores ``[T, N]`` (float32)."""
        scores = torch.matmul(q.float(), keys.transpose(0, 1).float())  # [T, H_I, N]
        scores = torch.relu(scores) * self.softmax_scale
        weights = self.weights_proj(x).float() * self.weights_scaling  # [T, H_I]
        return (scores * weights.unsqueeze(-1)).sum(dim=1)


class Indexer(Compressor):
    """The CSA lightning indexer (paper §2.3.1 eqs. 13–17): its own overlapping compressor at
    ``index_head_dim`` (the index keys), queries ``q_b_proj(q_residual)`` rotated at their
    positions, the scorer, and top-k selection among the entries a query may see.

    Parameters: those of :class:`Compressor` plus ``q_b_proj [H_I·D_I, q_lora_rank]`` and
    ``scorer.weights_proj [H_I, C]``.
    """

    def __init__(self, config: DeepseekV4Config) -> None:
        spec = CompressorSpec(ratio=config.compress_rate_csa, head_dim=config.index_head_dim, overlapping=True)
        super().__init__(config.hidden_size, spec, config.rope_head_dim, config.compress_rope_theta, config.rms_norm_eps)
        self.num_heads = config.index_n_heads
        self.index_topk = config.index_topk
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * spec.head_dim, bias=False)
        self.scorer = IndexerScorer(config.hidden_size, self.num_heads, spec.head_dim)

    def select(self, x: Tensor, q_residual: Tensor, positions: Tensor, keys: Tensor) -> Tensor:
        """Which compressed entries each query attends to: ``[T, N]`` bool.

        ``x [T, C]``, ``q_residual [T, q_lora_rank]``, ``positions [T]``, ``keys [N, D_I]`` (the
        index keys of every complete group). Query p may only pick entries w < ⌊(p + 1)/r⌋
        (groups that end at or before p); it keeps the ``index_topk`` best of those by score.
        Exact ties at the k-th score go to the earlier entry (a stable sort), so the choice does
        not depend on how many entries the chunk's rows hold: a long prefill and token-by-token
        decode pick the same entries. (transformers' ``torch.topk`` leaves ties to the kernel;
        with few index heads, all-zero ReLU scores tie often.)
        """
        t, n = x.shape[0], keys.shape[0]
        if n == 0:
            return torch.zeros((t, 0), dtype=torch.bool, device=x.device)
        top, valid = self._ranked(self._queries(q_residual, positions), x, positions, keys)
        chosen = torch.zeros((t, n), dtype=torch.bool, device=x.device)
        return chosen.scatter_(1, top, valid)

    def _queries(self, q_residual: Tensor, positions: Tensor) -> Tensor:
        """The index queries ``[T, H_I, D_I]``, rotated at their positions."""
        cos, sin = rope_cos_sin(positions, self.rope_dim, self.rope_theta)
        return apply_rope(self.q_b_proj(q_residual).view(-1, self.num_heads, self.spec.head_dim), cos, sin)

    def _ranked(self, q: Tensor, x: Tensor, positions: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        """The torch choice: ``(top [T, k] int64, valid [T, k] bool)``, k = min(index_topk, N)."""
        n = keys.shape[0]
        scores = self.scorer(q, keys, x)
        visible_count = torch.div(positions + 1, self.spec.ratio, rounding_mode="floor")  # [T]
        future = torch.arange(n, device=x.device)[None, :] >= visible_count[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        top = order[:, : min(self.index_topk, n)]  # [T, k]
        return top, top < visible_count[:, None]

    def select_topk(self, x: Tensor, q_residual: Tensor, positions: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`select` through the ``indexer_topk`` kernel (the Triton backend): the chosen
        entries as ``(indices [T, min(index_topk, N)] int32, valid [T, min(index_topk, N)]
        bool)``, the same choice, ties included. Above the kernel's ``MAX_KEYS`` index keys (one
        program sorts a whole row: 64K tokens at ratio 4) the ranking stays in torch."""
        from kernels.indexer_topk import MAX_KEYS

        q = self._queries(q_residual, positions)
        if keys.shape[0] > MAX_KEYS:
            top, valid = self._ranked(q, x, positions, keys)
            return top.to(torch.int32), valid
        weights = self.scorer.weights_proj(x).float() * self.scorer.weights_scaling
        return kb.indexer_topk(q, keys, weights, positions, ratio=self.spec.ratio, k=self.index_topk, scale=self.scorer.softmax_scale)


class CompressorWithIndexer(Compressor):
    """The CSA main compressor (overlapping, ratio ``compress_rate_csa``, width ``head_dim``)
    with its ``indexer`` submodule, named as transformers names them."""

    def __init__(self, config: DeepseekV4Config) -> None:
        spec = CompressorSpec(ratio=config.compress_rate_csa, head_dim=config.head_dim, overlapping=True)
        super().__init__(config.hidden_size, spec, config.rope_head_dim, config.compress_rope_theta, config.rms_norm_eps)
        self.indexer = Indexer(config)


def hca_compressor(config: DeepseekV4Config) -> Compressor:
    """The HCA compressor: non-overlapping, ratio ``compress_rate_hca``, width ``head_dim``."""
    spec = CompressorSpec(ratio=config.compress_rate_hca, head_dim=config.head_dim, overlapping=False)
    return Compressor(config.hidden_size, spec, config.rope_head_dim, config.compress_rope_theta, config.rms_norm_eps)
