"""Achieved bandwidth or compute rate of every Triton kernel, against the device's own measured
copy bandwidth and matrix rate, and against torch on the same shapes, in one run.

For each kernel of ``kernels/`` the benchmark builds one serving-sized case (fp16 inputs where
the kernel takes them), times the kernel and its torch counterpart on the same tensors (CUDA:
``triton.testing.do_bench``, median of repeated launches after warm-up) and reports:

* ``kernel_ms`` / ``torch_ms`` and ``speedup_vs_torch`` (torch time / kernel time); torch is
  SDPA on dense KV for the attention kernels, ``index_select`` for the block copy, a vectorised
  one-token step for the recurrent rule and the conv update, and the kernel's plain-torch
  reference (``<name>_ref``, or the engine's torch path) elsewhere;
* for memory-bound kernels ``gb_per_s`` (bytes the kernel must read and write / time) and
  ``fraction_of_copy_bandwidth``; for compute-bound ones (the chunked delta rule counted by its
  matrix products: :func:`chunk_flops`) ``tflop_per_s`` (useful FLOPs / time)
  and ``fraction_of_matrix_rate`` against the fp16 tensor-core rate and against the fp32
  (no TF32) rate — the kernels multiply in fp32 (``input_precision="ieee"``), so the second is
  their real ceiling;
* ``max_abs_diff`` between the kernel's and torch's results (the figures come from a correct run).

Device figures: ``copy_gb_per_s`` (``Tensor.copy_`` of 1 GiB, read + write) and
``matrix_tflop_per_s_fp16`` / ``_fp32`` (``torch.matmul`` of 8192², 2·n³ FLOPs).

Prints one JSON object. Without a CUDA GPU the full run is skipped (the JSON says why);
``--smoke`` runs every case at toy sizes on whatever runs the kernels (CUDA, or the CPU under
``TRITON_INTERPRET=1``) to check the harness — its times mean nothing.

Run: ``python -m benchmarks.kernels [--smoke]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.compressor import compress_pool, compress_pool_ref
from kernels.gated_delta_rule import (
    CHUNK,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)
from kernels.gated_delta_rule_torch import chunk_gated_delta_rule as engine_chunk_rule
from kernels.gated_delta_rule_torch import l2norm
from kernels.indexer_topk import indexer_topk, indexer_topk_ref
from kernels.kv_block_copy import copy_blocks
from kernels.paged_decode_attention import paged_decode_attention
from kernels.paged_prefill_attention import paged_prefill_attention
from kernels.sparse_compressed_attention import (
    sparse_compressed_attention,
    sparse_compressed_attention_ref,
)


@dataclass
class Case:
    """One kernel on one shape: the two timed callables, its work, and ``check`` (when the timed
    kernel updates its input in place: a run on fresh inputs, for the comparison)."""

    name: str
    shape: dict[str, int]
    kernel: Callable[[], Any]
    torch_fn: Callable[[], Any]
    torch_is: str
    bytes_moved: int = 0
    flops: int = 0
    check: Callable[[], Any] | None = None


def timed_ms(fn: Callable[[], Any], device: torch.device, smoke: bool) -> float:
    if device.type == "cuda" and not smoke:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()  # compile / warm
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def device_rates(device: torch.device, smoke: bool) -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write) and matrix rates (TFLOP/s) measured here."""
    elems = (1 << 16) if smoke else (1 << 29)  # 1 GiB of fp16 on a GPU
    src = torch.ones(elems, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    copy_ms = timed_ms(lambda: dst.copy_(src), device, smoke)
    n = 256 if smoke else 8192
    rates = {"copy_gb_per_s": 2 * src.numel() * 2 / copy_ms / 1e6}
    for dtype, key in (
        (torch.float16, "matrix_tflop_per_s_fp16"),
        (torch.float32, "matrix_tflop_per_s_fp32"),
    ):
        a = torch.randn((n, n), device=device).to(dtype)
        b = torch.randn((n, n), device=device).to(dtype)
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            rates[key] = 2 * n**3 / timed_ms(lambda a=a, b=b: a @ b, device, smoke) / 1e9
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
    return rates


def cases(device: torch.device, smoke: bool) -> list[Case]:
    g = torch.Generator(device="cpu").manual_seed(0)
    half = torch.float16

    def randn(*shape: int, dtype: torch.dtype = half, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * scale).to(dtype=dtype, device=device)

    out: list[Case] = []

    # kv_block_copy: swap-out gather of N pool blocks ([layers, 2, U, H_kv, D] each) to staging
    blocks, n_copy, layers = (8, 4, 2) if smoke else (4096, 1024, 4)
    pool = randn(blocks, layers, 2, 16, 8, 128)
    staging = torch.full((n_copy, *pool.shape[1:]), float("nan"), dtype=half, device=device)
    torch_staging = torch.empty_like(staging)  # apart, so the comparison sees both copies
    ids = torch.randperm(blocks, generator=g)[:n_copy].to(device)
    rows = torch.arange(n_copy, device=device)
    block_bytes = pool[0].numel() * 2
    out.append(Case(
        "kv_block_copy", {"blocks": n_copy, "block_bytes": block_bytes},
        lambda: (copy_blocks(pool, staging, ids, rows), staging)[1],
        lambda: torch.index_select(pool, 0, ids, out=torch_staging), "torch.index_select",
        bytes_moved=2 * n_copy * block_bytes,
    ))  # fmt: skip

    def paged(n: int, length: int, h_kv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """K and V pools of ``n`` sequences of ``length`` tokens in shuffled pages of 16 (block 0
        the sentinel), their block tables ``[n, pages]`` int32, seq_lens, and the same keys and
        values dense ``[n, H_kv, L, D]`` for SDPA."""
        pages = math.ceil(length / 16)
        k_pool, v_pool = randn(n * pages + 1, 16, h_kv, d), randn(n * pages + 1, 16, h_kv, d)
        tables = (torch.randperm(n * pages, generator=g) + 1).view(n, pages).to(torch.int32).to(device)
        lens = torch.full((n,), length, dtype=torch.int32, device=device)
        dense_k, dense_v = (pool[tables.long()].reshape(n, -1, h_kv, d)[:, :length].transpose(1, 2).contiguous() for pool in (k_pool, v_pool))
        return k_pool, v_pool, tables, lens, dense_k, dense_v

    # paged decode: B sequences of L tokens, GQA 32/8, D 128, pages of 16
    b, length, h_q, h_kv, d = (2, 40, 4, 2, 64) if smoke else (64, 2048, 32, 8, 128)
    k_cache, v_cache, tables, lens, dense_k, dense_v = paged(b, length, h_kv, d)
    q = randn(b, h_q, d)
    scale = d**-0.5
    out.append(Case(
        "paged_decode_attention", {"batch": b, "seq_len": length, "heads_q": h_q, "heads_kv": h_kv, "head_dim": d, "page": 16},
        lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale=scale),
        lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], dense_k, dense_v, scale=scale, enable_gqa=True)[:, :, 0],
        "SDPA on dense KV (no paging)", bytes_moved=2 * b * length * h_kv * d * 2 + 2 * q.numel() * 2,
    ))  # fmt: skip

    # paged prefill: N chunks of n new tokens on prefixes, L tokens per sequence in all
    n_seq, chunk, length = (2, 20, 40) if smoke else (4, 512, 4096)
    kp, vp, ptables, plens, pk, pv = paged(n_seq, length, h_kv, d)
    cu = torch.arange(0, (n_seq + 1) * chunk, chunk, dtype=torch.int32, device=device)
    qp = randn(n_seq * chunk, h_q, d)
    qpos = torch.arange(length - chunk, length, device=device)
    mask = torch.arange(length, device=device)[None, :] <= qpos[:, None]
    visible = sum(length - chunk + i + 1 for i in range(chunk))
    out.append(Case(
        "paged_prefill_attention", {"sequences": n_seq, "chunk": chunk, "seq_len": length, "heads_q": h_q, "heads_kv": h_kv, "head_dim": d},
        lambda: paged_prefill_attention(qp, kp, vp, ptables, plens, cu, scale=scale),
        lambda: torch.nn.functional.scaled_dot_product_attention(
            qp.view(n_seq, chunk, h_q, d).transpose(1, 2), pk, pv, attn_mask=mask, scale=scale, enable_gqa=True
        ).transpose(1, 2).reshape(-1, h_q, d),
        "SDPA on dense KV with a causal mask", flops=4 * n_seq * visible * h_q * d,
    ))  # fmt: skip

    # compressor: CSA-style overlapping pooling, ratio 4, D 512 (rows 2 D wide)
    groups, ratio, cd = (4, 4, 64) if smoke else (4096, 4, 512)
    ckv = randn(groups * ratio, 2 * cd)
    cgate = randn(groups * ratio, 2 * cd)
    bias = randn(ratio, 2 * cd, dtype=torch.float32, scale=0.1)
    out.append(Case(
        "compressor", {"groups": groups, "ratio": ratio, "head_dim": cd},
        lambda: compress_pool(ckv, cgate, bias, overlapping=True),
        lambda: compress_pool_ref(ckv, cgate, bias, overlapping=True), "compress_pool_ref (fp32 torch)",
        bytes_moved=2 * ckv.numel() * 2 + groups * cd * 2,
    ))  # fmt: skip

    # indexer top-k: T queries against N index keys, H_I heads of D_I, k picks
    t, n_keys, h_i, d_i, top = (8, 40, 4, 32, 8) if smoke else (256, 4096, 64, 128, 512)
    iq = randn(t, h_i, d_i)
    ikeys = randn(n_keys, d_i)
    iweights = randn(t, h_i, dtype=torch.float32)
    ipos = torch.arange(n_keys * 4 - t, n_keys * 4, device=device)
    out.append(Case(
        "indexer_topk", {"queries": t, "keys": n_keys, "heads": h_i, "head_dim": d_i, "k": top},
        lambda: indexer_topk(iq, ikeys, iweights, ipos, ratio=4, k=top, scale=d_i**-0.5)[1:],
        lambda: indexer_topk_ref(iq, ikeys, iweights, ipos, ratio=4, k=top, scale=d_i**-0.5)[1:], "indexer_topk_ref (torch, stable sort)",
        flops=2 * t * n_keys * h_i * d_i,
    ))  # fmt: skip

    # sparse compressed attention (CSA): window W rows plus k selected of N entries, H heads of D
    t, h, sd, window, n_entries, top = (
        (4, 4, 64, 8, 16, 4) if smoke else (256, 64, 512, 128, 4096, 512)
    )
    sq = randn(t, h, sd, scale=0.1)
    positions = torch.arange(n_entries * 4 - t, n_entries * 4, device=device)
    wpos = torch.arange(int(positions[0]) - window + 1, int(positions[-1]) + 1, device=device)
    wkv = randn(wpos.numel(), sd)
    entries = randn(n_entries, sd)
    sel = (
        torch.stack([torch.randperm(n_entries, generator=g)[:top] for _ in range(t)])
        .to(torch.int32)
        .to(device)
    )
    valid = torch.ones_like(sel, dtype=torch.bool)
    sinks = randn(h, dtype=torch.float32)
    out.append(Case(
        "sparse_compressed_attention", {"queries": t, "heads": h, "head_dim": sd, "window": window, "entries": n_entries, "k": top},
        lambda: sparse_compressed_attention(sq, wkv, wpos, entries, positions, sinks, scale=sd**-0.5, window=window, indices=sel, valid=valid),
        lambda: sparse_compressed_attention_ref(sq, wkv, wpos, entries, positions, sinks, scale=sd**-0.5, window=window, indices=sel, valid=valid),
        "sparse_compressed_attention_ref (dense masked torch)", flops=4 * t * h * sd * (window + top),
    ))  # fmt: skip

    # gated delta rule, chunked prefill: N sequences of T tokens, H heads, D_k = D_v
    n_seq, length, h, dk = (2, 40, 2, 32) if smoke else (2, 4096, 16, 128)
    total = n_seq * length
    gq = l2norm(randn(total, h, dk, dtype=torch.float32)).to(half)
    gk = l2norm(randn(total, h, dk, dtype=torch.float32)).to(half)
    gv = randn(total, h, dk)
    gg = (-torch.rand((total, h), generator=g) * 0.1).to(half).to(device)
    gb = torch.rand((total, h), generator=g).to(half).to(device)
    state = torch.zeros((n_seq, h, dk, dk), device=device)
    gcu = torch.arange(0, total + 1, length, dtype=torch.int32, device=device)

    def engine_chunked() -> torch.Tensor:
        return torch.cat([engine_chunk_rule(gq[a:a + length], gk[a:a + length], gv[a:a + length], gg[a:a + length], gb[a:a + length], state[i])[0]
                          for i, a in enumerate(range(0, total, length))])  # fmt: skip

    out.append(Case(
        "gated_delta_rule_chunked", {"sequences": n_seq, "seq_len": length, "heads": h, "head_dim": dk},
        lambda: chunk_gated_delta_rule(gq, gk, gv, gg, gb, state, gcu)[0], engine_chunked,
        "the engine's torch chunk_gated_delta_rule", flops=n_seq * math.ceil(length / CHUNK) * h * chunk_flops(CHUNK, dk, dk),
    ))  # fmt: skip

    # gated delta rule, decode: B sequences, one token each, fp32 state [H, D_k, D_v] in place
    b, h, dk = (4, 2, 32) if smoke else (256, 16, 128)
    rq = l2norm(randn(b, h, dk, dtype=torch.float32)).to(half)
    rk = l2norm(randn(b, h, dk, dtype=torch.float32)).to(half)
    rv = randn(b, h, dk)
    rg = (-torch.rand((b, h), generator=g) * 0.1).to(half).to(device)
    rb = torch.rand((b, h), generator=g).to(half).to(device)
    rstate = randn(b, h, dk, dk, dtype=torch.float32, scale=0.1)
    rcu = torch.arange(b + 1, dtype=torch.int32, device=device)

    def torch_step() -> torch.Tensor:
        s = rstate * rg.float().exp()[..., None, None]
        delta = (rv.float() - torch.einsum("bhk,bhkv->bhv", rk.float(), s)) * rb.float()[..., None]
        s = s + rk.float()[..., :, None] * delta[..., None, :]
        return torch.einsum("bhk,bhkv->bhv", rq.float() * dk**-0.5, s)

    out.append(Case(
        "gated_delta_rule_recurrent", {"batch": b, "heads": h, "head_dim": dk},
        lambda: fused_recurrent_gated_delta_rule(rq, rk, rv, rg, rb, rstate, rcu)[0],
        torch_step, "a vectorised torch step", bytes_moved=2 * rstate.numel() * 4,
    ))  # fmt: skip

    # causal conv decode step: B rows of C channels, kernel width 4, state updated in place
    b, c, width = (4, 70, 4) if smoke else (256, 8192, 4)
    x = randn(b, c)
    weight = randn(c, width)
    conv_state = randn(b, c, width - 1)
    scratch_state = conv_state.clone()  # the timed runs shift this one in place

    def torch_conv() -> torch.Tensor:
        window_rows = torch.cat((conv_state, x[:, :, None]), dim=2)
        return torch.nn.functional.silu((window_rows * weight).sum(-1))

    out.append(Case(
        "causal_conv1d_update", {"batch": b, "channels": c, "width": width},
        lambda: causal_conv1d_update(x, weight, scratch_state), torch_conv, "a vectorised torch step",
        bytes_moved=b * c * 2 * (1 + 2 * (width - 1) + 1), check=lambda: causal_conv1d_update(x, weight, conv_state.clone()),
    ))  # fmt: skip

    out.append(moe_case(device, smoke, g, randn))
    return out


def moe_case(device: torch.device, smoke: bool, g: torch.Generator, randn: Callable[..., torch.Tensor]) -> Case:
    """Fused MoE: a decode batch of T tokens routed to k of E SwiGLU experts (Qwen3-Next's
    shape); torch: the engine's experts (one product per chosen expert over its tokens)."""
    from engine.model.qwen3_next_moe import Qwen3NextExperts
    from kernels.fused_moe import fused_moe

    t, k, e, c, i = (5, 2, 4, 64, 32) if smoke else (64, 10, 512, 2048, 512)
    x = randn(t, c)
    experts = Qwen3NextExperts(e, c, i).to(device=device, dtype=torch.float16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(randn(e, 2 * i, c, scale=0.05))
        experts.down_proj.copy_(randn(e, c, i, scale=0.05))
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    weights = torch.rand((t, k), generator=g).to(torch.float16).to(device)
    chosen = int(ids.unique().numel())

    def torch_moe() -> torch.Tensor:
        with torch.no_grad():
            return experts(x, ids, weights)

    return Case(
        "fused_moe", {"tokens": t, "top_k": k, "experts": e, "hidden": c, "intermediate": i},
        lambda: fused_moe(x, experts.gate_up_proj.detach(), experts.down_proj.detach(), ids, weights), torch_moe,
        "the engine's torch experts (per chosen expert)", bytes_moved=chosen * 3 * i * c * 2,  # decode: the weights read
    )  # fmt: skip


def chunk_flops(c: int, dk: int, dv: int) -> int:
    """Useful FLOPs of one chunk of ``c`` tokens of one head of the chunked delta rule:
    ``A = K Kᵀ``, ``(I + A)⁻¹`` by substitution (c³), ``X (βV)``, ``X (βK)``, ``W S``, ``Q Kᵀ``,
    ``Q S``, ``(QKᵀ) U`` and ``Kᵀ U`` (a multiply-add is two)."""
    return 6 * c * c * dk + 4 * c * c * dv + 6 * c * dk * dv + c**3


def diff(a: Any, b: Any) -> float:
    if isinstance(a, tuple):
        return max(diff(x, y) for x, y in zip(a, b, strict=True))
    if a.dtype in (torch.bool, torch.int32, torch.int64):
        return float((a.long() != b.long()).sum().item())  # mismatching indices or flags
    return float((a.float() - b.float()).abs().max().item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="toy sizes, to check the harness (times mean nothing)"
    )
    args = parser.parse_args()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    device = torch.device("cuda" if torch.cuda.is_available() and not interpreted else "cpu")
    result: dict[str, Any] = {
        "benchmark": "kernels",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "smoke": args.smoke,
    }
    if device.type != "cuda" and not (args.smoke and interpreted):
        result["skipped"] = (
            "needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1 to check the harness)"
        )
        print(json.dumps(result))
        return
    rates = device_rates(device, args.smoke)
    result |= rates
    rows = []
    for case in cases(device, args.smoke):
        print(f"{case.name} ...", file=sys.stderr)
        row: dict[str, Any] = {"kernel": case.name, "shape": case.shape, "torch": case.torch_is}
        row["max_abs_diff"] = diff((case.check or case.kernel)(), case.torch_fn())
        row["kernel_ms"] = timed_ms(case.kernel, device, args.smoke)
        row["torch_ms"] = timed_ms(case.torch_fn, device, args.smoke)
        row["speedup_vs_torch"] = row["torch_ms"] / row["kernel_ms"]
        if case.bytes_moved:
            row["gb_per_s"] = case.bytes_moved / row["kernel_ms"] / 1e6
            row["fraction_of_copy_bandwidth"] = row["gb_per_s"] / rates["copy_gb_per_s"]
        if case.flops:
            row["tflop_per_s"] = case.flops / row["kernel_ms"] / 1e9
            row["fraction_of_matrix_rate_fp16"] = (
                row["tflop_per_s"] / rates["matrix_tflop_per_s_fp16"]
            )
            row["fraction_of_matrix_rate_fp32"] = (
                row["tflop_per_s"] / rates["matrix_tflop_per_s_fp32"]
            )
        rows.append(row)
    result["kernels"] = rows
    print(json.dumps(result))


if __name__ == "__main__":
    main()
