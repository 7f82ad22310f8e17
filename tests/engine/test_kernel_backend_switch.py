"""The kernel backend switch: how a backend is chosen and refused, which layers it reaches, and
the dense state's page view (the Triton path's parity is in tests/kernels/test_engine_backend.py)."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.model.kernel_backend import resolve_kernel_backend, set_kernel_backend
from engine.model.state import PAGE_TOKENS, as_pages

CPU = torch.device("cpu")


def test_auto_picks_torch_on_cpu_and_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_kernel_backend("auto", CPU, 16) == "torch"
    assert resolve_kernel_backend("torch", CPU, 24) == "torch"  # torch walks any page size
    assert resolve_kernel_backend("auto", torch.device("cuda"), 16) == "triton"
    assert resolve_kernel_backend("auto", torch.device("cuda"), 24) == "torch"  # a page the kernels cannot walk


@pytest.mark.parametrize(
    ("name", "page", "interpret", "message"),
    [
        ("cutlass", 16, "1", "expected one of auto, torch, triton"),
        ("triton", 16, None, "needs Triton's interpreter: set TRITON_INTERPRET=1"),
        ("triton", 24, "1", "unit_tokens a power of two >= 16"),
        ("triton", 8, "1", "unit_tokens a power of two >= 16"),
    ],
)
def test_a_backend_that_cannot_run_is_refused_clearly(
    name: str, page: int, interpret: str | None, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    with pytest.raises(ValueError, match=message):
        resolve_kernel_backend(name, CPU, page)


def test_the_engine_refuses_triton_on_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM("kvscope_hybrid-tiny", device="cpu", kernel_backend="triton")
    llm = LLM("kvscope_hybrid-tiny", device="cpu")
    assert llm.kernel_backend == "torch"


def test_the_switch_reaches_every_mixer_of_each_family() -> None:
    for model in ("kvscope_hybrid-tiny", "qwen3_next-tiny", "deepseek_v4-tiny"):
        llm = LLM(model, device="cpu", kernel_backend="torch")
        kinds = llm.layout.layer_types
        # one per mixer, plus the compressors of CSA (KV and indexer) and HCA (KV) layers, plus
        # every sparse MoE block (Qwen3-Next's routed experts)
        moe = sum(1 for m in llm.model.modules() if type(m).__name__ == "Qwen3NextSparseMoe")
        assert moe == (len(kinds) if model == "qwen3_next-tiny" else 0)
        count = len(kinds) + 2 * kinds.count("compressed_sparse_attention") + kinds.count("heavily_compressed_attention") + moe
        assert count > len(kinds)  # compressors or MoE blocks besides the mixers
        reached = set_kernel_backend(llm.model, "torch")
        assert reached == count, (model, reached, kinds)
        assert {m.kernel_backend for m in llm.model.modules() if hasattr(m, "kernel_backend")} == {"torch"}


def test_dense_keys_are_viewed_as_zero_padded_pages() -> None:
    keys = torch.randn(2 * PAGE_TOKENS + 3, 2, 8)
    values = torch.randn(2 * PAGE_TOKENS + 3, 2, 8)
    pages = as_pages(keys, values)
    assert pages.num_tokens == keys.shape[0]
    assert pages.k_cache.shape == (3, PAGE_TOKENS, 2, 8)
    assert pages.block_table.tolist() == [[0, 1, 2]] and pages.block_table.dtype == torch.int32
    assert torch.equal(pages.k_cache.reshape(-1, 2, 8)[: keys.shape[0]], keys)
    assert torch.equal(pages.v_cache.reshape(-1, 2, 8)[: keys.shape[0]], values)
    assert not pages.k_cache.reshape(-1, 2, 8)[keys.shape[0] :].any()
