"""Qwen3.5 (``qwen3_5_text``, ``qwen3_5_moe_text`` and the released vision-language layout
``qwen3_5``): logits parity with transformers' ``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM`` and ``Qwen3_5ForConditionalGeneration`` (text only) on tiny random
checkpoints written by ``save_pretrained`` and loaded through ``engine.LLM``: a prefill, a
prefill + decode, the engine's cached path; and the config's refusals (issue 21, item 3).

Weights: transformers' initialisation with ``initializer_range = 0.05`` and every norm weight,
bias and ``dt_bias`` perturbed (as in test_qwen3_next_parity.py, whose docstring says why).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, CacheConfig
from engine.loader import ModelLoadError, load_model
from tests.helpers import TOLERANCE, assert_warm_equals_cold, tokens

transformers = pytest.importorskip("transformers")

from tests.models.test_qwen3_next_parity import max_diff  # noqa: E402 (needs transformers)

ATOL = TOLERANCE[torch.float32]
LIN, FULL = "linear_attention", "full_attention"
CACHE = CacheConfig(
    unit_tokens=16, full_kv_blocks=64, linear_checkpoints=16, checkpoint_interval_tokens=32, max_prefill_chunk_tokens=64
)
TEXT: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4, "initializer_range": 0.05,
}  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    "dense": {"layer_types": [LIN, FULL, LIN], "intermediate_size": 64},
    "moe": {"layer_types": [LIN, FULL, LIN, FULL], "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24},
    # the released layout: the text decoder under text_config / model.language_model., a vision
    # tower under model.visual. (skipped), M-RoPE sections (text: one position per token)
    "vision_language": {"layer_types": [FULL, LIN, LIN], "intermediate_size": 48,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                            "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
}  # fmt: skip
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
          "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16}  # fmt: skip


def save_hf_checkpoint(path: Path, variant: str, seed: int) -> Any:
    fields = {**TEXT, **VARIANTS[variant]}
    fields["num_hidden_layers"] = len(fields["layer_types"])
    torch.manual_seed(seed)
    if variant == "moe":
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**fields))
    elif variant == "dense":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**fields))
    else:
        config = transformers.Qwen3_5Config(text_config=fields, vision_config=VISION)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    model.eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" not in name and ("norm" in name or name.endswith(("bias", "dt_bias"))):
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return model


@torch.no_grad()
def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    out = {}
    for seed, variant in enumerate(VARIANTS):
        path = tmp_path_factory.mktemp(f"qwen3_5_{variant}")
        out[variant] = (save_hf_checkpoint(path, variant, seed), path)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(checkpoints: dict, variant: str) -> None:
    """Prefills of 1, 37 and 80 tokens (recurrent and chunked delta rule), then 37 tokens and 6
    decoded one at a time on the same state, each against one transformers forward."""
    hf, path = checkpoints[variant]
    llm = LLM(model=str(path), device="cpu", cache=CACHE)
    for length in (1, 37, 80):
        ids = tokens(length, seed=length)
        assert max_diff(llm.prefill_logits(ids), hf_logits(hf, ids)) <= ATOL, (variant, length)
    model, ids, split = llm.model, tokens(43, seed=5), 37
    state = model.new_dense_state()
    with torch.no_grad():
        parts = [model(torch.tensor(ids[:split]), torch.arange(split), state)]
        parts += [model(torch.tensor(ids[i : i + 1]), torch.tensor([i]), state) for i in range(split, len(ids))]
    assert max_diff(torch.cat(parts), hf_logits(hf, ids)) <= ATOL


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_score_equals_cold_and_transformers(checkpoints: dict, variant: str) -> None:
    hf, path = checkpoints[variant]
    llm = LLM(model=str(path), device="cpu", cache=CACHE, check_invariants=True)
    prefix = tokens(48, seed=11)
    ids = prefix + tokens(29, seed=12)
    llm.score(prefix)
    out = assert_warm_equals_cold(llm, ids)
    assert out.resume_tokens == 48
    assert max_diff(out.logits, hf_logits(hf, ids)[out.resume_tokens :]) <= ATOL


def test_the_vision_tower_is_skipped_with_one_log_line(checkpoints: dict, caplog: pytest.LogCaptureFixture) -> None:
    _, path = checkpoints["vision_language"]
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        loaded = load_model(path, torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]
    assert len(lines) == 1 and "model.visual.*" in lines[0]
    assert loaded.model.config.model_type == "qwen3_5_text" and loaded.model.config.num_experts == 0


@pytest.mark.parametrize(
    ("variant", "edit", "message"),
    [
        ("dense", {"num_experts": 8}, "num_experts is not a qwen3_5_text field"),
        ("moe", {"norm_topk_prob": False}, "norm_topk_prob is not a qwen3_5_moe_text field"),
        ("moe", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type = 'yarn' is not supported"),
    ],
)
def test_a_field_qwen3_5_does_not_have_is_refused_by_name(checkpoints: dict, tmp_path: Path, variant: str, edit: dict, message: str) -> None:
    _, path = checkpoints[variant]
    copy = shutil.copytree(path, tmp_path / "ckpt")
    raw = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**raw, **edit}))
    with pytest.raises(ModelLoadError, match=message):
        load_model(copy, torch.device("cpu"))


def test_vision_language_without_a_text_config_is_refused(checkpoints: dict, tmp_path: Path) -> None:
    _, path = checkpoints["vision_language"]
    copy = shutil.copytree(path, tmp_path / "ckpt")
    raw = json.loads((copy / "config.json").read_text())
    del raw["text_config"]
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="text_config must be an object"):
        load_model(copy, torch.device("cpu"))


@pytest.mark.parametrize(("preset", "experts"), [("qwen3_5-tiny", 0), ("qwen3_5_moe-tiny", 4)])
def test_the_tiny_presets_build_and_resume_exactly(preset: str, experts: int) -> None:
    llm = LLM(preset, device="cpu", cache=CACHE, check_invariants=True)
    assert llm.model.config.num_experts == experts and llm.model.config.split_linear_projections
    prefix = tokens(64, seed=3)
    llm.score(prefix)
    assert assert_warm_equals_cold(llm, prefix + tokens(13, seed=4)).resume_tokens == 64


def test_a_released_config_loads_with_its_dtype_from_text_config(checkpoints: dict, tmp_path: Path) -> None:
    """The keys released Qwen3.5 configs carry (attention output gate, swish gated norm, float32
    recurrent state, ``language_model_only``) are accepted as they are, another value refused;
    the vision-language layout's ``dtype`` is read from ``text_config``."""
    _, path = checkpoints["vision_language"]
    copy = shutil.copytree(path, tmp_path / "ckpt")
    raw = json.loads((copy / "config.json").read_text())
    raw.pop("dtype", None)
    raw["language_model_only"] = False
    raw["text_config"] |= {"attn_output_gate": True, "output_gate_type": "swish", "mamba_ssm_dtype": "float32", "dtype": "bfloat16"}
    (copy / "config.json").write_text(json.dumps(raw))
    llm = LLM(str(copy), device="cpu")
    assert llm.dtype == torch.bfloat16
    raw["text_config"]["output_gate_type"] = "sigmoid"
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="output_gate_type = 'sigmoid' is not supported"):
        load_model(copy, torch.device("cpu"))
