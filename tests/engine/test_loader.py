"""Loading model directories: a saved checkpoint round-trips exactly, every broken directory fails
with a message naming the tensor or field, and a tokenizer.json is used when present."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import HybridConfig, hybrid_config_to_dict
from engine.loader import ModelLoadError, load_model, save_directory
from engine.model.hybrid import HybridForCausalLM
from engine.tokenizer import HFTokenizer, StreamDecoder
from tests.helpers import TOLERANCE, tokens

CPU = torch.device("cpu")


def saved(tmp_path: Path, config: HybridConfig | None = None) -> tuple[Path, HybridForCausalLM]:
    config = config or HybridConfig(seed=5, revision="test")
    model = HybridForCausalLM(config)
    model.init_random(config.seed)
    save_directory(model, hybrid_config_to_dict(config), tmp_path / "ckpt")
    return tmp_path / "ckpt", model


def test_saved_checkpoint_round_trips_exactly(tmp_path: Path) -> None:
    path, model = saved(tmp_path)
    llm = LLM(str(path), device="cpu")
    ids = tokens(70, 1)
    with torch.no_grad():
        reference = model(torch.tensor(ids), torch.arange(70), model.new_dense_state())
    assert torch.equal(llm.prefill_logits(ids), reference)
    assert llm.model_name == str(path) and llm.layout.revision.startswith("test+")


def test_revision_defaults_to_a_content_hash(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    del raw["revision"]
    (path / "config.json").write_text(json.dumps(raw))
    first = load_model(path, CPU).model.layout.revision
    tensors = load_file(str(path / "model.safetensors"))
    tensors["norm.weight"] = tensors["norm.weight"] * 2
    save_file(tensors, str(path / "model.safetensors"))
    assert load_model(path, CPU).model.layout.revision != first  # other weights, other prefixes


def test_a_declared_revision_still_tells_two_trainings_apart(tmp_path: Path) -> None:
    """Retraining into the same folder keeps config.json's revision; stored state (the disk
    tier survives restarts) must not be reused across the two weight sets."""
    path, _ = saved(tmp_path)
    first = load_model(path, CPU).model.layout.revision
    tensors = load_file(str(path / "model.safetensors"))
    tensors["norm.weight"] = tensors["norm.weight"] * 2
    save_file(tensors, str(path / "model.safetensors"))
    second = load_model(path, CPU).model.layout.revision
    assert first.startswith("test+") and second.startswith("test+") and first != second


def break_weights(path: Path, change) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.pop("layers.3.mixer.k_proj.weight"), "missing tensors layers.3.mixer.k_proj.weight"),
        (lambda t: t.update(extra=torch.zeros(2)), "unexpected tensors extra"),
        (lambda t: t.update({"norm.weight": torch.ones(65)}), "tensor norm.weight has shape (65,), the config needs (64,)"),
        (lambda t: t.update({"norm.weight": torch.ones(64, dtype=torch.int8)}), "tensor norm.weight has dtype torch.int8"),
    ],
)
def test_broken_weights_name_the_tensor(tmp_path: Path, change, message: str) -> None:
    path, _ = saved(tmp_path)
    break_weights(path, change)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(path, CPU)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(model_type="llama"), "model_type 'llama' is not supported; supported: deepseek_v4, kvscope_hybrid, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_next"),
        (lambda c: c.update(mystery=1), "unknown field 'mystery'"),
        (lambda c: c.update(hidden_size="64"), "field 'hidden_size' must be an integer"),
        (lambda c: c.update(layer_types=["full_attention", "cross_attention"]), r"layer_types\[1\] = 'cross_attention'"),
    ],
)
def test_broken_config_names_the_field(tmp_path: Path, edit, message: str) -> None:
    path, _ = saved(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=message) as err:
        load_model(path, CPU)
    assert "config.json" in str(err.value)


def test_not_a_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path, CPU)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match=r"config\.json: cannot read"):
        load_model(tmp_path, CPU)
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        LLM("nope")


def test_tokenizer_json_is_used(tmp_path: Path, shared_data: Path) -> None:
    config = HybridConfig(vocab_size=50304, hidden_size=32, intermediate_size=64, seed=1, revision="tok")
    path, _ = saved(tmp_path, config)
    shutil.copy(shared_data / "tokenizers" / "20B_tokenizer.json", path / "tokenizer.json")
    llm = LLM(str(path), device="cpu")
    assert isinstance(llm.tokenizer, HFTokenizer) and llm.tokenizer.vocab_size == 50277
    text = "Hello world, ünïcode"
    assert llm.tokenizer.decode(llm.tokenizer.encode(text)) == text
    streamed: list[str] = []
    decoder = StreamDecoder(llm.tokenizer)
    out = llm.generate(text, SamplingParams(max_tokens=6), on_token=lambda _i, t: streamed.append(decoder.push(t)))[0]
    streamed.append(decoder.finish())
    assert out.prompt_token_ids == llm.tokenizer.encode(text)
    assert "".join(streamed) == out.text == llm.tokenizer.decode(out.output_token_ids)


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path: Path, shared_data: Path) -> None:
    path, _ = saved(tmp_path)
    shutil.copy(shared_data / "tokenizers" / "20B_tokenizer.json", path / "tokenizer.json")
    with pytest.raises(ModelLoadError, match="50277 tokens but the model's vocab_size is 256"):
        load_model(path, CPU)


def test_byte_stream_decoder_never_splits_a_character() -> None:
    from engine.tokenizer import ByteTokenizer

    decoder = StreamDecoder(ByteTokenizer())
    pieces = [decoder.push(b) for b in "añ€".encode()]
    assert pieces == ["a", "", "ñ", "", "", "€"]
    assert decoder.finish() == ""


def test_kvscope_generate_streams_the_greedy_completion(capsys: pytest.CaptureFixture[str]) -> None:
    from kvscope.cli import main

    with pytest.raises(SystemExit) as done:
        main(["generate", "--prompt", "The cache", "--max-tokens", "7"])
    assert done.value.code == 0
    expected = LLM("kvscope_hybrid-small").generate("The cache", SamplingParams(max_tokens=7))[0].text
    assert capsys.readouterr().out == "The cache" + expected + "\n"


def test_the_config_dtype_is_honoured_and_the_argument_overrides_it(tmp_path: Path) -> None:
    path, model = saved(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "torch_dtype": "float16"}))
    half = LLM(str(path), device="cpu")
    pool = next(iter(half.cache.kv_forms[0].kv_groups.values()))
    assert half.dtype == torch.float16 and pool.dtype == torch.float16
    assert all(p.dtype == torch.float16 for p in half.model.parameters())
    ids = tokens(70, 1)
    half.score(ids)
    follow_up = [*ids, *tokens(20, 2)]
    warm = half.score(follow_up)
    assert warm.resume_tokens == 64
    cold = half.prefill_logits(follow_up)[warm.resume_tokens :]
    assert (warm.logits - cold).abs().max().item() <= TOLERANCE[torch.float16]
    exact = LLM(str(path), device="cpu", dtype="float32")  # the argument (the CLI's --dtype) wins
    with torch.no_grad():
        reference = model(torch.tensor(ids), torch.arange(70), model.new_dense_state())
    assert exact.dtype == torch.float32 and torch.equal(exact.prefill_logits(ids), reference)


def test_bfloat16_runs_on_cpu_with_bfloat16_pools() -> None:
    llm = LLM("deepseek_v4-tiny", device="cpu", dtype="bfloat16", check_invariants=True)
    assert llm.dtype == torch.bfloat16
    assert {t.tensor.dtype for f in llm.cache.forms if f.form != "linear_state" for t in f.stored_tensors()} == {torch.bfloat16}
    ids = tokens(40, 3)
    llm.score(ids)
    out = llm.score([*ids, *tokens(9, 4)])
    assert out.resume_tokens == 32 and torch.isfinite(out.logits).all()


@pytest.mark.parametrize(("where", "value"), [("config", "int4"), ("argument", "float64")])
def test_an_unsupported_dtype_names_where_it_came_from(tmp_path: Path, where: str, value: str) -> None:
    path, _ = saved(tmp_path)
    if where == "config":
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, "dtype": value}))
    with pytest.raises(ModelLoadError, match=rf"{'config.json: ' if where == 'config' else ''}dtype = '{value}' is not supported; supported: float32, bfloat16, float16"):
        load_model(path, CPU, None if where == "config" else value)


def test_kvscope_generate_runs_in_the_dtype_asked(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.loader import DTYPE_NAMES
    from kvscope.cli import main
    from kvscope.cli_parser import DTYPES

    assert tuple(DTYPE_NAMES) == DTYPES
    with pytest.raises(SystemExit) as done:
        main(["generate", "--model", "qwen3_next-tiny", "--dtype", "float16", "--prompt", "ab", "--max-tokens", "5"])
    assert done.value.code == 0
    half = LLM("qwen3_next-tiny", dtype="float16").generate("ab", SamplingParams(max_tokens=5))[0].text
    assert capsys.readouterr().out == "ab" + half + "\n"


def test_kvscope_generate_takes_a_cache_budget_and_refuses_one_too_small(capsys: pytest.CaptureFixture[str]) -> None:
    from kvscope.cli import main

    with pytest.raises(SystemExit) as done:
        main(["generate", "--model", "qwen3_next-tiny", "--device", "cpu", "--cache-memory-mib", "2", "--prompt", "ab", "--max-tokens", "3"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("ab")
    with pytest.raises(SystemExit) as done:
        main(["generate", "--model", "deepseek_v4-tiny", "--cache-memory-mib", "1", "--prompt", "ab"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith("kvscope generate: a cache budget of 1.00 MiB cannot hold") and "Traceback" not in err
