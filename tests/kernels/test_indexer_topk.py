"""indexer_topk against its fp32 reference and against the engine's Indexer.select: scores
(ReLU per head, weighted, summed, causal at compressed granularity), the top-k with ties to the
earlier entry (all-zero ReLU scores tie often), queries that see nothing yet, k above the number
of keys, head dims 64 and 60, fp32 and fp16; the launcher checks."""

from __future__ import annotations

import pytest
import torch

from engine.model.deepseek_v4_compressor import Indexer, apply_rope, rope_cos_sin
from kernels.indexer_topk import chosen_mask, indexer_topk, indexer_topk_ref
from tests.helpers import TOLERANCE


def inputs(t: int, n: int, heads: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((t, heads, d), generator=g).to(dtype=dtype, device=device)
    keys = torch.randn((n, d), generator=g).to(dtype=dtype, device=device)
    weights = torch.randn((t, heads), generator=g).to(device)
    positions = torch.arange(t, device=device) * 3  # queries spread over 3 t tokens
    return q, keys, weights, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "n", "heads", "d", "k"), [(1, 1, 1, 64, 4), (63, 50, 4, 64, 8), (40, 130, 2, 60, 16), (5, 7, 2, 64, 64)])
def test_matches_the_reference(t: int, n: int, heads: int, d: int, k: int, dtype: torch.dtype, device: str) -> None:
    q, keys, weights, positions = inputs(t, n, heads, d, dtype, device)
    scores, indices, valid = indexer_topk(q, keys, weights, positions, ratio=4, k=k, scale=d**-0.5)
    want_scores, want_indices, want_valid = indexer_topk_ref(q, keys, weights, positions, ratio=4, k=k, scale=d**-0.5)
    finite = want_scores.isfinite()
    assert torch.equal(scores.isfinite(), finite)
    if finite.any():  # (a lone query at position 0 sees no entry yet)
        scale = max(1.0, want_scores[finite].abs().max().item())
        assert (scores[finite] - want_scores[finite]).abs().max().item() <= TOLERANCE[dtype] * scale
    assert torch.equal(valid, want_valid)
    if dtype == torch.float32:  # fp16 rounding may swap near-equal scores
        assert torch.equal(indices[valid], want_indices[valid])
    assert torch.equal(chosen_mask(indices, valid, n).sum(dim=1), want_valid.sum(dim=1))


def test_ties_go_to_the_earlier_entry(device: str) -> None:
    """Every score 0 (ReLU of negative dot products): the first k visible entries, in order."""
    q = -torch.ones((3, 2, 64), device=device)
    keys = torch.ones((20, 64), device=device)
    weights = torch.ones((3, 2), device=device)
    positions = torch.tensor([3, 39, 79], device=device)  # sees 1, 10 and all 20 entries
    _, indices, valid = indexer_topk(q, keys, weights, positions, ratio=4, k=5, scale=0.125)
    assert valid.tolist() == [[True, False, False, False, False], [True] * 5, [True] * 5]
    assert indices[1].tolist() == [0, 1, 2, 3, 4] and indices[2].tolist() == [0, 1, 2, 3, 4]


def test_the_engines_selection(device: str) -> None:
    """The engine's Indexer.select on a tiny DeepSeek-V4 config picks exactly the kernel's keys
    (queries rotated and weighted as select does)."""
    from engine.model.deepseek_v4_config_io import config_from_dict
    from engine.presets import PRESETS

    torch.manual_seed(0)
    config = config_from_dict({"model_type": "deepseek_v4", **PRESETS["deepseek_v4-tiny"].fields})
    indexer = Indexer(config).to(device)
    t, n = 40, 9
    x = torch.randn(t, config.hidden_size, device=device)
    q_residual = torch.randn(t, config.q_lora_rank, device=device)
    positions = torch.arange(t, device=device)
    keys = torch.randn(n, config.index_head_dim, device=device)
    with torch.no_grad():
        chosen = indexer.select(x, q_residual, positions, keys)
        cos, sin = rope_cos_sin(positions, indexer.rope_dim, indexer.rope_theta)
        q = apply_rope(indexer.q_b_proj(q_residual).view(t, indexer.num_heads, -1), cos, sin)
        weights = indexer.scorer.weights_proj(x).float() * indexer.scorer.weights_scaling
    _, indices, valid = indexer_topk(q, keys, weights, positions, ratio=indexer.spec.ratio, k=indexer.index_topk, scale=indexer.scorer.softmax_scale)
    assert torch.equal(chosen_mask(indices, valid, n), chosen)


@pytest.mark.parametrize(
    ("change", "message"),
    [("weights dtype", "weights must be float32"), ("k", "must be >= 1"), ("dims", "q must be"), ("positions", "positions must be")],
)
def test_the_launcher_refuses_bad_arguments(change: str, message: str, device: str) -> None:
    q, keys, weights, positions = inputs(4, 6, 2, 64, torch.float32, device)
    kwargs: dict[str, object] = {"ratio": 4, "k": 3, "scale": 0.125}
    if change == "weights dtype":
        weights = weights.half()
    elif change == "k":
        kwargs["k"] = 0
    elif change == "dims":
        keys = keys[:, :32]
    elif change == "positions":
        positions = positions.float()
    with pytest.raises(ValueError, match=message):
        indexer_topk(q, keys, weights, positions, **kwargs)  # type: ignore[arg-type]
