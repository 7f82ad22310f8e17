"""Vocab-parallel embedding and LM head (vLLM's ``VocabParallelEmbedding`` / ``ParallelLMHead``).

The vocabulary V is padded to ``P = ⌈V / N⌉ · N`` rows and rank r keeps rows ``[r·P/N,
(r+1)·P/N)`` of both matrices (the padding rows are zeros and never looked up). The embedding
looks up the token ids that fall in its rows, zeros the others, and one all-reduce sums the
ranks' rows into every token's embedding; the LM head computes the logits of its rows and one
all-gather puts the full ``[T, V]`` logits on every rank. A tied LM head keeps sharing the
embedding's shard.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.parallel.group import TensorParallelGroup


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + R)`` of an embedding ``[V, C]`` (``weight [R, C]``).

    forward: ``input_ids`` of any shape → ``[..., C]``, the full embedding on every rank.
    """

    def __init__(self, weight: Tensor, start: int, vocab_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.vocab_size, self.group = start, vocab_size, group
        self.num_embeddings, self.embedding_dim = vocab_size, weight.shape[1]

    def forward(self, input_ids: Tensor) -> Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


def _embedding_of(model: nn.Module) -> tuple[nn.Module, str, nn.Embedding]:
    """(parent, attribute, module) of the model's input embedding (``embed_tokens``)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding) and name.endswith("embed_tokens"):
            parent_name, _, attr = name.rpartition(".")
            return model.get_submodule(parent_name) if parent_name else model, attr, m
    raise RuntimeError(f"{type(model).__name__} has no embed_tokens embedding to shard")


def shard_vocab(model: nn.Module, group: TensorParallelGroup) -> None:
    """Replace ``embed_tokens`` by its :class:`VocabParallelEmbedding` shard and cut
    ``lm_head`` to the same rows, gathering its logits (module docstring)."""
    parent, attr, embedding = _embedding_of(model)
    lm_head = getattr(model, "lm_head", None)
    if not isinstance(lm_head, nn.Linear):
        raise RuntimeError(f"{type(model).__name__} has no lm_head to shard")
    tied = lm_head.weight is embedding.weight
    vocab = embedding.num_embeddings
    per = -(-vocab // group.size)
    start = group.rank * per

    def shard_rows(weight: Tensor) -> Tensor:
        part = torch.zeros((per, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        rows = weight.detach()[start : min(start + per, vocab)]
        part[: rows.shape[0]] = rows
        return part

    sharded = VocabParallelEmbedding(shard_rows(embedding.weight), start, vocab, group)
    setattr(parent, attr, sharded)
    with torch.no_grad():
        lm_head.weight = sharded.weight if tied else nn.Parameter(shard_rows(lm_head.weight), requires_grad=False)
    lm_head.out_features = per

    def gather(_module: nn.Module, _args: object, out: Tensor) -> Tensor:
        return torch.cat(group.all_gather(out), dim=-1)[..., :vocab]

    lm_head.register_forward_hook(gather)
