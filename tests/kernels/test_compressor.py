"""compressor against its fp32 reference and against the engine's torch path (the DeepSeek-V4
``Compressor`` module: the kernel's pooled entries, RMS-normed and rotated, are its entries),
overlapping (CSA, ratio 4) and not (HCA, ratio 32 here 8), head dims 64 and 60, one group and
many, with and without a previous group, fp32 and fp16; the decode step; the launcher checks."""

from __future__ import annotations

import pytest
import torch

from engine.model.deepseek_v4_compressor import Compressor, apply_rope, rope_cos_sin
from engine.model.state import CompressorSpec, CompressorState
from kernels.compressor import compress_pool, compress_pool_ref, compressor_decode_step
from tests.helpers import TOLERANCE


def rows(n_rows: int, width: int, dtype: torch.dtype, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((n_rows, width), generator=g).to(dtype=dtype, device=device), (2 * torch.randn((n_rows, width), generator=g)).to(dtype=dtype, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("ratio", "d", "overlapping", "with_prev"),
    [(4, 64, True, False), (4, 64, True, True), (4, 60, True, True), (8, 64, False, False), (1, 60, False, False)],
)
@pytest.mark.parametrize("groups", [1, 5])
def test_matches_the_reference(ratio: int, d: int, overlapping: bool, groups: int, with_prev: bool, dtype: torch.dtype, device: str) -> None:
    width = 2 * d if overlapping else d
    kv, gate = rows(groups * ratio, width, dtype, device, seed=groups)
    bias = torch.randn((ratio, width), generator=torch.Generator().manual_seed(9)).to(device)
    prev = rows(ratio, d, dtype, device, seed=99) if with_prev else (None, None)
    out = compress_pool(kv, gate, bias, overlapping=overlapping, prev_kv=prev[0], prev_gate=prev[1])
    expected = compress_pool_ref(kv, gate, bias, overlapping=overlapping, prev_kv=prev[0], prev_gate=prev[1])
    assert out.shape == (groups, d) and not out.isnan().any()
    assert (out.float() - expected).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("overlapping", [True, False])
def test_the_engine_compressors_entries_from_the_kernels_pooling(overlapping: bool, device: str) -> None:
    """Two updates of the engine's Compressor (13 rows, then 11): its entries equal the kernel's
    pooling of the same projected rows (carrying the previous group across the calls), normed
    and rotated as the module does."""
    torch.manual_seed(0)
    spec = CompressorSpec(ratio=4, head_dim=64, overlapping=overlapping)
    module = Compressor(96, spec, rope_dim=16, rope_theta=10000.0, eps=1e-6).to(device)
    with torch.no_grad():
        module.position_bias.normal_()
        module.kv_norm.weight.normal_()
        state = CompressorState.empty(spec, torch.float32, torch.device(device))
        x = torch.randn(24, 96, device=device)
        module.update(x[:13], state)
        module.update(x[13:], state)
        kv, gate = module.kv_proj(x), module.gate_proj(x)
        pooled = compress_pool(kv, gate, module.position_bias, overlapping=overlapping)
        positions = torch.arange(pooled.shape[0], device=device) * 4
        cos, sin = rope_cos_sin(positions, 16, 10000.0)
        entries = apply_rope(module.kv_norm(pooled), cos, sin)
    assert entries.shape == state.entries.shape == (6, 64)
    assert (entries - state.entries).abs().max().item() <= TOLERANCE[torch.float32]


def test_decode_steps_pool_what_a_prefill_pools(device: str) -> None:
    """Token by token through a static pending buffer, carrying prev: the same entries."""
    ratio, d = 4, 64
    kv, gate = rows(12, 2 * d, torch.float32, device, seed=5)
    bias = torch.randn((ratio, 2 * d), generator=torch.Generator().manual_seed(6)).to(device)
    pending_kv = torch.full((ratio, 2 * d), float("nan"), device=device)
    pending_gate = torch.full((ratio, 2 * d), float("nan"), device=device)
    prev: tuple[torch.Tensor, torch.Tensor] | tuple[None, None] = (None, None)
    entries = []
    for t in range(12):
        entry = compressor_decode_step(kv[t], gate[t], pending_kv, pending_gate, t % ratio, bias, overlapping=True, prev_kv=prev[0], prev_gate=prev[1])
        if entry is None:
            assert (t + 1) % ratio
            continue
        entries.append(entry)
        prev = (pending_kv[:, :d].clone(), pending_gate[:, :d].clone())
    assert torch.allclose(torch.cat(entries), compress_pool(kv, gate, bias, overlapping=True), atol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("not whole groups", "not whole groups of 4"),
        ("bias dtype", "bias must be a contiguous float32"),
        ("prev alone", "go together"),
        ("prev for HCA", "only an overlapping compressor"),
        ("odd width", "rows are 2 D wide"),
    ],
)
def test_the_launcher_refuses_bad_arguments(change: str, message: str, device: str) -> None:
    kv, gate = rows(8, 128, torch.float32, device, seed=1)
    bias = torch.zeros((4, 128), device=device)
    kwargs: dict[str, object] = {"overlapping": True}
    if change == "not whole groups":
        kv, gate = kv[:7], gate[:7]
    elif change == "bias dtype":
        bias = bias.half()
    elif change == "prev alone":
        kwargs["prev_kv"] = torch.zeros((4, 64), device=device)
    elif change == "prev for HCA":
        kwargs.update(overlapping=False, prev_kv=torch.zeros((4, 64), device=device), prev_gate=torch.zeros((4, 64), device=device))
    elif change == "odd width":
        kv, gate, bias = kv[:, :127], gate[:, :127], bias[:, :127].contiguous()
    with pytest.raises(ValueError, match=message):
        compress_pool(kv, gate, bias, **kwargs)  # type: ignore[arg-type]
