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
import kernels.gated_delta_rule
import kernels.indexer_topk
import kernels.paged_decode_attention
import kernels.paged_prefill_attention
import kernels.sparse_compressed_attention
from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.helpers import TOLERANCE

LAUNCHERS = [
    (kernels.paged_prefill_attention, "paged_prefill_attention"),
    (kernels.paged_decode_attention, "paged_decode_attention"),
    (kernels.gated_delta_rule, "chunk_gated_delta_rule"),
    (kernels.gated_delta_rule, "fused_recurrent_gated_delta_rule"),
    (kernels.gated_delta_rule, "causal_conv1d_update"),
    (kernels.compressor, "compress_pool"),
    (kernels.indexer_topk, "indexer_topk"),
    (kernels.sparse_compressed_attention, "sparse_compressed_attention"),
]
USES = {
    "kvscope_hybrid-tiny": {name for _, name in LAUNCHERS},  # linear, sliding, CSA, full and HCA layers
    "qwen3_next-tiny": {
        "paged_prefill_attention",
        "paged_decode_attention",
        "chunk_gated_delta_rule",
        "fused_recurrent_gated_delta_rule",
        "causal_conv1d_update",
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
            return _original(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(module, name, counted)
    yield calls


def run(model: str, device: str, backend: str) -> dict[str, object]:
    """A cold prompt of 70 tokens, then a 96-token prompt sharing its first 64 (a prefix-cache
    hit), then 3 greedy tokens decoded after it."""
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 256, (70,), generator=gen).tolist()
    extended = prompt[:64] + torch.randint(0, 256, (32,), generator=gen).tolist()
    llm = LLM(model, device=device, kernel_backend=backend, check_invariants=True)
    assert llm.kernel_backend == backend
    cold = llm.score(prompt)
    warm = llm.score(extended)
    decode_logits: list[torch.Tensor] = []
    step = llm._decode_step

    def recorded(seq: object, token: int) -> torch.Tensor:
        logits = step(seq, token)  # type: ignore[arg-type]
        decode_logits.append(logits.clone())
        return logits

    llm._decode_step = recorded  # type: ignore[method-assign]
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
    assert triton_run["resume"] == torch_run["resume"] == 64  # the hit, on both backends
    tol = TOLERANCE[torch.float32]
    for key in ("cold", "warm", "decode", "reference"):
        a, b = torch_run[key], triton_run[key]
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        assert (a - b).abs().max().item() <= tol, key
    # warm equals cold on the kernels too: the resumed logits are the full recompute's tail
    warm, reference = triton_run["warm"], triton_run["reference"]
    assert isinstance(warm, torch.Tensor) and isinstance(reference, torch.Tensor)
    assert (warm - reference[64:]).abs().max().item() <= tol
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
