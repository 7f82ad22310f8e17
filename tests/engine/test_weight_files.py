"""Sharded checkpoints as Hugging Face lays them out (``model.safetensors.index.json``): the index
checked against the files before any tensor is read, tensors read one at a time, and each bad
checkpoint a clear error naming the file or tensor (issue 21, items 1 and 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.config import HybridConfig, hybrid_config_to_dict
from engine.loader import ModelLoadError, load_model, save_directory
from engine.model.hybrid import HybridForCausalLM
from engine.weight_files import INDEX_FILE, WeightFiles
from tests.helpers import tokens

CPU = torch.device("cpu")


def sharded(tmp_path: Path) -> tuple[Path, HybridForCausalLM]:
    config = HybridConfig(seed=5, revision="test")
    model = HybridForCausalLM(config)
    model.init_random(config.seed)
    total = sum(t.nbytes for t in model.state_dict().values())
    save_directory(model, hybrid_config_to_dict(config), tmp_path / "ckpt", max_shard_bytes=total // 3)
    return tmp_path / "ckpt", model


def shard_files(path: Path) -> list[Path]:
    return sorted(path.glob("model-*.safetensors"))


def index_of(path: Path) -> dict:
    return json.loads((path / INDEX_FILE).read_text())


def test_a_sharded_checkpoint_loads_exactly(tmp_path: Path) -> None:
    path, model = sharded(tmp_path)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = index_of(path)
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in model.state_dict().values())
    llm = LLM(str(path), device="cpu")
    ids = tokens(40, 1)
    with torch.no_grad():
        reference = model(torch.tensor(ids), torch.arange(40), model.new_dense_state())
    assert torch.equal(llm.prefill_logits(ids), reference)


def test_tensors_are_read_into_the_parameters_never_through_a_whole_file_or_a_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each tensor's bytes go straight into its parameter (float32 both sides: no temporary):
    never ``load_file`` (the whole file) nor ``get_tensor`` (a memory map whose pages stay
    resident)."""
    path, model = sharded(tmp_path)
    import safetensors
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("a whole file was loaded"))
    real_open = safetensors.safe_open

    class NoTensors:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.inner = real_open(*args, **kwargs)

        def __enter__(self) -> NoTensors:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.__exit__(*exc)

        def get_tensor(self, name: str) -> None:
            pytest.fail(f"{name} was read through a memory map")

    monkeypatch.setattr(safetensors, "safe_open", NoTensors)
    direct: list[bool] = []
    read_into = WeightFiles.read_into

    def recording(self: WeightFiles, name: str, target: torch.Tensor) -> None:
        direct.append(target.dtype == self.tensors[name].torch_dtype and target.is_contiguous())
        read_into(self, name, target)

    monkeypatch.setattr(WeightFiles, "read_into", recording)
    loaded = load_model(path, CPU)
    assert len(direct) == len(index_of(path)["weight_map"]) and all(direct)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name


def test_a_tensor_whose_bytes_disagree_with_its_header_is_refused(tmp_path: Path) -> None:
    path, _ = sharded(tmp_path)
    files = WeightFiles.open(path)
    name, info = next(iter(files.tensors.items()))
    with files, pytest.raises(ModelLoadError, match=rf"tensor {name} holds"):
        files.read_into(name, torch.empty(info.shape[0] + 1, *info.shape[1:]))


def test_a_missing_shard_names_the_file(tmp_path: Path) -> None:
    path, _ = sharded(tmp_path)
    second = shard_files(path)[1]
    second.unlink()
    with pytest.raises(ModelLoadError, match=rf"{second.name}: missing \(a shard"):
        load_model(path, CPU)


def test_an_index_naming_a_tensor_no_file_holds_names_it(tmp_path: Path) -> None:
    path, _ = sharded(tmp_path)
    index = index_of(path)
    index["weight_map"]["layers.9.mixer.q_proj.weight"] = shard_files(path)[0].name
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"names tensors no file holds: layers\.9\.mixer\.q_proj\.weight \(model-00001"):
        load_model(path, CPU)


def test_an_index_pointing_a_tensor_at_the_wrong_file_names_both(tmp_path: Path) -> None:
    path, _ = sharded(tmp_path)
    index = index_of(path)
    name, first = next(iter(sorted(index["weight_map"].items())))
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != first)
    index["weight_map"][name] = other
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=rf"{first}: holds tensor {name}, but {INDEX_FILE} names it in {other}"):
        load_model(path, CPU)


def test_a_weight_file_the_index_leaves_out_is_refused(tmp_path: Path) -> None:
    path, _ = sharded(tmp_path)
    (path / "extra.safetensors").write_bytes(shard_files(path)[0].read_bytes())
    with pytest.raises(ModelLoadError, match=r"extra\.safetensors: a weight file .* does not name"):
        load_model(path, CPU)


@pytest.mark.parametrize("damage", ["truncated", "corrupt header"])
def test_a_damaged_shard_names_the_file(tmp_path: Path, damage: str) -> None:
    path, _ = sharded(tmp_path)
    shard = shard_files(path)[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-64] if damage == "truncated" else b"\xff" * 16 + data[16:])
    with pytest.raises(ModelLoadError, match=rf"{shard.name}: not a readable safetensors file"):
        load_model(path, CPU)


@pytest.mark.parametrize("content", ["{oops", '{"weight_map": {"a": 3}}', "[]"])
def test_a_malformed_index_is_refused(tmp_path: Path, content: str) -> None:
    path, _ = sharded(tmp_path)
    (path / INDEX_FILE).write_text(content)
    with pytest.raises(ModelLoadError, match=INDEX_FILE.replace(".", r"\.")):
        load_model(path, CPU)
