"""gated_delta_rule kernels against the engine's torch path (:mod:`kernels.gated_delta_rule_torch`):
the fused recurrent and the chunked forms on varlen batches (lengths 1, 63, 0 and 100; one of
500; initial state in, final state out, in place too), head dims 64 and 60, fp32 and fp16
inputs, outputs pre-filled with NaN; the causal conv decode step against the torch
causal_conv1d over several tokens; the launcher checks."""

from __future__ import annotations

import pytest
import torch

from kernels.gated_delta_rule import (
    CHUNK,
    causal_conv1d_update,
    chunk_gated_delta_rule_ref,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_gated_delta_rule_ref,
)
from kernels.gated_delta_rule import (
    chunk_gated_delta_rule as chunk_kernel,
)
from kernels.gated_delta_rule_torch import causal_conv1d, chunk_gated_delta_rule, l2norm
from tests.helpers import TOLERANCE


def batch(lengths: list[int], h: int, dk: int, dv: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = l2norm(torch.randn((t, h, dk), generator=g)).to(dtype=dtype, device=device)
    k = l2norm(torch.randn((t, h, dk), generator=g)).to(dtype=dtype, device=device)
    v = torch.randn((t, h, dv), generator=g).to(dtype=dtype, device=device)
    decay = (-torch.rand((t, h), generator=g) * 0.5).to(dtype=dtype, device=device)
    beta = torch.rand((t, h), generator=g).to(dtype=dtype, device=device)
    state = torch.randn((len(lengths), h, dk, dv), generator=g).to(device) * 0.1
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, decay, beta, state, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("h", "dk", "dv"), [(2, 64, 64), (1, 60, 60), (3, 32, 40)])
def test_recurrent_matches_the_engine(h: int, dk: int, dv: int, dtype: torch.dtype, device: str) -> None:
    q, k, v, decay, beta, state, cu = batch([1, 63, 0, 100], h, dk, dv, dtype, device)
    out = torch.full_like(v, float("nan"))
    o, final = fused_recurrent_gated_delta_rule(q, k, v, decay, beta, state, cu, out=out)
    want_o, want_final = fused_recurrent_gated_delta_rule_ref(q, k, v, decay, beta, state, cu)
    assert o is out and not o.isnan().any()
    assert (o.float() - want_o).abs().max().item() <= TOLERANCE[dtype]
    assert (final - want_final).abs().max().item() <= TOLERANCE[dtype]
    assert torch.equal(final[2], state[2])  # the empty sequence keeps its state
    # and the engine's chunked form of the longest sequence agrees (same math, other order)
    chunk_o, chunk_s = chunk_gated_delta_rule(q[64:], k[64:], v[64:], decay[64:], beta[64:], state[3])
    assert (o[64:].float() - chunk_o).abs().max().item() <= TOLERANCE[dtype]
    assert (final[3] - chunk_s).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("h", "dk", "dv", "lengths"), [(2, 64, 64, [1, 63, 0, 100]), (1, 60, 60, [1, 63, 0, 100]), (2, 64, 48, [500])])
def test_chunked_matches_the_engine(h: int, dk: int, dv: int, lengths: list[int], dtype: torch.dtype, device: str) -> None:
    q, k, v, decay, beta, state, cu = batch(lengths, h, dk, dv, dtype, device, seed=3)
    out = torch.full_like(v, float("nan"))
    o, final = chunk_kernel(q, k, v, decay, beta, state, cu, out=out)
    want_o, want_final = chunk_gated_delta_rule_ref(q, k, v, decay, beta, state, cu)
    assert o is out and not o.isnan().any()
    assert (o.float() - want_o).abs().max().item() <= TOLERANCE[dtype]
    assert (final - want_final).abs().max().item() <= TOLERANCE[torch.float32]  # the state is fp32
    for i in range(len(lengths)):
        if lengths[i] == 0:
            assert torch.equal(final[i], state[i])  # an empty sequence keeps its state
    # the engine's own chunked form (chunk size 64, solved with torch) agrees on the longest one
    a = int(cu[-2])
    chunk_o, chunk_s = chunk_gated_delta_rule(q[a:], k[a:], v[a:], decay[a:], beta[a:], state[-1])
    assert (o[a:].float() - chunk_o).abs().max().item() <= TOLERANCE[dtype]
    assert (final[-1] - chunk_s).abs().max().item() <= TOLERANCE[torch.float32]


def test_chunked_survives_strong_decay_and_full_writes(device: str) -> None:
    """Decays down to exp(-20) per token (exp(G) underflows inside a chunk) and beta near 1: the
    masked exponentials must stay finite and the state must follow the recurrent rule."""
    q, k, v, _, _, state, cu = batch([2 * CHUNK + 5], 2, 64, 64, torch.float32, device, seed=4)
    g = torch.Generator().manual_seed(5)
    decay = (-torch.rand((q.shape[0], 2), generator=g) * 20).to(device)
    beta = torch.full((q.shape[0], 2), 0.999, device=device)
    o, final = chunk_kernel(q, k, v, decay, beta, state, cu)
    want_o, want_final = chunk_gated_delta_rule_ref(q, k, v, decay, beta, state, cu)
    assert (o - want_o).abs().max().item() <= 1e-4
    assert (final - want_final).abs().max().item() <= 1e-4


def test_chunked_inplace_and_in_two_calls(device: str) -> None:
    """In place, and a sequence split across two calls (the engine's chunked prefill) ends where
    one call over the whole sequence does."""
    q, k, v, decay, beta, state, _ = batch([90], 2, 64, 64, torch.float32, device, seed=6)
    whole_o, whole = chunk_gated_delta_rule_ref(q, k, v, decay, beta, state, torch.tensor([0, 90], dtype=torch.int32, device=device))
    running = state.clone()
    outs = []
    for a, b in ((0, 37), (37, 90)):
        cu = torch.tensor([0, b - a], dtype=torch.int32, device=device)
        o, final = chunk_kernel(q[a:b], k[a:b], v[a:b], decay[a:b], beta[a:b], running, cu, inplace=True)
        assert final is running
        outs.append(o)
    assert (torch.cat(outs) - whole_o).abs().max().item() <= 1e-4
    assert (running - whole).abs().max().item() <= 1e-4


def test_inplace_updates_the_state_it_read(device: str) -> None:
    q, k, v, decay, beta, state, cu = batch([5, 9], 2, 64, 64, torch.float32, device, seed=1)
    before = state.clone()
    _, want_final = fused_recurrent_gated_delta_rule_ref(q, k, v, decay, beta, before, cu)
    _, final = fused_recurrent_gated_delta_rule(q, k, v, decay, beta, state, cu, inplace=True)
    assert final is state and (state - want_final).abs().max().item() <= 1e-5


@pytest.mark.parametrize("width", [4, 2])
def test_conv_update_matches_the_engine_token_by_token(width: int, device: str) -> None:
    g = torch.Generator().manual_seed(2)
    channels, steps = 70, 6
    weight = torch.randn((channels, width), generator=g).to(device)
    xs = torch.randn((steps, 2, channels), generator=g).to(device)  # two sequences decoding
    state = torch.zeros((2, channels, width - 1), device=device)
    engine_state = [torch.zeros((channels, width - 1), device=device) for _ in range(2)]
    for step in range(steps):
        y = causal_conv1d_update(xs[step], weight, state)
        for b in range(2):
            want, engine_state[b] = causal_conv1d(xs[step, b][None], weight, engine_state[b])
            assert (y[b] - want[0]).abs().max().item() <= 1e-5
            assert torch.allclose(state[b], engine_state[b])


@pytest.mark.parametrize(
    ("change", "message"),
    [("cu_seqlens", "must rise from 0"), ("state dtype", "initial_state must be"), ("g shape", "g and beta must be"), ("conv state", "conv_state must be")],
)
def test_the_launchers_refuse_bad_arguments(change: str, message: str, device: str) -> None:
    q, k, v, decay, beta, state, cu = batch([3, 4], 2, 64, 64, torch.float32, device)
    if change == "conv state":
        with pytest.raises(ValueError, match=message):
            causal_conv1d_update(torch.zeros(2, 8, device=device), torch.zeros(8, 4, device=device), torch.zeros(2, 8, 2, device=device))
        return
    if change == "cu_seqlens":
        cu = cu.flip(0)
    elif change == "state dtype":
        state = state.half()
    elif change == "g shape":
        decay = decay[:, :1]
    for launcher in (fused_recurrent_gated_delta_rule, chunk_kernel):
        with pytest.raises(ValueError, match=message):
            launcher(q, k, v, decay, beta, state, cu)
