"""Parity of the ``deepseek_v4`` attention stack with transformers' DeepSeek-V4 layers.

Layer by layer (sliding, CSA, HCA): transformers' ``DeepseekV4Attention`` with a tiny config and
random weights, the same weights copied into kvscope's layer, then the same chunks through both
— a prefill, decode steps across several compression boundaries and window edges, and a
multi-token chunk — comparing the outputs and the state each layer keeps (window KV, compressed
entries, pending compressor rows, the previous group's rows, the indexer's keys and rows) with
what transformers' cache holds. Then the model itself: chunked prefill and decode equal one long
prefill, through the dense state and through the paged (cached) path. Float32, max abs
difference ≤ 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from transformers import DeepseekV4Config as HFDeepseekV4Config
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from engine import LLM
from engine.cache.config import CacheConfig
from engine.loader import load_model, save_directory
from engine.model.deepseek_v4 import (
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    build,
    config_from_dict,
    config_to_dict,
)
from engine.model.deepseek_v4_attention import DeepseekV4Attention
from engine.model.deepseek_v4_compressor import apply_rope, rope_cos_sin
from engine.model.state import CompressedLayerState, DenseState
from engine.presets import PRESETS

ATOL = 1e-4
KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
HIDDEN = 32


def hf_config(*, hca_ratio: int, window: int, topk: int) -> HFDeepseekV4Config:
    """A tiny transformers config with one layer of each kind (MoE fields only to satisfy it)."""
    config = HFDeepseekV4Config(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=24,
        partial_rotary_factor=0.5,
        layer_types=list(KINDS),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca_ratio},
        sliding_window=window,
        o_groups=2,
        o_lora_rank=12,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=topk,
        hc_mult=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_layer_types=["moe"] * 3,
    )
    config._attn_implementation = "eager"
    return config


def saved_config(config: HFDeepseekV4Config, tmp_path: Path) -> dict[str, Any]:
    """config.json exactly as ``save_pretrained`` writes it."""
    config.save_pretrained(tmp_path)
    raw: dict[str, Any] = json.loads((tmp_path / "config.json").read_text())
    return raw


def dense_variant(raw: dict[str, Any]) -> DeepseekV4Config:
    """kvscope's config for the same attention stack with dense MLPs and a plain residual."""
    return config_from_dict({**raw, "mlp_layer_types": ["dense"] * raw["num_hidden_layers"], "intermediate_size": 48, "hyper_connections": False})


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights with every parameter away from its initial value (sinks and positional biases
    included), scaled so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 1 or name.endswith("position_bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)


class LayerPair:
    """One transformers attention layer of each kind and kvscope's copy of it, fed the same
    chunks (each layer sees the same input; they are not stacked)."""

    def __init__(self, config: HFDeepseekV4Config, ours: DeepseekV4Config) -> None:
        self.config = config
        self.hf_layers = [hf.DeepseekV4Attention(config, i).eval() for i in range(3)]
        self.hf_cache = DynamicCache(config=config)
        self.hf_rotary = hf.DeepseekV4RotaryEmbedding(config)
        self.layers = [DeepseekV4Attention(ours, i).eval() for i in range(3)]
        for i, (theirs, mine) in enumerate(zip(self.hf_layers, self.layers, strict=True)):
            randomize(theirs, seed=100 + i)
            mine.load_state_dict(theirs.state_dict(), strict=True)
        self.state = DenseState({}, torch.device("cpu"))
        self.num_tokens = 0

    @torch.no_grad()
    def step(self, x: Tensor) -> dict[str, float]:
        """Run ``x [T, C]`` through both; the max abs output difference per kind."""
        t = x.shape[0]
        positions = torch.arange(self.num_tokens, self.num_tokens + t)
        hx, hpos = x[None], positions[None]
        mask = create_sliding_window_causal_mask(
            config=self.config, inputs_embeds=hx, attention_mask=None, cache=self.hf_cache, position_ids=hpos
        )
        rope = {label: self.hf_rotary(hx, position_ids=hpos, layer_type=label) for label in ("main", "compress")}
        diffs = {}
        for kind, theirs, mine in zip(KINDS, self.hf_layers, self.layers, strict=True):
            expected = theirs(hx, rope, hpos, mask, cache=self.hf_cache)[0][0]
            got = mine(x, positions, self.state)
            assert got.shape == expected.shape
            diffs[kind] = (got - expected).abs().max().item()
        self.num_tokens += t
        return diffs

    def state_diffs(self) -> dict[str, float]:
        """Max abs difference of every piece of kept state, per ``kind.piece``; asserts shapes."""
        diffs: dict[str, float] = {}
        for i, (kind, mine) in enumerate(zip(KINDS, self.layers, strict=True)):
            ours, theirs = self._our_state(i, mine), self._hf_state(i, kind)
            assert ours.keys() == theirs.keys(), kind
            for piece, tensor in ours.items():
                assert tensor.shape == theirs[piece].shape, f"{kind}.{piece}: {tuple(tensor.shape)} vs {tuple(theirs[piece].shape)}"
                diffs[f"{kind}.{piece}"] = (tensor - theirs[piece]).abs().max().item() if tensor.numel() else 0.0
        return diffs

    def _our_state(self, layer: int, attn: DeepseekV4Attention) -> dict[str, Tensor]:
        window = attn.window - 1
        kv = self.state.kv(layer)
        assert kv is not None
        out = {"window": kv.keys[-window:, 0]}
        if attn.compressor is None:
            return out
        state = self.state.compressed(layer, attn.state_spec())
        state.check()
        parts = [("compressor", state.compressor, attn.compressor)]
        if state.indexer is not None:
            parts.append(("indexer", state.indexer, attn.compressor.indexer))
        for name, cstate, module in parts:
            out[f"{name}.entries"] = cstate.entries
            out[f"{name}.pending_kv"] = cstate.pending_kv
            out[f"{name}.pending_gate"] = cstate.pending_gate
            if module.spec.overlapping:
                d = module.spec.head_dim
                out[f"{name}.prev_kv"] = cstate.prev_kv
                # transformers keeps the previous group's gate logits with the positional bias added
                out[f"{name}.prev_gate"] = cstate.prev_gate + module.position_bias[:, :d] if cstate.prev_gate.numel() else cstate.prev_gate
        return out

    def _hf_state(self, layer: int, kind: str) -> dict[str, Tensor]:
        cache_layer: Any = self.hf_cache.layers[layer]
        out = {"window": cache_layer.keys[0, 0]}
        if kind == "sliding_attention":
            return out
        names = ["compressor", "indexer"] if kind == "compressed_sparse_attention" else ["compressor"]
        for name in names:
            width = (self.config.index_head_dim if name == "indexer" else self.config.head_dim)
            empty = torch.zeros((0, width))
            entries = cache_layer.compressed_kv[name]
            out[f"{name}.entries"] = empty if entries is None else entries[0]
            out[f"{name}.pending_kv"] = cache_layer.buffer_kv[name][0]
            out[f"{name}.pending_gate"] = cache_layer.buffer_gate[name][0]
            if kind == "compressed_sparse_attention":
                prev_kv, prev_gate = cache_layer.overlap_kv[name], cache_layer.overlap_gate[name]
                out[f"{name}.prev_kv"] = empty if prev_kv is None else prev_kv[0]
                out[f"{name}.prev_gate"] = empty if prev_gate is None else prev_gate[0]
        return out


@pytest.mark.parametrize(
    ("hca_ratio", "window", "topk"),
    [(8, 8, 3), (16, 5, 1)],
    ids=["hca8-w8-top3", "hca16-w5-top1"],
)
def test_layers_match_transformers_prefill_then_decode(tmp_path: Path, hca_ratio: int, window: int, topk: int) -> None:
    """Prefill 13 tokens, decode 20 one by one (CSA boundaries at 16, 20, …, 32; HCA at 16,
    24, 32 or 16, 32; window edges every step), then a 6-token chunk: outputs and every piece
    of kept state equal transformers' after each step."""
    config = hf_config(hca_ratio=hca_ratio, window=window, topk=topk)
    pair = LayerPair(config, dense_variant(saved_config(config, tmp_path)))
    gen = torch.Generator().manual_seed(7)
    chunks = [13] + [1] * 20 + [6]
    worst_out: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    worst_state: dict[str, float] = {}
    for n in chunks:
        out = pair.step(torch.randn(n, HIDDEN, generator=gen))
        states = pair.state_diffs()
        for k, v in out.items():
            worst_out[k] = max(worst_out[k], v)
        for k, v in states.items():
            worst_state[k] = max(worst_state.get(k, 0.0), v)
        assert max(out.values()) <= ATOL, (pair.num_tokens, out)
        assert max(states.values()) <= ATOL, (pair.num_tokens, states)
    # every piece of state was really exercised: entries formed, rows pending at some step
    entries = pair.state.compressed(2, pair.layers[2].state_spec()).compressor.entries
    assert entries.shape[0] == 39 // hca_ratio
    print(f"\nmax abs diff outputs {worst_out}\nmax abs diff state {worst_state}")


def test_parameter_names_match_transformers(tmp_path: Path) -> None:
    """Every attention parameter of transformers' whole model exists in ours with its shape
    (``model.layers.<i>.self_attn.*``), and so do the embeddings, final norm and LM head."""
    config = hf_config(hca_ratio=8, window=8, topk=3)
    theirs = {k: tuple(v.shape) for k, v in hf.DeepseekV4ForCausalLM(config).state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in build(dense_variant(saved_config(config, tmp_path))).state_dict().items()}
    shared = [k for k in theirs if ".self_attn." in k or k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")]
    assert len(shared) > 40
    assert {k: theirs[k] for k in shared} == {k: ours.get(k) for k in shared}


def small_model(seed: int = 0) -> DeepseekV4ForCausalLM:
    config = DeepseekV4Config(
        layer_types=(
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "sliding_attention",
        ),
        num_hidden_layers=6,
        compress_rate_hca=8,
        sliding_window=8,
        index_topk=2,
    )
    model = build(config).eval()
    randomize(model, seed)
    return model


def run_chunks(model: DeepseekV4ForCausalLM, ids: Tensor, ends: list[int], state: Any) -> Tensor:
    pieces, start = [], 0
    with torch.no_grad():
        for end in [*ends, len(ids)]:
            pieces.append(model(ids[start:end], torch.arange(start, end), state))
            start = end
    return torch.cat(pieces)


@pytest.mark.parametrize(
    "ends",
    [
        [16, 24, 32],  # on CSA and HCA boundaries
        [15, 23, 31],  # one before
        [17, 25, 33],  # one past
        [3, 7, 8, 9, 12],  # short chunks around the first groups and the window edge
        list(range(13, 41)),  # prefill 13, then decode one by one
    ],
    ids=["on", "before", "after", "short", "decode"],
)
def test_chunked_prefill_and_decode_equal_one_prefill(ends: list[int]) -> None:
    """The state carried across chunk edges (window, pending rows, previous group, indexer)
    gives the logits and the final state of one long prefill."""
    model = small_model()
    ids = torch.randint(0, model.config.vocab_size, (41,), generator=torch.Generator().manual_seed(3))
    one_state, chunk_state = model.new_dense_state(), model.new_dense_state()
    one = run_chunks(model, ids, [], one_state)
    chunked = run_chunks(model, ids, ends, chunk_state)
    diff = (chunked - one).abs().max().item()
    print(f"\nmax abs diff logits ({ends[:3]}…): {diff:.3g}")
    assert diff <= ATOL
    for layer, spec in model.compressed_state_specs().items():
        a, b = one_state.compressed(layer, spec), chunk_state.compressed(layer, spec)
        a.check()
        b.check()
        assert _state_diff(a, b) <= ATOL
    for layer in range(len(model.config.layer_types)):  # every layer's window rows
        kv_one, kv_chunked = one_state.kv(layer), chunk_state.kv(layer)
        assert kv_one is not None and kv_chunked is not None
        assert torch.equal(kv_one.positions, kv_chunked.positions)
        assert (kv_one.keys - kv_chunked.keys).abs().max().item() <= ATOL


def _state_diff(a: CompressedLayerState, b: CompressedLayerState) -> float:
    pairs: list[tuple[Tensor, Tensor]] = []
    for x, y in [(a.compressor, b.compressor), (a.indexer, b.indexer)]:
        if x is None or y is None:
            assert x is y
            continue
        pairs += [(x.entries, y.entries), (x.pending_kv, y.pending_kv), (x.pending_gate, y.pending_gate)]
        pairs += [(x.prev_kv, y.prev_kv), (x.prev_gate, y.prev_gate)]
    worst = 0.0
    for x, y in pairs:
        assert x.shape == y.shape
        worst = max(worst, (x - y).abs().max().item() if x.numel() else 0.0)
    return worst


def test_cached_path_cold_equals_reference() -> None:
    """Through the engine (paged swa_window pages for sliding layers, compressed state restored
    from snapshots), a cold request in several chunks equals the dense reference, and so does a
    follow-up that resumes at L* > 0; prefix caching off runs cold too."""
    config = small_model().config
    cache = CacheConfig(unit_tokens=4, max_prefill_chunk_tokens=8, swa_blocks=64, checkpoint_interval_tokens=8)
    ids = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    llm = LLM(config, device="cpu", cache=cache, check_invariants=True)
    randomize(llm.model, 0)
    cold = llm.score(ids)
    assert cold.resume_tokens == 0
    diff = (cold.logits - llm.prefill_logits(ids)).abs().max().item()
    assert diff <= ATOL
    follow_up = [*ids[:30], 1, 2, 3]
    warm = llm.score(follow_up)
    assert warm.resume_tokens > 0
    assert (warm.logits - llm.prefill_logits(follow_up)[warm.resume_tokens :]).abs().max().item() <= ATOL
    llm.cache.check_invariants()
    uncached = LLM(config, device="cpu", cache=CacheConfig(enable_prefix_caching=False))
    uncached.model.load_state_dict(llm.model.state_dict())
    again = uncached.score(ids)
    assert (again.logits - llm.prefill_logits(ids)).abs().max().item() <= ATOL


def test_config_reads_transformers_defaults_and_refuses_the_rest(tmp_path: Path) -> None:
    """transformers' defaults (mHC with hc_mult = 4, hash_moe then moe MLPs) are read as they
    are; what kvscope does not implement is refused naming the field."""
    raw = saved_config(HFDeepseekV4Config(num_hidden_layers=3), tmp_path)
    config = config_from_dict(raw)
    assert (config.hc_mult, config.hyper_connections, config.compress_rate_hca) == (4, True, 128)
    assert config.mlp_layer_types == ("hash_moe", "hash_moe", "hash_moe")
    with pytest.raises(ValueError, match="hc_mult = 4 needs hyper_connections"):
        config_from_dict({**raw, "hyper_connections": False})
    with pytest.raises(ValueError, match="'n_experts_total'"):
        config_from_dict({**raw, "n_experts_total": 8})
    yarn = {"main": raw["rope_parameters"]["main"], "compress": {"rope_type": "yarn", "factor": 16.0}}
    with pytest.raises(ValueError, match=r"rope_parameters.compress.rope_type"):
        config_from_dict({**raw, "rope_parameters": yarn})
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        config_from_dict({**raw, "qk_rope_head_dim": 32})


def test_index_score_ties_do_not_depend_on_chunking() -> None:
    """Small initial weights make many index scores exactly 0 (every head's ReLU is 0); the
    top-k choice among tied entries must be the same for a long prefill and for decode."""
    config = DeepseekV4Config(layer_types=("compressed_sparse_attention",), num_hidden_layers=1, index_n_heads=2, index_topk=2)
    model = build(config).eval()
    model.init_random(0)
    ids = torch.randint(0, config.vocab_size, (41,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(41)
    one_state = model.new_dense_state()
    one = run_chunks(model, ids, [], one_state)
    decoded = run_chunks(model, ids, list(range(5, 41)), model.new_dense_state())
    assert (decoded - one).abs().max().item() <= ATOL
    # the case is real: some query has tied scores among the entries it may pick from
    attn = model.model.layers[0].self_attn
    indexer = attn.compressor.indexer
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        keys = one_state.compressed(0, attn.state_spec()).indexer.entries
        q = indexer.q_b_proj(attn.q_a_norm(attn.q_a_proj(x))).view(41, config.index_n_heads, -1)
        q = apply_rope(q, *rope_cos_sin(positions, indexer.rope_dim, indexer.rope_theta))
        scores = indexer.scorer(q, keys, x)
    visible = torch.arange(keys.shape[0])[None, :] < ((positions + 1) // 4)[:, None]
    ties = [int((row[mask] == 0).sum()) for row, mask in zip(scores, visible, strict=True)]
    assert max(ties) >= 2


TINY_PRESET_FIELDS: dict[str, Any] = dict(PRESETS["deepseek_v4-tiny"].fields)
"""The ``deepseek_v4-tiny`` preset's fields (engine/presets.py), built and checked below."""


def test_checkpoint_round_trip_through_the_loader(tmp_path: Path) -> None:
    """config_to_dict + save_directory, then the strict loader: same config, same logits (tied
    LM head included); the proposed tiny preset's fields load the same way."""
    config = config_from_dict({"model_type": "deepseek_v4", **TINY_PRESET_FIELDS, "tie_word_embeddings": True})
    assert config_from_dict(config_to_dict(config)) == config
    model = build(config).eval()
    randomize(model, 4)
    save_directory(model, config_to_dict(config), tmp_path)
    loaded = load_model(tmp_path, torch.device("cpu")).model
    ids = torch.randint(0, config.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids, torch.arange(20), model.new_dense_state())
        got = loaded(ids, torch.arange(20), loaded.new_dense_state())
    assert torch.equal(got, expected)
    assert loaded.layout.sliding_window == 16 and loaded.layout.num_kv_heads == 1 and loaded.layout.kv_head_dim == 32
