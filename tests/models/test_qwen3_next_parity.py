"""``qwen3_next``: logits parity with transformers' ``Qwen3NextForCausalLM`` on tiny random
checkpoints written by ``save_pretrained`` and loaded through ``engine.LLM`` (the strict loader),
for a full prefill, prefill + decode, and the engine's cached path; plus the loader's and the
config parser's refusals.

Weights: transformers' own initialisation with ``initializer_range = 0.05`` (logits std ≈ 0.3),
and every norm weight, bias and ``dt_bias`` perturbed so that ``(1 + w)`` vs ``w`` and similar
slips show. Much larger inits make these tiny models chaotic: rounding differences of 1e-7 grow
through the delta-rule layers by ~100x per layer in *both* implementations, so the comparison
would measure the conditioning, not the code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, CacheConfig, SamplingParams
from engine.loader import ModelLoadError
from engine.model.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM, config_from_dict
from engine.presets import PRESETS
from tests.helpers import TOLERANCE, assert_warm_equals_cold, tokens

transformers = pytest.importorskip("transformers")

ATOL = TOLERANCE[torch.float32]
LIN, FULL = "linear_attention", "full_attention"
CACHE = CacheConfig(
    unit_tokens=16, full_kv_blocks=64, linear_checkpoints=16, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64
)

TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "initializer_range": 0.05,
}

VARIANTS: dict[str, dict[str, Any]] = {
    # MoE in layers 0, 2, 4 and dense MLPs in 1, 3; 2 value heads per key head; partial RoPE 1/4
    "mixed": {"layer_types": [LIN, FULL, LIN, LIN, FULL], "mlp_only_layers": [1, 3]},
    # decoder_sparse_step 2: layer 0 dense, layer 1 MoE; biases, tied head, no top-k renorm, full RoPE
    "all_full": {
        "layer_types": [FULL, FULL],
        "decoder_sparse_step": 2,
        "attention_bias": True,
        "tie_word_embeddings": True,
        "norm_topk_prob": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0},
    },
    # 3 value heads per key head; no experts at all (dense MLP everywhere)
    "all_linear": {"layer_types": [LIN, LIN, LIN], "linear_num_value_heads": 6, "num_experts": 0},
}

TINY_PRESET: dict[str, Any] = dict(PRESETS["qwen3_next-tiny"].fields)
"""The ``qwen3_next-tiny`` preset's fields (engine/presets.py), built and checked below."""


def save_hf_checkpoint(path: Path, seed: int, **overrides: Any) -> Any:
    """A random transformers model of TINY + ``overrides``, saved to ``path``; returns it."""
    fields = {**TINY, **overrides}
    fields["num_hidden_layers"] = len(fields["layer_types"])
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**fields)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "dt_bias")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return model


@torch.no_grad()
def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' logits ``[T, vocab]`` for one sequence, one forward, no cache."""
    return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"{tuple(a.shape)} != {tuple(b.shape)}"
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    out = {}
    for seed, (name, overrides) in enumerate(VARIANTS.items()):
        path = tmp_path_factory.mktemp(f"qwen3_next_{name}")
        out[name] = (save_hf_checkpoint(path, seed, **overrides), path)
    return out


@pytest.fixture(scope="module")
def engines(checkpoints: dict[str, tuple[Any, Path]]) -> dict[str, LLM]:
    return {name: LLM(model=str(path), device="cpu", cache=CACHE) for name, (_, path) in checkpoints.items()}


# -- parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("length", [1, 37, 80])
def test_prefill_matches_transformers(checkpoints: dict, engines: dict, variant: str, length: int) -> None:
    """One prefill (37 and 80 take the chunked delta rule, 1 the recurrent one)."""
    hf, _ = checkpoints[variant]
    ids = tokens(length, seed=length)
    diff = max_diff(engines[variant].prefill_logits(ids), hf_logits(hf, ids))
    print(f"prefill {variant} T={length}: max|Δ| = {diff:.3g}")
    assert diff <= ATOL


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_prefill_then_decode_matches_transformers(checkpoints: dict, engines: dict, variant: str) -> None:
    """Prefill 37 tokens then decode 6 one at a time on the same state; compared with one
    transformers forward over all 43 tokens and (where transformers supports it) with its own
    cached decode."""
    hf, _ = checkpoints[variant]
    model = engines[variant].model
    ids = tokens(43, seed=5)
    split = 37
    state = model.new_dense_state()
    parts = [model(torch.tensor(ids[:split]), torch.arange(split), state)]
    for i in range(split, len(ids)):
        parts.append(model(torch.tensor(ids[i : i + 1]), torch.tensor([i]), state))
    ours = torch.cat(parts)
    diff = max_diff(ours, hf_logits(hf, ids))
    print(f"prefill+decode {variant} vs one HF forward: max|Δ| = {diff:.3g}")
    assert diff <= ATOL
    if FULL not in VARIANTS[variant]["layer_types"]:
        return  # transformers 5.24 cannot run its cache without an attention layer (get_seq_length)
    batch = torch.tensor([ids])
    out = hf(batch[:, :split], use_cache=True, position_ids=torch.arange(split)[None])
    hf_parts, cache = [out.logits[0]], out.cache
    for i in range(split, len(ids)):
        out = hf(batch[:, i : i + 1], cache=cache, use_cache=True, position_ids=torch.tensor([[i]]))
        hf_parts.append(out.logits[0])
        cache = out.cache
    diff = max_diff(ours, torch.cat(hf_parts).float())
    print(f"prefill+decode {variant} vs HF cached decode: max|Δ| = {diff:.3g}")
    assert diff <= ATOL


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_score_equals_cold_and_transformers(checkpoints: dict, variant: str) -> None:
    """A prefix is cached by one request; a longer prompt (odd length 77) resumes from it."""
    hf, path = checkpoints[variant]
    llm = LLM(model=str(path), device="cpu", cache=CACHE, check_invariants=True)
    prefix = tokens(48, seed=11)
    ids = prefix + tokens(29, seed=12)
    llm.score(prefix)
    out = assert_warm_equals_cold(llm, ids)
    assert out.resume_tokens > 0, "the cached prefix was not reused"
    diff = max_diff(out.logits, hf_logits(hf, ids)[out.resume_tokens :])
    print(f"cached score {variant} (L* = {out.resume_tokens}) vs HF: max|Δ| = {diff:.3g}")
    assert diff <= ATOL


@torch.no_grad()
def test_greedy_generate_follows_transformers(checkpoints: dict) -> None:
    """The engine's cached decode (paged state, one token per step) picks the tokens
    transformers' logits pick, and those logits match at every generated position."""
    hf, path = checkpoints["mixed"]
    llm = LLM(model=str(path), device="cpu", cache=CACHE, check_invariants=True)
    prompt = tokens(33, seed=21)
    llm.score(prompt[:32])  # cache a prefix so the request resumes and then decodes
    generated = llm.generate([prompt], SamplingParams(max_tokens=6))[0].output_token_ids
    assert len(generated) == 6
    ref = hf_logits(hf, prompt + generated)
    assert ref[len(prompt) - 1 : -1].argmax(-1).tolist() == generated
    diff = max_diff(llm.prefill_logits(prompt + generated), ref)
    print(f"greedy generate mixed: max|Δ| = {diff:.3g}")
    assert diff <= ATOL


def test_parameter_names_and_shapes_are_transformers(checkpoints: dict) -> None:
    """Every tensor transformers saved is a parameter of ours with its shape, and back; the tied
    LM head shares the embedding's storage."""
    for variant, (_, path) in checkpoints.items():
        saved = {k: tuple(v.shape) for k, v in load_file(str(path / "model.safetensors")).items()}
        model = Qwen3NextForCausalLM(config_from_dict(json.loads((path / "config.json").read_text())))
        ours = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in model.tied_weights}
        assert ours == saved, variant
    tied = LLM(model=str(checkpoints["all_full"][1]), device="cpu", cache=CACHE).model
    assert isinstance(tied, Qwen3NextForCausalLM)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()


# -- config ------------------------------------------------------------------------------------


def test_config_defaults_follow_transformers() -> None:
    """Absent layer_types → the full_attention_interval pattern; legacy top-level RoPE keys."""
    raw = {
        **TINY,
        "model_type": "qwen3_next",
        "num_hidden_layers": 6,
        "full_attention_interval": 3,
        "rope_theta": 5_000_000,
        "partial_rotary_factor": 0.5,
        "rope_scaling": None,
        "use_sliding_window": False,
        "max_position_embeddings": 262144,
    }
    ours = config_from_dict(raw)
    theirs = transformers.Qwen3NextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert list(ours.layer_types) == theirs.layer_types == [LIN, LIN, FULL, LIN, LIN, FULL]
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 5_000_000
    assert ours.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"] == 0.5
    assert ours.rotary_dim == 8
    bare = config_from_dict({"model_type": "qwen3_next", "num_hidden_layers": 8})
    assert bare.layer_types == tuple(transformers.Qwen3NextConfig(num_hidden_layers=8).layer_types)
    assert (bare.num_experts, bare.partial_rotary_factor, bare.rope_theta) == (512, 0.25, 10_000.0)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
        ({"rope_parameters": {"rope_theta": 1e4, "factor": 4.0}}, "factor"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_theta": 123.0}, "rope_theta"),  # disagrees with rope_parameters
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method = .awq. is not supported"),  # fp8 loads (test_fp8_weights.py)
        ({"layer_types": [LIN, "sliding_attention", LIN, LIN, FULL]}, "layer_types[1]"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"mlp_only_layers": [7]}, "mlp_only_layers[0]"),
        ({"num_hidden_layers": 4}, "num_hidden_layers"),
        ({"head_dim": "16"}, "head_dim"),
    ],
)
def test_config_refusals_name_the_field(checkpoints: dict, tmp_path: Path, change: dict, field: str) -> None:
    path = _copy(checkpoints["mixed"][1], tmp_path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ModelLoadError, match=field.replace("[", r"\[").replace("]", r"\]")):
        LLM(model=str(path), device="cpu", cache=CACHE)


# -- loader ------------------------------------------------------------------------------------


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(path: Path, edit: Any) -> None:
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))


def test_missing_tensor_is_named(checkpoints: dict, tmp_path: Path) -> None:
    path = _copy(checkpoints["mixed"][1], tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.layers.2.linear_attn.A_log"))
    with pytest.raises(ModelLoadError, match=r"missing tensors model\.layers\.2\.linear_attn\.A_log"):
        LLM(model=str(path), device="cpu", cache=CACHE)


def test_shape_mismatch_is_named(checkpoints: dict, tmp_path: Path) -> None:
    path = _copy(checkpoints["mixed"][1], tmp_path)
    name = "model.layers.1.self_attn.q_proj.weight"
    _rewrite_weights(path, lambda t: t.update({name: torch.zeros(64, 32)}))  # no gate half
    with pytest.raises(ModelLoadError, match=rf"{name} has shape \(64, 32\), the config needs \(128, 32\)"):
        LLM(model=str(path), device="cpu", cache=CACHE)


def test_unsupported_dtype_is_named(checkpoints: dict, tmp_path: Path) -> None:
    path = _copy(checkpoints["mixed"][1], tmp_path)
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    _rewrite_weights(path, lambda t: t.update({name: t[name].to(torch.int8)}))
    with pytest.raises(ModelLoadError, match=rf"{name} has dtype torch\.int8"):
        LLM(model=str(path), device="cpu", cache=CACHE)


def test_unknown_model_type_is_named(checkpoints: dict, tmp_path: Path) -> None:
    path = _copy(checkpoints["mixed"][1], tmp_path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "model_type": "qwen4_next"}))
    with pytest.raises(ModelLoadError, match="model_type 'qwen4_next' is not supported"):
        LLM(model=str(path), device="cpu", cache=CACHE)


# -- the tiny preset ---------------------------------------------------------------------------


def test_tiny_preset_fields_run_and_cache() -> None:
    """The ``qwen3_next-tiny`` fields build, initialise deterministically and resume exactly."""
    config = config_from_dict({"model_type": "qwen3_next", **TINY_PRESET})
    assert isinstance(config, Qwen3NextConfig)
    llm = LLM(model=config, device="cpu", cache=CACHE, check_invariants=True)
    layout = llm.layout
    assert layout.layers_of(FULL) == (2, 5) and layout.sliding_window is None
    assert (layout.num_kv_heads, layout.kv_head_dim) == (2, 16)
    assert dict(layout.linear_state_shapes) == {i: ((128, 3), (4, 16, 16)) for i in (0, 1, 3, 4)}
    ids = tokens(70, seed=3)
    llm.score(ids[:40])
    assert assert_warm_equals_cold(llm, ids).resume_tokens == 32
    again = LLM(model=config, device="cpu", cache=CACHE)
    assert torch.equal(again.prefill_logits(ids[:5]), llm.prefill_logits(ids[:5]))
