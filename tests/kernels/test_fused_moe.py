"""fused_moe against the engine's torch experts (Qwen3-Next's ``Qwen3NextExperts``) and the
per-token reference: several token counts (0, 1, odd, more than a block per expert), k of 1 to
3, uneven routing (every token on the same experts; experts with no token), head sizes that are
not multiples of the tiles, fp32 and fp16; the block alignment's invariants; no host read or
value-shaped op inside (a CUDA graph can capture it); the launcher checks."""

from __future__ import annotations

import pytest
import torch

from engine.model.qwen3_next_moe import Qwen3NextExperts
from engine.runtime.cuda_graphs import forbid_host_sync
from kernels.fused_moe import BLOCK_M, fused_moe, fused_moe_ref, moe_align
from tests.helpers import TOLERANCE


def problem(t: int, k: int, e: int, c: int, i: int, dtype: torch.dtype, device: str, *, skew: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((t, c), generator=g).to(dtype=dtype, device=device)
    gate_up = (torch.randn((e, 2 * i, c), generator=g) * 0.1).to(dtype=dtype, device=device)
    down = (torch.randn((e, c, i), generator=g) * 0.1).to(dtype=dtype, device=device)
    if skew:  # every token on experts 0 .. k-1: expert 0 gets more than one block of pairs
        ids = torch.arange(k).repeat(t, 1)
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros((0, k), dtype=torch.long)
    weights = torch.rand((t, k), generator=g).to(dtype=dtype, device=device)
    return x, gate_up, down, ids.to(device), weights


CASES = [(1, 2, 4, 64, 64, False), (7, 2, 8, 48, 40, False), (33, 3, 8, 64, 96, False), (50, 1, 3, 32, 16, False), (40, 2, 6, 64, 64, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "k", "e", "c", "i", "skew"), CASES)
def test_fused_moe_matches_the_engine_experts(t: int, k: int, e: int, c: int, i: int, skew: bool, dtype: torch.dtype, device: str) -> None:
    x, gate_up, down, ids, weights = problem(t, k, e, c, i, dtype, device, skew=skew)
    out = fused_moe(x, gate_up, down, ids, weights)
    assert out.shape == x.shape and out.dtype == dtype and not out.isnan().any()
    want = fused_moe_ref(x, gate_up, down, ids, weights)
    assert (out.float() - want).abs().max().item() <= TOLERANCE[dtype]
    if dtype == torch.float32:  # the engine's torch path over the same packed weights
        experts = Qwen3NextExperts(e, c, i).to(device)
        with torch.no_grad():
            experts.gate_up_proj.copy_(gate_up)
            experts.down_proj.copy_(down)
            engine = experts(x, ids, weights)
        assert (out - engine).abs().max().item() <= TOLERANCE[dtype]


def test_no_tokens_give_an_empty_output(device: str) -> None:
    x, gate_up, down, ids, weights = problem(0, 2, 4, 32, 16, torch.float32, device)
    assert fused_moe(x, gate_up, down, ids, weights).shape == (0, 32)


@pytest.mark.parametrize(("t", "k", "e", "skew"), [(37, 3, 8, False), (37, 3, 8, True), (1, 3, 64, False)])
def test_alignment_puts_every_pair_once_in_a_block_of_its_expert(t: int, k: int, e: int, skew: bool, device: str) -> None:
    _, _, _, ids, _ = problem(t, k, e, 32, 16, torch.float32, device, skew=skew, seed=4)
    sorted_pairs, block_expert = moe_align(ids, e)
    pairs = t * k
    rows = sorted_pairs.shape[0]
    assert rows % BLOCK_M == 0 and rows >= pairs + min(e, pairs) * (BLOCK_M - 1) and block_expert.shape == (rows // BLOCK_M,)
    real = sorted_pairs[sorted_pairs < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # each pair exactly once
    assert ((sorted_pairs == pairs) | (sorted_pairs < pairs)).all()  # the rest is padding
    flat = ids.reshape(-1)
    used = block_expert >= 0
    for b in range(block_expert.shape[0]):
        block = sorted_pairs[b * BLOCK_M : (b + 1) * BLOCK_M]
        live = block[block < pairs].long()
        if used[b]:
            assert (flat[live] == block_expert[b]).all()
        else:
            assert live.numel() == 0  # blocks past the last expert's hold nothing
    assert int(used.sum()) == sum(-(-int((flat == x).sum()) // BLOCK_M) for x in range(e))
    assert bool((block_expert[used].diff() >= 0).all())  # experts in order


def test_fused_moe_has_no_host_reads_or_value_shaped_ops(device: str) -> None:
    x, gate_up, down, ids, weights = problem(9, 2, 4, 32, 16, torch.float32, device)
    with forbid_host_sync():
        out = fused_moe(x, gate_up, down, ids, weights)
    assert (out.float() - fused_moe_ref(x, gate_up, down, ids, weights)).abs().max().item() <= TOLERANCE[torch.float32]


def test_the_launcher_checks_its_arguments(device: str) -> None:
    x, gate_up, down, ids, weights = problem(4, 2, 4, 32, 16, torch.float32, device)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, gate_up[:, :, :16].contiguous(), down, ids, weights)
    with pytest.raises(ValueError, match="topk_ids must be integer"):
        fused_moe(x, gate_up, down, ids.float(), weights)
    with pytest.raises(ValueError, match="one float dtype"):
        fused_moe(x.half(), gate_up, down, ids, weights)
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(x.t().contiguous().t(), gate_up, down, ids, weights)
