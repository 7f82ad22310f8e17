"""DeepSeek-V4 checkpoints in the released layouts (issue 21 acceptance).

* DeepSeek-native names (``embed.weight``, ``layers.<i>.attn.wq_a.weight``,
  ``layers.<i>.ffn.experts.<j>.w1.weight``, ``layers.<i>.hc_attn_fn``, ``hc_head_fn``,
  ``head.weight``) in three or more shards with their ``model.safetensors.index.json``: the same
  logits as transformers' model they were converted from;
* a corrupt shard and an index naming a tensor no file holds: a clear error naming the file or
  the tensor, nothing loaded;
* FP8 as released (``float8_e4m3fn`` weights, ``weight_scale_inv`` block scales in
  ``float8_e8m0fnu``, ``scale_fmt: ue8m0``), and with FP4 routed experts (``expert_dtype:
  fp4``: two e2m1 values a byte, a ue8m0 scale per 32): the logits equal transformers' own
  dequantization of the same files, and so do the same files in DeepSeek's spelling (``X.scale``);
* the MTP module's ``mtp.0.*`` tensors load and round-trip.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.loader import ModelLoadError, load_model
from engine.weight_files import INDEX_FILE, save_sharded
from tests.helpers import TOLERANCE, tokens

transformers = pytest.importorskip("transformers")

from engine.fp4_weights import quantize_fp4  # noqa: E402
from tests.models.test_deepseek_v4_model_parity import our_logits, save_hf_checkpoint  # noqa: E402
from tests.models.test_fp8_weights import quantize  # noqa: E402

CPU = torch.device("cpu")
_NATIVE_TOP = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
               "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}  # fmt: skip


def native_name(saved: str) -> str:
    """A transformers-saved name (``model.layers.0.attn.wq_a.weight``) as DeepSeek releases it."""
    return _NATIVE_TOP.get(saved, saved.removeprefix("model."))


def native_sharded(path: Path, seed: int) -> tuple[object, list[Path]]:
    """transformers' tiny V4 re-saved under DeepSeek-native names in shards of ≤ 64 KiB."""
    hf = save_hf_checkpoint(path, "hc2-sqrtsoftplus", seed)
    tensors = {native_name(k): v for k, v in load_file(str(path / "model.safetensors")).items()}
    (path / "model.safetensors").unlink()
    return hf, save_sharded(tensors, path, max_shard_bytes=64 << 10)


def test_native_names_in_shards_load_and_match_transformers(tmp_path: Path) -> None:
    hf, shards = native_sharded(tmp_path, seed=12)
    assert len(shards) >= 3
    index = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    assert {"embed.weight", "head.weight", "hc_head_fn", "layers.1.attn.indexer.compressor.ape", "layers.0.ffn.gate.tid2eid"} <= set(index)
    model = load_model(tmp_path, CPU).model
    ids = tokens(40, seed=5)
    with torch.no_grad():
        expected = hf(torch.tensor([ids]), use_cache=False).logits[0]  # type: ignore[operator]
    assert (our_logits(model, ids, [13, 21]) - expected).abs().max().item() <= TOLERANCE[torch.float32]


def test_a_corrupt_shard_and_an_index_naming_a_missing_tensor_fail_clearly(tmp_path: Path) -> None:
    _, shards = native_sharded(tmp_path, seed=1)
    second = shards[1].read_bytes()
    shards[1].write_bytes(second[: len(second) // 2])  # truncated mid-tensor
    with pytest.raises(ModelLoadError, match=rf"{shards[1].name}"):
        load_model(tmp_path, CPU)
    shards[1].write_bytes(b"\xff" * 8 + second[8:])  # a header length past the file
    with pytest.raises(ModelLoadError, match=rf"{shards[1].name}"):
        load_model(tmp_path, CPU)
    shards[1].write_bytes(second)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["weight_map"]["layers.2.attn.wq_a.scale"] = shards[0].name
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"layers\.2\.attn\.wq_a\.scale"):
        load_model(tmp_path, CPU)


UNQUANTIZED = ("embed", "head.weight", "norm", "compressor.", "indexer.", "gate.weight", "hc_")
"""Tensors V4's FP8 releases keep in BF16 (embeddings, head, norms, mHC, routers, and the
compressor / indexer projections transformers lists in ``_keep_in_fp32_modules``)."""


def quantized_checkpoint(path: Path, fp4_experts: bool) -> object:
    """transformers' tiny V4 saved, then its weights quantized as released: FP8 e4m3 with ue8m0
    block scales (``weight_scale_inv``), routed experts packed FP4 with per-32 scales when
    ``fp4_experts`` (``expert_dtype: fp4`` beside ``quantization_config``, as V4 writes it).
    Returns transformers' unquantized model."""
    hf = save_hf_checkpoint(path, "hc2-sqrtsoftplus", seed=12)
    out = {}
    for name, w in load_file(str(path / "model.safetensors")).items():
        if fp4_experts and ".ffn.experts." in name:
            out[name], out[name + "_scale_inv"] = quantize_fp4(w, ue8m0=True)
        elif w.dim() == 2 and name.endswith(".weight") and w.is_floating_point() and not any(s in name for s in UNQUANTIZED):
            out[name], out[name + "_scale_inv"] = quantize(w, ue8m0=True)
        else:
            out[name] = w
    save_file(out, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic", "scale_fmt": "ue8m0"}  # fmt: skip
    if fp4_experts:
        config["expert_dtype"] = "fp4"
    (path / "config.json").write_text(json.dumps(config))
    expert = out["model.layers.1.ffn.experts.0.w1.weight"]
    assert expert.dtype == (torch.int8 if fp4_experts else torch.float8_e4m3fn)
    assert out["model.layers.1.ffn.experts.0.w1.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    return hf


@pytest.mark.parametrize("fp4_experts", [False, True], ids=["fp8-ue8m0", "fp4-experts"])
def test_quantized_checkpoint_equals_transformers_dequantization(tmp_path: Path, fp4_experts: bool) -> None:
    hf = quantized_checkpoint(tmp_path, fp4_experts)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = tokens(30, seed=1)
    with torch.no_grad():
        ref = reference(torch.tensor([ids]), use_cache=False).logits[0].float()
        unquantized = hf(torch.tensor([ids]), use_cache=False).logits[0]  # type: ignore[operator]
    assert (ref - unquantized).abs().max().item() > 0.01  # the quantization is real
    assert (LLM(str(tmp_path), device="cpu").prefill_logits(ids) - ref).abs().max().item() <= TOLERANCE[torch.float32]


def test_fp4_shape_and_scale_errors_name_the_tensor(tmp_path: Path) -> None:
    quantized_checkpoint(tmp_path, fp4_experts=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.2.ffn.experts.1.w3.weight"
    bad = dict(tensors)
    bad[name + "_scale_inv"] = tensors[name + "_scale_inv"].to(torch.bfloat16)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"{name}_scale_inv has dtype torch.bfloat16; scale_fmt 'ue8m0'"):
        load_model(tmp_path, CPU)
    bad[name], bad[name + "_scale_inv"] = tensors[name][:, :8].contiguous(), tensors[name + "_scale_inv"]
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"{name} has shape \(16, 8\), the config needs \(16, 16\) \(FP4"):
        load_model(tmp_path, CPU)


def test_fp8_in_native_names_with_scale_tensors_loads_the_same(tmp_path: Path) -> None:
    """The released spelling of the same FP8 + FP4 files: native names, ``X.scale`` beside
    ``X.weight``, in shards — the same model as the transformers-spelled copy."""
    hf_dir, native_dir = tmp_path / "hf", tmp_path / "native"
    hf_dir.mkdir()
    quantized_checkpoint(hf_dir, fp4_experts=True)
    native_dir.mkdir()
    renamed = {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if name.endswith(".weight_scale_inv"):
            renamed[native_name(name.removesuffix(".weight_scale_inv")) + ".scale"] = t
        else:
            renamed[native_name(name)] = t
    assert len(save_sharded(renamed, native_dir, max_shard_bytes=64 << 10)) >= 3
    (native_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    ids = tokens(30, seed=1)
    expected = LLM(str(hf_dir), device="cpu").prefill_logits(ids)
    assert torch.equal(LLM(str(native_dir), device="cpu").prefill_logits(ids), expected)


def test_mtp_tensors_load_into_the_mtp_module_and_round_trip(tmp_path: Path) -> None:
    """``mtp.0.*`` in DeepSeek's names (a block plus ``enorm``, ``hnorm``, ``e_proj``, ``h_proj``,
    ``norm``, ``hc_head_*``): each lands in a parameter of its shape with its values, the main
    model's logits do not change, and a save and load round trip keeps them bit for bit."""
    from engine.loader import save_directory
    from engine.model.deepseek_v4 import config_to_dict

    hf = save_hf_checkpoint(tmp_path / "ckpt", "hc2-sqrtsoftplus", seed=12)
    path = tmp_path / "ckpt"
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 1}))
    shapes = {k: tuple(v.shape) for k, v in load_model(tmp_path / "ckpt", CPU).model.state_dict().items()}
    assert not any(k.startswith("mtp.") for k in shapes)  # declared, absent from the files: dropped
    layer = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(2)
    prefix = "model.layers.0."  # a hash_moe block; the MTP block routes by learned top-k
    mtp = {f"mtp.0.{k.removeprefix(prefix)}": torch.randn(v.shape, generator=gen) * 0.05
           for k, v in layer.items() if k.startswith(prefix) and "tid2eid" not in k}  # fmt: skip
    c = layer["model.embed_tokens.weight"].shape[1]
    n_experts = layer[prefix + "ffn.gate.weight"].shape[0]
    mtp |= {"mtp.0.ffn.gate.bias": torch.randn(n_experts, generator=gen), "mtp.0.e_proj.weight": torch.randn(c, c, generator=gen),
            "mtp.0.h_proj.weight": torch.randn(c, c, generator=gen), "mtp.0.hc_head_fn": torch.randn(2, 2 * c, generator=gen),
            "mtp.0.hc_head_base": torch.randn(2, generator=gen), "mtp.0.hc_head_scale": torch.randn(1, generator=gen)}  # fmt: skip
    mtp |= {f"mtp.0.{n}.weight": torch.randn(c, generator=gen) for n in ("enorm", "hnorm", "norm")}
    save_file(layer | mtp, str(path / "model.safetensors"))
    model = load_model(path, CPU).model
    mine = {k: v for k, v in model.state_dict().items() if k.startswith("mtp.")}
    assert len(mine) == len(mtp)
    from engine.model.deepseek_v4_names import checkpoint_name

    for name, tensor in mtp.items():
        assert torch.equal(mine[checkpoint_name(name)], tensor), name
    ids = tokens(20, seed=3)
    with torch.no_grad():
        expected = hf(torch.tensor([ids]), use_cache=False).logits[0]  # type: ignore[operator]
    assert (our_logits(model, ids, []) - expected).abs().max().item() <= TOLERANCE[torch.float32]
    save_directory(model, config_to_dict(model.config), tmp_path / "again")
    again = load_model(tmp_path / "again", CPU).model
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in again.state_dict().items())
    with torch.no_grad():  # the module runs (a later speculative-decoding issue calls it)
        state = again.new_dense_state()
        t = torch.tensor(ids)
        streams = again.model.embed_tokens(t).unsqueeze(1).expand(-1, 2, -1)
        assert again.mtp[0].predict(again.model.embed_tokens(t), streams, t, torch.arange(20), state).shape == (20, c)
