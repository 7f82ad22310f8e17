"""The multi-token-prediction module of released Qwen3-Next and Qwen3.5 checkpoints (``mtp.*``,
which transformers skips): every tensor lands in a parameter of its shape, the main model's
logits do not change, and a save and load round trip keeps it bit for bit (issue 21, item 3).

The ``mtp.*`` tensors are added to transformers-saved tiny checkpoints in the released layout:
``fc [C, 2C]``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden`` and ``norm`` ``[C]``, and
``layers.0.*`` shaped as one of the checkpoint's own full-attention layers (with its MLP kind).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.loader import ModelLoadError, load_model, save_directory
from tests.helpers import tokens

transformers = pytest.importorskip("transformers")

from tests.models import test_qwen3_5_parity as qwen3_5  # noqa: E402 (needs transformers)
from tests.models import test_qwen3_next_parity as qwen3_next  # noqa: E402

CPU = torch.device("cpu")


def with_mtp(path: Path, layer: int, seed: int) -> dict[str, torch.Tensor]:
    """Add ``mtp.*`` (one layer shaped as checkpoint layer ``layer``) to ``path``; returns them."""
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    gen = torch.Generator().manual_seed(seed)
    c = tensors["model.embed_tokens.weight"].shape[1]
    prefix = f"model.layers.{layer}."
    mtp = {f"mtp.layers.0.{k.removeprefix(prefix)}": torch.randn(v.shape, generator=gen) * 0.05 for k, v in tensors.items() if k.startswith(prefix)}
    mtp |= {"mtp.fc.weight": torch.randn(c, 2 * c, generator=gen) * 0.05}
    mtp |= {f"mtp.{n}.weight": torch.randn(c, generator=gen) * 0.1 for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    save_file(tensors | mtp, str(weights))
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}))
    return mtp


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_mtp_tensors_load_into_the_module_and_round_trip(tmp_path: Path, family: str) -> None:
    path = tmp_path / "ckpt"
    if family == "qwen3_next":  # layer 4: full attention with the MoE block
        hf = qwen3_next.save_hf_checkpoint(path, 0, **qwen3_next.VARIANTS["mixed"])
        mtp = with_mtp(path, 4, 1)
    else:  # layer 1: full attention with the dense MLP
        hf = qwen3_5.save_hf_checkpoint(path, "dense", 0)
        mtp = with_mtp(path, 1, 1)
    model = load_model(path, CPU).model
    mine = {k: v for k, v in model.state_dict().items() if k.startswith("mtp.")}
    assert set(mine) == set(mtp)
    for name, tensor in mtp.items():
        assert mine[name].shape == tensor.shape and torch.equal(mine[name], tensor), name
    ids = tokens(40, seed=2)
    llm = LLM(str(path), device="cpu")
    assert (llm.prefill_logits(ids) - qwen3_next.hf_logits(hf, ids)).abs().max().item() <= qwen3_next.ATOL
    save_directory(model, json.loads((path / "config.json").read_text()), tmp_path / "again")
    again = load_model(tmp_path / "again", CPU).model.state_dict()
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())


def test_a_checkpoint_missing_an_mtp_tensor_its_config_declares_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    qwen3_5.save_hf_checkpoint(path, "dense", 0)
    with_mtp(path, 1, 1)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["mtp.fc.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensors mtp\.fc\.weight"):
        load_model(path, CPU)


def test_mtp_forward_gives_hidden_states_of_the_model_width() -> None:
    """The module runs (shapes only: there is no reference implementation to compare with)."""
    from engine.model.layers import rotary_cos_sin
    from engine.model.qwen3_next import Qwen3NextForCausalLM, config_from_dict

    raw = {**qwen3_next.TINY, "layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2, "mtp_num_hidden_layers": 1}
    model = Qwen3NextForCausalLM(config_from_dict(raw))
    model.init_random(0)
    assert model.mtp is not None
    t, c = 5, raw["hidden_size"]
    with torch.no_grad():
        out = model.mtp(torch.randn(t, c), torch.randn(t, c), torch.arange(t), rotary_cos_sin(torch.arange(t), model.config.rotary_dim, model.config.rope_theta), model.new_dense_state())
    assert out.shape == (t, c) and torch.isfinite(out).all()


def test_a_config_declaring_mtp_without_its_tensors_loads_without_the_module(tmp_path: Path) -> None:
    """transformers drops ``mtp.*`` when it saves a model it loaded, keeping the config's
    ``mtp_num_hidden_layers``: such a directory loads, without the module."""
    path = tmp_path / "ckpt"
    qwen3_5.save_hf_checkpoint(path, "dense", 0)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"mtp_num_hidden_layers": 1}))
    assert load_model(path, CPU).model.mtp is None
