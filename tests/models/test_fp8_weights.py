"""Block-wise FP8 checkpoints as released (``float8_e4m3fn`` weights, ``weight_scale_inv`` per
128 × 128 block in float32 or ``ue8m0``): dequantized at load, the logits equal those of
transformers' own FP8 dequantization of the same files (issue 21, item 4; CPU path).

The test quantizes a tiny transformers Qwen3-Next into exactly that format (every 2-D
projection; embedding, LM head, norms and the conv kernel stay float32) and saves it with its
``quantization_config``; the reference is ``AutoModelForCausalLM.from_pretrained`` on CPU, which
dequantizes (it needs ``accelerate``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.loader import ModelLoadError, load_model
from tests.helpers import TOLERANCE, tokens

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

BLOCK = 128
FIELDS: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 0, "initializer_range": 0.05,
    "layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2,
}  # fmt: skip


def quantize(w: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` → (float8_e4m3fn weights, per-block scales ``[⌈N/128⌉, ⌈K/128⌉]``): each
    block scaled so its largest magnitude is 448 (ue8m0: the scale rounded up to a power of 2)."""
    n, k = w.shape
    blocks = torch.nn.functional.pad(w, (0, -k % BLOCK, 0, -n % BLOCK)).unflatten(0, (-1, BLOCK)).unflatten(-1, (-1, BLOCK))
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    full = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (w / full).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


def fp8_checkpoint(path: Path, ue8m0: bool) -> None:
    torch.manual_seed(3)
    transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**FIELDS)).save_pretrained(path)
    out = {}
    for name, t in load_file(str(path / "model.safetensors")).items():
        if t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in ("embed", "lm_head", "norm")):
            out[name], out[name + "_scale_inv"] = quantize(t, ue8m0)
        else:
            out[name] = t
    save_file(out, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK],
                                     "activation_scheme": "dynamic", **({"scale_fmt": "ue8m0"} if ue8m0 else {})}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("ue8m0", [True, False], ids=["ue8m0", "float32-scales"])
def test_fp8_logits_equal_transformers_dequantization(tmp_path: Path, ue8m0: bool) -> None:
    fp8_checkpoint(tmp_path, ue8m0)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert not any("scale" in n for n, _ in reference.named_parameters())  # transformers dequantized it
    llm = LLM(str(tmp_path), device="cpu")
    ids = tokens(45, seed=1)
    with torch.no_grad():
        ref = reference(torch.tensor([ids]), use_cache=False).logits[0].float()
    assert (llm.prefill_logits(ids) - ref).abs().max().item() <= TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("drop a scale", r"model\.layers\.1\.self_attn\.o_proj\.weight is torch\.float8_e4m3fn without its .*weight_scale_inv"),
        ("misshape a scale", r"weight_scale_inv has shape \(1, 1\), blocks \(128, 128\) of \(256, 384\) need \(2, 3\)"),
        ("another method", r"quantization_config\.quant_method = 'awq' is not supported"),
    ],
)
def test_a_broken_fp8_checkpoint_names_the_tensor_or_field(tmp_path: Path, damage: str, message: str) -> None:
    fp8_checkpoint(tmp_path, ue8m0=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    if damage == "drop a scale":
        del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    elif damage == "misshape a scale":
        tensors["model.layers.1.mlp.down_proj.weight_scale_inv"] = tensors["model.layers.1.mlp.down_proj.weight_scale_inv"][:1, :1].clone()
    else:
        config = json.loads((tmp_path / "config.json").read_text())
        config["quantization_config"]["quant_method"] = "awq"
        (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=message):
        load_model(tmp_path, torch.device("cpu"))
