"""Tensor parallelism on CPU (gloo): a TP=2 engine computes what the TP=1 engine does (float32
≤ 1e-4) for every family, prefill and decode, through the prefix cache around every granularity
(warm = cold), while each rank holds half of the sharded weights and pools and every row-parallel
block runs exactly one all-reduce."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine import LLM, CacheConfig, SamplingParams
from engine.config import HybridConfig
from engine.events import Form
from engine.model.base import WINDOW_KINDS
from engine.model.qwen3_next_layers import Qwen3NextAttention
from tests.helpers import TOLERANCE, tokens
from tests.parallel import tp_helpers
from tests.parallel.tp_helpers import PROMPT

FAMILIES = ["kvscope_hybrid-tiny", "qwen3_next-tiny", "deepseek_v4-tiny", "deepseek_v4_moe-tiny", "qwen3_5-tiny", "qwen3_5_moe-tiny"]
CACHE = CacheConfig(unit_tokens=16, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=48)
ATOL = TOLERANCE[torch.float32]


@pytest.fixture(scope="module", params=FAMILIES)
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[LLM, LLM]]:
    ref = LLM(request.param, device="cpu", cache=CACHE)
    tp = LLM(request.param, device="cpu", cache=CACHE, tensor_parallel_size=2, check_invariants=True)
    try:
        yield ref, tp
    finally:
        tp.close()
        ref.close()


def test_prefill_logits_equal_tp1(engines: tuple[LLM, LLM]) -> None:
    ref, tp = engines
    diff = (tp.prefill_logits(PROMPT) - ref.prefill_logits(PROMPT)).abs().max().item()
    assert diff <= ATOL, f"TP=2 prefill differs from TP=1 by {diff:.3g}"


def test_decode_logits_equal_tp1(engines: tuple[LLM, LLM]) -> None:
    ref, tp = engines
    steps = tokens(12, 5)
    want = tp_helpers.decode_logits(ref, PROMPT[:37], steps)
    got = tp.on_every_rank(tp_helpers.decode_logits, PROMPT[:37], steps)[0]
    assert isinstance(got, list) and len(got) == len(want) == 13
    diff = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
    assert diff <= ATOL, f"TP=2 decode differs from TP=1 by {diff:.3g}"


def test_greedy_generation_matches_tp1(engines: tuple[LLM, LLM]) -> None:
    ref, tp = engines
    params = SamplingParams(max_tokens=10)
    assert tp.generate([PROMPT[:21]], params)[0].output_token_ids == ref.generate([PROMPT[:21]], params)[0].output_token_ids


def test_warm_equals_cold_around_every_granularity(engines: tuple[LLM, LLM]) -> None:
    ref, tp = engines
    base = tokens(130, 11)
    tp.score(base)
    resumed = []
    for n in (15, 16, 17, 31, 32, 33, 64, 65, 96, 97, 128, 129):
        ids = base[:n] + tokens(9, n)
        out = tp.score(ids)
        cold = ref.prefill_logits(ids)
        diff = (out.logits - cold[out.resume_tokens :]).abs().max().item()
        assert diff <= ATOL, f"warm TP=2 != cold TP=1 by {diff:.3g} at n = {n} (L* = {out.resume_tokens})"
        resumed.append(out.resume_tokens)
    assert max(resumed) >= 96, f"the cache resumed nowhere deep: {resumed}"
    assert all(tp.on_every_rank(tp_helpers.check_invariants))


def test_each_rank_holds_half_of_the_sharded_weights(engines: tuple[LLM, LLM]) -> None:
    ref, tp = engines
    full = tp_helpers.parameter_shapes(ref)
    ranks = tp.on_every_rank(tp_helpers.parameter_shapes)
    assert len(ranks) == 2
    total = sum(b for _, b in full.values())
    sharded = {n for n, (shape, _) in ranks[0].items() if shape != full[n][0]}
    sharded_bytes = sum(full[n][1] for n in sharded)
    assert sharded_bytes >= 0.6 * total, f"only {sharded_bytes / total:.0%} of the weights are sharded"
    for rank, shapes in enumerate(ranks):
        assert shapes.keys() == full.keys()
        held = sum(shapes[n][1] for n in sharded)
        assert held == sharded_bytes // 2, f"rank {rank} holds {held} of {sharded_bytes} sharded bytes"
        assert all(shapes[n] == full[n] for n in full if n not in sharded)  # the rest is replicated


def test_sharded_pools_hold_half_the_bytes(engines: tuple[LLM, LLM]) -> None:
    ref, tp = engines
    full = tp_helpers.pool_bytes(ref)
    ranks = tp.on_every_rank(tp_helpers.pool_bytes)
    assert ranks[0] == ranks[1] and ranks[0].keys() == full.keys()
    forms = {p.name: p.form for p in ref.cache.pool_plans()}

    def kv_elements(layout: object, kinds: tuple[str, ...] | frozenset[str]) -> int:
        return sum(h * d for i, kind in enumerate(ref.layout.layer_types) if kind in kinds for h, d in [layout.kv_shape(i)])  # type: ignore[attr-defined]

    # GQA KV heads split (a window pool also holds the replicated single K = V rows of
    # DeepSeek-V4 layers), Gated DeltaNet heads split, compressors and indexers replicated
    expected = {
        Form.FULL_KV: kv_elements(tp.layout, ("full_attention",)) / max(kv_elements(ref.layout, ("full_attention",)), 1),
        Form.SWA_WINDOW: kv_elements(tp.layout, WINDOW_KINDS) / max(kv_elements(ref.layout, WINDOW_KINDS), 1),
        Form.LINEAR_STATE: 0.5,
        Form.COMPRESSED_KV: 1.0,
        Form.UNCOMPRESSED_TAIL: 1.0,
        Form.INDEXER_STATE: 1.0,
    }
    if ref.layout.num_kv_heads > 1 and "full_attention" in ref.layout.layer_types:
        assert expected[Form.FULL_KV] == 0.5
    for name in full:
        ratio = ranks[0][name] / full[name]
        assert ratio == pytest.approx(expected[forms[name]]), f"pool {name} ({forms[name]}): a rank holds {ratio:.3f} of the TP=1 bytes"


def test_one_all_reduce_per_row_parallel_block(engines: tuple[LLM, LLM]) -> None:
    ref, tp = engines
    counts = tp.on_every_rank(tp_helpers.collectives_of_prefill, PROMPT[:20])
    layers = len(ref.layout.layer_types)
    # a mixer and an MLP block per layer, plus the embedding; the LM head gathers its logits
    assert counts == [{"all_reduce": 2 * layers + 1, "all_gather": 1}] * 2


def test_tp4_with_replicated_kv_heads() -> None:
    config = HybridConfig(linear_num_key_heads=4, linear_num_value_heads=8, o_groups=4)
    ref = LLM(config, device="cpu", cache=CACHE)
    tp = LLM(config, device="cpu", cache=CACHE, tensor_parallel_size=4, check_invariants=True)
    try:
        assert tp.on_every_rank(tp_helpers.kv_heads) == [1, 1, 1, 1]  # 2 KV heads over 4 ranks: each keeps one
        diff = (tp.prefill_logits(PROMPT) - ref.prefill_logits(PROMPT)).abs().max().item()
        assert diff <= ATOL
        steps = tokens(5, 3)
        got = tp.on_every_rank(tp_helpers.decode_logits, PROMPT[:40], steps)[0]
        want = tp_helpers.decode_logits(ref, PROMPT[:40], steps)
        assert max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)) <= ATOL
        tp.score(PROMPT)
        out = tp.score(PROMPT + tokens(7, 4))
        assert out.resume_tokens == 64
        cold = ref.prefill_logits(PROMPT + tokens(7, 4))[64:]
        assert (out.logits - cold).abs().max().item() <= ATOL
    finally:
        tp.close()
        ref.close()


def test_qwen3_next_kv_heads_are_split() -> None:
    """The sharded layout reports the modules' KV heads, not the config's."""
    tp = LLM("qwen3_next-tiny", device="cpu", tensor_parallel_size=2)
    try:
        assert tp.layout.num_kv_heads == 1
        assert all(m.num_heads == 2 for m in tp.model.modules() if isinstance(m, Qwen3NextAttention))
    finally:
        tp.close()
