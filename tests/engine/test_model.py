"""The model's math: chunked = recurrent delta rule; prefill + decode = one long prefill."""

from __future__ import annotations

import pytest
import torch

from engine.config import HybridConfig
from engine.model.attention import attention_mask
from engine.model.hybrid import HybridForCausalLM
from kernels.gated_delta_rule_torch import (
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_rule,
    l2norm,
)
from tests.helpers import TOLERANCE


@pytest.fixture(scope="module")
def model() -> HybridForCausalLM:
    m = HybridForCausalLM(HybridConfig())
    m.init_random(0)
    return m.eval()


@pytest.mark.parametrize("t", [1, 63, 64, 65, 500])
def test_chunked_delta_rule_equals_recurrent(t: int) -> None:
    g = torch.Generator().manual_seed(t)
    h, dk, dv = 3, 16, 12
    q = l2norm(torch.randn(t, h, dk, generator=g))
    k = l2norm(torch.randn(t, h, dk, generator=g))
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g)
    beta = torch.rand(t, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g)
    o_ref, s_ref = gated_delta_rule(q, k, v, decay, beta, s0)
    o, s = chunk_gated_delta_rule(q, k, v, decay, beta, s0)
    assert o.shape == (t, h, dv) and s.shape == (h, dk, dv)
    assert (o - o_ref).abs().max() <= TOLERANCE[torch.float32]
    assert (s - s_ref).abs().max() <= TOLERANCE[torch.float32]
    assert not torch.equal(s0, s)  # the initial state is an input, not overwritten


def test_delta_rule_state_is_composable() -> None:
    """Running [0, a) then [a, T) from the carried state equals running [0, T)."""
    g = torch.Generator().manual_seed(7)
    t, h, dk, dv = 100, 2, 8, 8
    q, k = l2norm(torch.randn(t, h, dk, generator=g)), l2norm(torch.randn(t, h, dk, generator=g))
    v, decay, beta = torch.randn(t, h, dv, generator=g), -torch.rand(t, h, generator=g), torch.rand(t, h, generator=g)
    zero = torch.zeros(h, dk, dv)
    o_all, s_all = gated_delta_rule(q, k, v, decay, beta, zero)
    o1, s1 = chunk_gated_delta_rule(q[:37], k[:37], v[:37], decay[:37], beta[:37], zero)
    o2, s2 = chunk_gated_delta_rule(q[37:], k[37:], v[37:], decay[37:], beta[37:], s1)
    assert (torch.cat((o1, o2)) - o_all).abs().max() <= TOLERANCE[torch.float32]
    assert (s2 - s_all).abs().max() <= TOLERANCE[torch.float32]


def test_causal_conv_continues_from_state() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 6, generator=g)
    w = torch.randn(6, 4, generator=g)
    y_all, st_all = causal_conv1d(x, w, torch.zeros(6, 3))
    y1, st1 = causal_conv1d(x[:9], w, torch.zeros(6, 3))
    y2, st2 = causal_conv1d(x[9:], w, st1)
    assert torch.allclose(torch.cat((y1, y2)), y_all, atol=1e-6)
    assert torch.equal(st2, st_all)
    assert torch.equal(st_all, x[-3:].T)  # the state is the last K-1 inputs, oldest first
    # y_0 only sees x_0 (zeros before): silu(w[:, -1] * x_0)
    assert torch.allclose(y_all[0], torch.nn.functional.silu(w[:, -1] * x[0]), atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("split", [1, 50, 64, 130])
def test_prefill_then_decode_equals_one_prefill(model: HybridForCausalLM, split: int) -> None:
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(split))
    full = model(ids, torch.arange(150), model.new_dense_state())
    state = model.new_dense_state()
    parts = [model(ids[:split], torch.arange(split), state)]
    for i in range(split, 150):
        parts.append(model(ids[i : i + 1], torch.tensor([i]), state))
    assert (torch.cat(parts) - full).abs().max() <= TOLERANCE[torch.float32]


def test_attention_mask_window() -> None:
    """A sliding query at p sees keys (p - W, p]; a full query sees [0, p]."""
    q = torch.tensor([100, 101])
    k = torch.arange(0, 102)
    m = attention_mask(q, k, window=64)
    assert m[0].nonzero().flatten().tolist() == list(range(37, 101))
    assert m[1].nonzero().flatten().tolist() == list(range(38, 102))
    full = attention_mask(q, k, window=None)
    assert full[0].sum() == 101 and full[1].sum() == 102


def test_packed_experts_keep_the_checkpoint_layout() -> None:
    """Qwen3-Next's experts live packed (``gate_up_proj [E, 2I, C]``, ``down_proj [E, C, I]``) but
    save and load as ``{e}.{gate,up,down}_proj.weight``; strict loading names what is missing or
    extra."""
    from engine.model.qwen3_next_moe import Qwen3NextExperts

    experts = Qwen3NextExperts(3, 8, 4)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.arange(3 * 8 * 8, dtype=torch.float32).view(3, 8, 8))
        experts.down_proj.copy_(-torch.arange(3 * 8 * 4, dtype=torch.float32).view(3, 8, 4))
    state = experts.state_dict()
    assert sorted(state) == sorted(f"{e}.{n}.weight" for e in range(3) for n in ("gate_proj", "up_proj", "down_proj"))
    assert torch.equal(state["1.up_proj.weight"], experts.gate_up_proj[1, 4:]) and state["2.down_proj.weight"].shape == (8, 4)
    again = Qwen3NextExperts(3, 8, 4)
    again.load_state_dict({k: v.clone() for k, v in state.items()})
    assert torch.equal(again.gate_up_proj, experts.gate_up_proj) and torch.equal(again.down_proj, experts.down_proj)
    broken = {k: v for k, v in state.items() if k != "0.gate_proj.weight"} | {"3.up_proj.weight": torch.zeros(4, 8)}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*0\.gate_proj\.weight(?s:.*)Unexpected key\(s\).*3\.up_proj\.weight"):
        again.load_state_dict(broken)
    with pytest.raises(RuntimeError, match=r"size mismatch for 1\.down_proj\.weight"):
        again.load_state_dict(state | {"1.down_proj.weight": torch.zeros(4, 8)})
    with torch.device("meta"):
        lazy = Qwen3NextExperts(3, 8, 4)
    lazy.load_state_dict({k: v.clone().double() for k, v in state.items()}, assign=True)
    assert lazy.gate_up_proj.dtype == torch.float64 and torch.equal(lazy.gate_up_proj.float(), experts.gate_up_proj)
    assert torch.equal(lazy.down_proj.float(), experts.down_proj)
    partial = {k: v for k, v in state.items() if k.startswith("0.")}
    with torch.device("meta"):
        empty = Qwen3NextExperts(3, 8, 4)
    with pytest.raises(RuntimeError, match="assign=True needs every expert"):
        empty.load_state_dict(partial, strict=False, assign=True)
    kept = Qwen3NextExperts(3, 8, 4)
    with torch.no_grad():
        kept.gate_up_proj.zero_()
        kept.down_proj.zero_()
    result = kept.load_state_dict({k: v.clone() for k, v in partial.items()}, strict=False, assign=True)
    assert len(result.missing_keys) == 6
    assert torch.equal(kept.gate_up_proj[0], experts.gate_up_proj[0]) and not kept.gate_up_proj[1:].any()
