"""Megatron-style tensor parallelism over a loaded model: each rank keeps its shard of every
sharded weight, and one all-reduce sums the partial outputs of each row-parallel block.

What is split across N ranks (rank r keeps the r-th of N equal parts):

* attention: query heads (column-parallel ``q_proj`` / ``q_b_proj``) and KV heads; with fewer KV
  heads than ranks each rank keeps the one KV head its query heads read (replicated, as vLLM's
  ``num_kv_head_replicas``); the output projection is row-parallel. DeepSeek-V4's single shared
  K = V head, its compressors and its indexer are replicated (every rank computes and caches
  them); its attention sinks, ``o_a_proj`` groups and the columns of ``o_b_proj`` are split;
* Gated DeltaNet: key heads with their value heads (``r`` per key head), so the conv channels,
  ``A_log``, ``dt_bias``, the recurrent state ``[H_v, D_k, D_v]`` and the conv state are the
  rank's heads only; ``out_proj`` is row-parallel;
* MLPs and every expert: the intermediate dimension (``gate`` / ``up`` column-parallel, ``down``
  row-parallel). Experts are tensor-sharded rather than expert-sharded: every rank does 1/N of
  every chosen expert, so the load stays even whatever the routing picks, routing needs no
  all-to-all and a MoE block ends in the same single all-reduce as a dense MLP (the shared
  expert's partial sum joins the routed ones before it). Routers run replicated;
* the embedding and the LM head by vocabulary rows (vocab-parallel; the vocabulary is padded to
  a multiple of N): the embedding's masked lookups are summed by one all-reduce, the LM head's
  logits gathered.

Everything else (norms, mHC, routers, compressors, indexers, rotary tables) is replicated.

Sources: Shoeybi et al. 2019, "Megatron-LM" (column- then row-parallel pairs, one all-reduce
per pair); vLLM's ``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding``
and ``QKVParallelLinear`` (KV-head replication).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from engine.model.attention import Attention
from engine.model.deepseek_v4_attention import DeepseekV4Attention
from engine.model.deepseek_v4_moe import DeepseekV4MLP, SparseMoE
from engine.model.gated_deltanet import GatedDeltaNet, GatedDeltaNetBase
from engine.model.layers import SwiGLU
from engine.model.qwen3_next_layers import Qwen3NextAttention, Qwen3NextGatedDeltaNet
from engine.model.qwen3_next_moe import Qwen3NextExperts, Qwen3NextSparseMoe
from engine.parallel.group import TensorParallelGroup
from engine.parallel.vocab import shard_vocab

MIXERS = (Attention, Qwen3NextAttention, DeepseekV4Attention, GatedDeltaNet, Qwen3NextGatedDeltaNet)
"""Token mixers whose output is a row-parallel partial sum."""

BLOCK_MLPS = (SwiGLU, DeepseekV4MLP, Qwen3NextSparseMoe, SparseMoE)
"""MLP blocks (dense or MoE) whose output, as a decoder layer's ``mlp``, is a partial sum."""


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank ``rank`` of ``size``."""

    rank: int
    size: int


def split(total: int, shard: Shard, field: str) -> range:
    """The rank's part ``[r·total/N, (r+1)·total/N)`` of ``total`` heads, groups or channels.

    Raises:
        ValueError: ``total`` is not a multiple of N (naming ``field``).
    """
    if total % shard.size:
        raise ValueError(f"{field} = {total} does not divide by tensor_parallel_size = {shard.size}")
    per = total // shard.size
    return range(shard.rank * per, (shard.rank + 1) * per)


def kv_split(kv_heads: int, shard: Shard, field: str = "num_key_value_heads") -> range:
    """The KV heads a rank keeps: its part when N divides them, else (fewer KV heads than
    ranks, N a multiple of them) the single head its query heads read, replicated.

    Raises:
        ValueError: neither divides the other (naming ``field``).
    """
    if kv_heads % shard.size == 0:
        return split(kv_heads, shard, field)
    if shard.size % kv_heads:
        raise ValueError(f"{field} = {kv_heads} and tensor_parallel_size = {shard.size}: one must divide the other")
    head = shard.rank * kv_heads // shard.size
    return range(head, head + 1)


def rows(blocks: Sequence[int], block: int, offset: int = 0) -> Tensor:
    """Indices ``offset + b·block + i`` for every b in ``blocks`` and i < ``block``, in order."""
    return torch.cat([torch.arange(offset + b * block, offset + (b + 1) * block) for b in blocks]) if blocks else torch.zeros(0, dtype=torch.long)


def keep_rows(linear: nn.Linear, index: Tensor) -> None:
    """Column-parallel: keep output features ``index`` of ``linear`` (and of its bias)."""
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight[index].clone(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[index].clone(), requires_grad=False)
    linear.out_features = len(index)


def keep_cols(linear: nn.Linear, index: Tensor, shard: Shard) -> None:
    """Row-parallel: keep input features ``index`` of ``linear``; its bias is added once (rank 0
    keeps it, the others hold zeros), since the partial outputs are summed."""
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight[:, index].clone(), requires_grad=False)
        if linear.bias is not None and shard.rank:
            linear.bias.zero_()
    linear.in_features = len(index)


def keep(param: Tensor, index: Tensor, dim: int = 0) -> nn.Parameter:
    """A new parameter holding ``index`` of ``param`` along ``dim``."""
    return nn.Parameter(param.detach().index_select(dim, index).clone(), requires_grad=False)


Step = Callable[[], None]


def _attention(m: Attention | Qwen3NextAttention, shard: Shard) -> Step:
    q_heads = split(m.num_heads, shard, "num_attention_heads")
    kv_heads = kv_split(m.num_kv_heads, shard)
    d = m.head_dim
    q_block = 2 * d if isinstance(m, Qwen3NextAttention) else d  # Qwen3-Next: query and its gate per head

    def apply() -> None:
        keep_rows(m.q_proj, rows(q_heads, q_block))
        keep_rows(m.k_proj, rows(kv_heads, d))
        keep_rows(m.v_proj, rows(kv_heads, d))
        keep_cols(m.o_proj, rows(q_heads, d), shard)
        m.num_heads, m.num_kv_heads = len(q_heads), len(kv_heads)

    return apply


def _gated_deltanet(m: GatedDeltaNetBase, shard: Shard) -> Step:
    k_heads = split(m.num_k_heads, shard, "linear_num_key_heads")
    r, dk, dv = m.heads_per_key, m.head_k_dim, m.head_v_dim
    v_heads = range(k_heads.start * r, k_heads.stop * r)
    channels = torch.cat((rows(k_heads, dk), rows(k_heads, dk, m.key_dim), rows(v_heads, dv, 2 * m.key_dim)))
    v_rows, v_index = rows(v_heads, dv), torch.tensor(list(v_heads), dtype=torch.long)

    def apply() -> None:
        if isinstance(m, GatedDeltaNet):
            keep_rows(m.q_proj, rows(k_heads, dk))
            keep_rows(m.k_proj, rows(k_heads, dk))
            for proj in (m.v_proj, m.z_proj):
                keep_rows(proj, v_rows)
            for proj in (m.a_proj, m.b_proj):
                keep_rows(proj, v_index)
            m.conv_weight = keep(m.conv_weight, channels)
            keep_cols(m.o_proj, v_rows, shard)
        elif isinstance(m, Qwen3NextGatedDeltaNet):
            if m.split:
                keep_rows(m.in_proj_qkv, channels)
                keep_rows(m.in_proj_z, v_rows)
                keep_rows(m.in_proj_b, v_index)
                keep_rows(m.in_proj_a, v_index)
            else:  # head-grouped fused projections: whole key-head groups
                keep_rows(m.in_proj_qkvz, rows(k_heads, 2 * dk + 2 * r * dv))
                keep_rows(m.in_proj_ba, rows(k_heads, 2 * r))
            m.conv1d.weight = keep(m.conv1d.weight, channels)
            m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = len(channels)
            keep_cols(m.out_proj, v_rows, shard)
        m.A_log = keep(m.A_log, v_index)
        m.dt_bias = keep(m.dt_bias, v_index)
        m.num_k_heads, m.num_v_heads = len(k_heads), len(v_heads)
        m.key_dim, m.value_dim = len(k_heads) * dk, len(v_heads) * dv
        m.conv_dim = 2 * m.key_dim + m.value_dim

    return apply


def _deepseek_v4_attention(m: DeepseekV4Attention, shard: Shard) -> Step:
    heads = split(m.num_heads, shard, "num_attention_heads")
    groups = split(m.o_groups, shard, "o_groups")
    o_rank = m.o_a_proj.weight.shape[0] // m.o_groups

    def apply() -> None:
        keep_rows(m.q_b_proj, rows(heads, m.head_dim))
        m.sinks = keep(m.sinks, torch.tensor(list(heads), dtype=torch.long))
        m.o_a_proj.weight = keep(m.o_a_proj.weight, rows(groups, o_rank))
        m.o_a_proj.groups = len(groups)
        keep_cols(m.o_b_proj, rows(groups, o_rank), shard)
        m.num_heads, m.o_groups = len(heads), len(groups)

    return apply


def _mlp(m: SwiGLU | DeepseekV4MLP, shard: Shard, field: str) -> Step:
    part = torch.tensor(list(split(m.gate_proj.out_features, shard, field)), dtype=torch.long)

    def apply() -> None:
        keep_rows(m.gate_proj, part)
        keep_rows(m.up_proj, part)
        keep_cols(m.down_proj, part, shard)

    return apply


def _experts(m: Qwen3NextExperts, shard: Shard) -> Step:
    width = m.intermediate_size
    part = torch.tensor(list(split(width, shard, "moe_intermediate_size")), dtype=torch.long)

    def apply() -> None:
        m.gate_up_proj = keep(m.gate_up_proj, torch.cat((part, part + width)), dim=1)
        m.down_proj = keep(m.down_proj, part, dim=2)
        m.intermediate_size = len(part)

    return apply


def _mlp_field(name: str) -> str:
    if "shared_expert" in name:
        return "shared_expert_intermediate_size" if name.endswith("shared_expert") else "moe_intermediate_size"
    return "moe_intermediate_size" if ".experts." in name else "intermediate_size"


def plan_shards(model: nn.Module, shard: Shard) -> list[Step]:
    """The in-place steps that cut ``model`` to ``shard`` (nothing changed yet).

    Raises:
        ValueError: a head, group or channel count does not divide by N (naming the field).
    """
    steps: list[Step] = []
    for name, m in model.named_modules():
        if isinstance(m, Attention | Qwen3NextAttention):
            steps.append(_attention(m, shard))
        elif isinstance(m, GatedDeltaNetBase):
            steps.append(_gated_deltanet(m, shard))
        elif isinstance(m, DeepseekV4Attention):
            steps.append(_deepseek_v4_attention(m, shard))
        elif isinstance(m, SwiGLU | DeepseekV4MLP):
            steps.append(_mlp(m, shard, _mlp_field(name)))
        elif isinstance(m, Qwen3NextExperts):
            steps.append(_experts(m, shard))
    return steps


def check_shardable(model: nn.Module, size: int) -> None:
    """Refuse, before any rank starts, a model whose heads or widths do not divide by ``size``.

    Raises:
        ValueError: naming the config field.
    """
    plan_shards(model, Shard(0, size))


def shard_model(model: nn.Module, group: TensorParallelGroup) -> None:
    """Cut ``model`` (loaded whole on this rank) to this rank's shard, in place, and make its
    row-parallel blocks sum their partial outputs over ``group``: one all-reduce after every
    token mixer and every decoder layer's MLP block, one in the embedding, one all-gather of the
    LM head's logits.

    Raises:
        ValueError: as :func:`plan_shards`.
    """
    shard = Shard(group.rank, group.size)
    for step in plan_shards(model, shard):
        step()

    def reduce(_module: nn.Module, _args: object, out: Tensor) -> Tensor:
        return group.all_reduce(out)

    for m in model.modules():
        if isinstance(m, MIXERS):
            m.register_forward_hook(reduce)
        mlp = getattr(m, "mlp", None)
        if isinstance(mlp, BLOCK_MLPS) and not isinstance(m, BLOCK_MLPS):
            mlp.register_forward_hook(reduce)
    shard_vocab(model, group)
