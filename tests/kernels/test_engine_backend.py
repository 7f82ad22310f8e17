"""The engine on the Triton backend: the same layers (a switch, not a copy of the model) run their
attention, gated delta rule, causal conv, compressor pooling, indexer top-k and sparse attention
through ``kernels/`` and match the torch path's logits — cold, on a prefix-cache hit, and while
decoding — for every model family. On CPU this runs under ``TRITON_INTERPRET=1``; the ``gpu``
test runs the same on CUDA wherever a GPU exists."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

import kernels.compressor
import kernels.fused_moe
import kernels.gated_delta_rule
import kernels.indexer_topk
import kernels.paged_decode_attention
import kernels.paged_prefill_attention
import kernels.sparse_compressed_attention
from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.helpers import BACKEND_PARITY, NO_COMPRESSED, TOLERANCE, qwen3_next_dense

LAUNCHERS = [
    (kernels.paged_prefill_attention, "paged_prefill_attention"),
    (kernels.paged_decode_attention, "paged_decode_attention"),
    (kernels.gated_delta_rule, "chunk_gated_delta_rule"),
    (kernels.gated_delta_rule, "fused_recurrent_gated_delta_rule"),
    (kernels.gated_delta_rule, "causal_conv1d_update"),
    (kernels.compressor, "compress_pool"),
    (kernels.indexer_topk, "indexer_topk"),
    (kernels.sparse_compressed_attention, "sparse_compressed_attention"),
    (kernels.fused_moe, "fused_moe"),
]
USES = {
    "kvscope_hybrid-tiny": {name for _, name in LAUNCHERS} - {"fused_moe"},  # linear, sliding, CSA, full and HCA layers
    "qwen3_next-tiny": {
        "paged_prefill_attention",
        "paged_decode_attention",
        "chunk_gated_delta_rule",
        "fused_recurrent_gated_delta_rule",
        "causal_conv1d_update",
        "fused_moe",
    },
    "deepseek_v4-tiny": {"compress_pool", "indexer_topk", "sparse_compressed_attention"},
}
"""The kernels each family must reach."""


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts every kernel launcher call (the backend imports them at call time)."""
    calls: Counter[str] = Counter()
    for module, name in LAUNCHERS:
        original = getattr(module, name)

        @functools.wraps(original)
        def counted(
            *args: object, _name: str = name, _original: object = original, **kwargs: object
        ) -> object:
            calls[_name] += 1
            if _name == "chunk_gated_delta_rule" and bool(args[5].any()):  # type: ignore[attr-defined]
                calls["chunk_gated_delta_rule from a saved state"] += 1
            return _original(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(module, name, counted)
    yield calls


def run(model: str, device: str, backend: str) -> dict[str, object]:
    """A cold prompt of 70 tokens, then a 104-token prompt sharing its first 64 (a prefix-cache
    hit whose 40 new tokens take the chunked delta rule from the restored state), then 3 greedy
    tokens decoded after it."""
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 256, (70,), generator=gen).tolist()
    extended = prompt[:64] + torch.randint(0, 256, (40,), generator=gen).tolist()
    llm = LLM(model, device=device, kernel_backend=backend, check_invariants=True)
    assert llm.kernel_backend == backend
    cold = llm.score(prompt)
    warm = llm.score(extended)
    decode_logits: list[torch.Tensor] = []
    step = llm.lifecycle.decode_step

    def recorded(seq: object, token: int) -> torch.Tensor:
        logits = step(seq, token)  # type: ignore[arg-type]
        decode_logits.append(logits.clone())
        return logits

    llm.lifecycle.decode_step = recorded  # type: ignore[method-assign]
    generated = llm.generate([[*extended, 7]], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert len(decode_logits) == 2  # the first token comes from the prefill's last logits
    return {
        "decode": torch.stack(decode_logits),
        "cold": cold.logits,
        "warm": warm.logits,
        "resume": warm.cache.plan.resume_tokens,
        "tokens": generated.output_token_ids,
        "reference": llm.prefill_logits(extended),
    }


def check_parity(model: str, device: str, calls: Counter[str]) -> None:
    torch_run = run(model, device, "torch")
    assert not calls, f"the torch backend launched kernels: {dict(calls)}"
    triton_run = run(model, device, "triton")
    assert USES[model] <= set(calls), f"kernels never launched: {USES[model] - set(calls)}"
    if "chunk_gated_delta_rule" in USES[model]:
        assert calls["chunk_gated_delta_rule from a saved state"], "the chunked kernel never resumed a checkpoint"
    assert triton_run["resume"] == torch_run["resume"] == 64  # the hit, on both backends
    for key in ("cold", "warm", "decode", "reference"):
        a, b = torch_run[key], triton_run[key]
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        assert (a - b).abs().max().item() <= BACKEND_PARITY, key
    # warm equals cold on the kernels too: the resumed logits are the full recompute's tail
    warm, reference = triton_run["warm"], triton_run["reference"]
    assert isinstance(warm, torch.Tensor) and isinstance(reference, torch.Tensor)
    assert (warm - reference[64:]).abs().max().item() <= TOLERANCE[torch.float32]
    assert triton_run["tokens"] == torch_run["tokens"]


@pytest.mark.parametrize("model", sorted(USES))
def test_the_triton_backend_matches_the_torch_path(
    model: str, device: str, launches: Counter[str]
) -> None:
    check_parity(model, device, launches)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the interpreter test above covers CPU)"
)
def test_the_cuda_path_uses_the_kernels_and_matches(launches: Counter[str]) -> None:
    for model in sorted(USES):
        launches.clear()
        check_parity(model, "cuda", launches)
    assert (
        LLM("qwen3_next-tiny", device="cuda").kernel_backend == "triton"
    )  # auto picks the kernels on CUDA


@pytest.mark.parametrize("max_keys", [None, 4])
def test_the_indexer_choice_is_the_same_on_both_sides_of_the_kernel_sort_limit(
    max_keys: int | None, device: str, monkeypatch: pytest.MonkeyPatch, launches: Counter[str]
) -> None:
    """Beyond ``MAX_KEYS`` index keys (one program sorts a row) the Triton backend ranks with
    torch; either way it picks what the torch path's ``select`` picks."""
    if max_keys is not None:
        monkeypatch.setattr(kernels.indexer_topk, "MAX_KEYS", max_keys)
    llm = LLM("deepseek_v4-tiny", device=device, kernel_backend="torch")
    indexer = llm.model.model.layers[1].self_attn.compressor.indexer
    g = torch.Generator().manual_seed(3)
    t, n = 8, 10
    x = torch.randn((t, indexer.scorer.weights_proj.in_features), generator=g).to(device)
    q_residual = torch.randn((t, indexer.q_b_proj.in_features), generator=g).to(device)
    positions = torch.arange(4 * n - t, 4 * n, device=device)
    keys = torch.randn((n, indexer.spec.head_dim), generator=g).to(device)
    with torch.no_grad():
        want = indexer.select(x, q_residual, positions, keys)
        indices, valid = indexer.select_topk(x, q_residual, positions, keys)
    assert indices.dtype == torch.int32 and valid.any()
    assert torch.equal(kernels.indexer_topk.chosen_mask(indices, valid, n), want)
    assert launches["indexer_topk"] == (1 if max_keys is None else 0)


@pytest.mark.parametrize("model", ["qwen3_next-tiny", "qwen3_next-dense", "kvscope_hybrid-tiny", "hybrid-linear-sliding-full"])
def test_the_runtime_decodes_through_the_kernels_in_padded_batches(model: str, device: str, launches: Counter[str]) -> None:
    """The runtime's static decode batches (padded to 4, decode slots) on the Triton backend give
    the torch backend's logits. Besides DeepSeek-V4's per-row layers, the Triton steps run as a
    CUDA graph capture records them (launchers without host reads, the MoE through ``fused_moe``,
    checked by ``forbid_host_sync``); on CUDA they are captured graphs, replayed."""
    from engine.runtime import Runtime, SchedulerConfig
    from engine.runtime.cuda_graphs import graph_unsafe_reason

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (40 + 7 * i,), generator=gen).tolist() for i in range(3)]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    rows: dict[str, list[torch.Tensor]] = {}
    for backend in ("torch", "triton"):
        configs = {"qwen3_next-dense": qwen3_next_dense(), "hybrid-linear-sliding-full": NO_COMPRESSED}
        llm = LLM(configs.get(model, model), device=device, kernel_backend=backend, check_invariants=True)
        capturable = graph_unsafe_reason(llm.model) is None
        # through the kernels, Qwen3-Next's MoE too (fused_moe); on torch, only without the MoE
        assert capturable == (model in configs or (backend == "triton" and model == "qwen3_next-tiny"))
        runtime = Runtime(llm, SchedulerConfig(max_num_seqs=4), decode_batch_sizes=(4,), check_graph_safe=capturable and backend == "triton")
        assert runtime.decode_runner is not None
        assert bool(runtime.decode_runner.graphs) == (capturable and device == "cuda" and backend == "triton")  # auto: kernels only
        added = [runtime.add_request(p, params, keep_logits=True) for p in prompts]
        runtime.run()
        rows[backend] = [row for r in added for row in r.sampled_logits]
    assert launches["paged_decode_attention"] and launches["fused_recurrent_gated_delta_rule"] and launches["causal_conv1d_update"]
    if model == "kvscope_hybrid-tiny":  # its DeepSeek-V4 layers (prefill, and per row in the decode batches)
        assert launches["sparse_compressed_attention"]
    assert bool(launches["fused_moe"]) == (model == "qwen3_next-tiny")
    for a, b in zip(rows["torch"], rows["triton"], strict=True):
        assert (a - b).abs().max().item() <= BACKEND_PARITY


def test_a_launcher_reading_device_values_fails_the_capture_check(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture check sees the launchers: with their host reads back on (``graph_safe``
    false), the first decode step (or, on CUDA, the capture) raises."""
    from engine.runtime import Runtime, SchedulerConfig
    from engine.runtime.cuda_graphs import HostSyncError

    monkeypatch.setattr(kernels.paged_decode_attention, "graph_safe", lambda *tensors: False)
    with pytest.raises(HostSyncError, match="__int__"):
        llm = LLM(qwen3_next_dense(), device=device, kernel_backend="triton")
        runtime = Runtime(llm, SchedulerConfig(max_num_seqs=2), decode_batch_sizes=(2,), check_graph_safe=True)
        runtime.add_request(list(range(1, 30)), SamplingParams(max_tokens=2, temperature=0.0))
        runtime.run()
