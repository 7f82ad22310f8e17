"""Loading a model: a preset name, a config object, or a Hugging-Face-style directory.

A directory holds ``config.json`` (its ``model_type`` picks the family), one
``*.safetensors`` file or shards named by ``model.safetensors.index.json``
(:mod:`engine.weight_files`), and optionally ``tokenizer.json``. Loading is strict: every parameter of
the model must be present with its exact shape, no unknown tensor may be left over, and only
float dtypes are accepted (integer tables such as a hash router's ``tid2eid`` as integers) — each failure names the file and the tensor or field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.fp8_weights import Fp8Format, scale_names
from engine.load_errors import ModelLoadError
from engine.model.base import CausalLM, ModelLayout
from engine.presets import PRESETS, preset_names
from engine.quantized_load import check_quantized, dequantize, is_quantized
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from engine.weight_files import TensorInfo, WeightFiles, progress, save_sharded

log = logging.getLogger(__name__)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class Family:
    """How to build one model family: its config from a ``config.json`` mapping, then the module.

    ``config_from_dict`` raises ``ValueError`` naming the bad field; ``build`` returns an
    ``nn.Module`` implementing :class:`engine.model.base.CausalLM`.
    """

    module: str
    config_from_dict: str
    build: str
    checkpoint_name: str | None = None
    """A function of the module mapping a checkpoint's tensor name to the model's (None: a
    tensor the engine does not load, such as a vision tower); absent: names are the model's."""

    def resolve(self) -> tuple[Callable[[Mapping[str, Any]], Any], Callable[[Any], CausalLM]]:
        mod = importlib.import_module(self.module)
        return getattr(mod, self.config_from_dict), getattr(mod, self.build)

    def names(self) -> Callable[[str], str | None]:
        if self.checkpoint_name is None:
            return lambda name: name
        return getattr(importlib.import_module(self.module), self.checkpoint_name)


QWEN3_5 = Family("engine.model.qwen3_5", "config_from_dict", "build", "checkpoint_name")
FAMILIES: Mapping[str, Family] = {
    "kvscope_hybrid": Family("engine.model.hybrid", "config_from_dict", "build"),
    "qwen3_next": Family("engine.model.qwen3_next", "config_from_dict", "build"),
    "deepseek_v4": Family("engine.model.deepseek_v4", "config_from_dict", "build", "checkpoint_name"),
    **dict.fromkeys(("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"), QWEN3_5),
}
"""``model_type`` → family."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready to run: the module (eval mode, on its device), its tokenizer and the name
    events carry (a preset name or the directory's path)."""

    model: CausalLM
    tokenizer: Tokenizer
    name: str


DTYPE_NAMES: Mapping[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The weight dtypes a model runs in (``config.json``'s ``dtype`` / ``torch_dtype``, ``--dtype``)."""


def resolve_dtype(name: str | torch.dtype | None, where: str = "dtype") -> torch.dtype | None:
    """``name`` (``float32``, ``bfloat16``, ``float16``, or a torch dtype) as a torch dtype.

    Raises:
        ModelLoadError: another name, naming ``where`` it came from.
    """
    if name is None or (isinstance(name, torch.dtype) and name in DTYPE_NAMES.values()):
        return name
    found = DTYPE_NAMES.get(str(name).removeprefix("torch."))
    if found is None:
        raise ModelLoadError(f"{where} = {name!r} is not supported; supported: {', '.join(DTYPE_NAMES)}")
    return found


Precheck = Callable[[ModelLayout, int, torch.dtype], None]
"""Called with the model's layout, its weights' bytes and dtype before anything is allocated
(the model built on the meta device); raises to refuse the load."""


def _precheck(build: Callable[[Any], CausalLM], config: Any, dtype: torch.dtype, precheck: Precheck | None) -> None:
    if precheck is None:
        return
    with torch.device("meta"):
        meta = build(config)
    meta.to_dtype(dtype)
    weights = sum(t.numel() * t.element_size() for t in (*meta.parameters(), *meta.buffers()))
    precheck(meta.layout, weights, dtype)


def load_model(
    ref: str | Path | Any, device: torch.device, dtype: str | torch.dtype | None = None, precheck: Precheck | None = None
) -> LoadedModel:
    """Load a preset name, a model directory, or a family config object (random weights), its
    weights in ``dtype`` (else a directory's ``config.json`` ``dtype`` / ``torch_dtype``, else
    float32).

    Raises:
        ModelLoadError: an unknown preset, a missing or malformed ``config.json``, an unknown
            ``model_type``, missing / unexpected / misshapen tensors, an unsupported dtype.
    """
    dtype = resolve_dtype(dtype)
    if not isinstance(ref, str | Path):
        model_type = getattr(ref, "model_type", None)
        if model_type not in FAMILIES:
            raise ModelLoadError(f"{type(ref).__name__} is not a model config (model_type {model_type!r})")
        return _random(ref, f"{model_type}@{getattr(ref, 'revision', 'random')}", device, dtype, precheck)
    path = Path(ref)
    if path.is_dir():
        return load_directory(path, device, dtype=dtype, precheck=precheck)
    preset = PRESETS.get(str(ref))
    if preset is None:
        raise ModelLoadError(f"unknown model {str(ref)!r}: not a preset ({', '.join(preset_names())}) and not a model directory")
    if preset.directory is not None:
        return load_directory(preset.directory, device, name=str(ref), dtype=dtype, precheck=precheck)
    config_from_dict, _ = FAMILIES[preset.model_type].resolve()
    return _random(config_from_dict({"model_type": preset.model_type, **preset.fields}), str(ref), device, dtype, precheck)


def _random(config: Any, name: str, device: torch.device, dtype: torch.dtype | None, precheck: Precheck | None = None) -> LoadedModel:
    _, build = FAMILIES[config.model_type].resolve()
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        # random weights are named by everything that makes them: the config and the seed
        digest = hashlib.sha256(f"{config!r}|seed={getattr(config, 'seed', 0)}".encode()).hexdigest()[:12]
        config = dataclasses.replace(config, revision=f"{getattr(config, 'revision', 'random')}+{digest}")
    _precheck(build, config, dtype or torch.float32, precheck)
    model = build(config)
    model.init_random(getattr(config, "seed", 0))
    model.to_dtype(dtype or torch.float32).to(device).eval()
    return LoadedModel(model, ByteTokenizer(), name)


def load_directory(
    path: Path, device: torch.device, name: str | None = None, dtype: torch.dtype | None = None, precheck: Precheck | None = None
) -> LoadedModel:
    """Load ``config.json`` + ``*.safetensors`` (+ ``tokenizer.json``) from ``path``, in
    ``dtype`` (else the config's ``dtype`` / ``torch_dtype``, else float32)."""
    config_path = path / "config.json"
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no config.json (not a model directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_path}: cannot read: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path}: expected a JSON object")
    model_type = raw.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ModelLoadError(
            f"{config_path}: model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    config_from_dict, build = family.resolve()
    quantization = raw.pop("quantization_config", None)
    expert_dtype = raw.pop("expert_dtype", None)  # DeepSeek-V4 writes it beside quantization_config
    if expert_dtype is not None:
        if not isinstance(quantization, dict):
            raise ModelLoadError(f"{config_path}: expert_dtype = {expert_dtype!r} without a quantization_config")
        quantization = {"expert_dtype": expert_dtype, **quantization}
    try:
        fp8 = None if quantization is None else Fp8Format.from_config(quantization if isinstance(quantization, dict) else {})
    except ValueError as exc:
        raise ModelLoadError(f"{config_path}: {exc}") from None
    text_config = raw.get("text_config")
    text: dict[str, Any] = text_config if isinstance(text_config, dict) else {}  # the VL layout keeps it there
    declared_dtype = raw.get("dtype", raw.get("torch_dtype", text.get("dtype", text.get("torch_dtype"))))
    dtype = dtype or resolve_dtype(declared_dtype, f"{config_path}: dtype") or torch.float32
    try:
        declared = raw.get("revision")
        content = _revision(path)  # a declared revision alone may name two different trainings
        config = config_from_dict({**raw, "revision": f"{declared}+{content}" if declared else content})
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"{config_path}: {exc}") from None
    _precheck(build, config, dtype, precheck)
    with torch.device("meta"):  # built without memory, then allocated in its dtype: one copy of the weights
        model = build(config)
    model = model.to_dtype(dtype).to_empty(device="cpu")  # every parameter is then read from the checkpoint
    _load_weights(model, path, family.names(), fp8)
    try:
        model.check_weights()
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    tokenizer = _tokenizer(path, config)
    model.to(device).eval()
    return LoadedModel(model, tokenizer, name or str(path))


def _revision(path: Path) -> str:
    """A content hash of the config and weights: two different checkpoints never share one."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def _load_weights(
    model: nn.Module, path: Path, names: Callable[[str], str | None] = lambda name: name, fp8: Fp8Format | None = None
) -> None:
    """Check every tensor from the files' headers (names, shapes, dtypes), then copy them into
    the model's parameters one at a time (peak: the model plus one tensor). ``names`` maps a
    checkpoint name to the model's (None: not loaded; logged once per leading name part); with
    ``fp8``, a ``float8_e4m3fn`` weight and its ``weight_scale_inv`` are dequantized into it."""
    with WeightFiles.open(path) as files:
        if getattr(model, "mtp", None) is not None and not any(k.startswith("mtp.") for k in files.tensors):
            # declared in the config, absent from the files (transformers drops mtp.* when it saves)
            log.info("%s: the config declares an MTP module but no mtp.* tensor is stored; loaded without it", path)
            model.mtp = None  # type: ignore[assignment]
        expected = model.state_dict()
        found: dict[str, TensorInfo] = {}
        stored_as: dict[str, str] = {}  # the model's name -> the checkpoint's
        skipped: dict[str, int] = {}
        scales = scale_names(set(files.tensors)) if fp8 is not None else {}  # scale -> its weight
        scale_of = {weight: scale for scale, weight in scales.items()}
        for key, info in files.tensors.items():
            mine = names(scales[key]) if key in scales else names(key)
            if mine is None:
                part = ".".join(key.split(".")[:2])
                skipped[part] = skipped.get(part, 0) + 1
                continue
            if key in scales:
                continue
            if mine in found:
                raise ModelLoadError(f"{info.file}: tensors {stored_as[mine]} and {key} are both {mine}")
            found[mine], stored_as[mine] = info, key
        for part, n in skipped.items():
            log.info("%s: %d tensors under %s.* are not loaded (this engine does not run them)", path, n, part)
        aliases = getattr(model, "tied_weights", {})  # name -> the parameter it shares storage with
        missing = [k for k in expected if k not in found and k not in aliases]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ModelLoadError(f"{path}: missing tensors {', '.join(missing[:5])}{more}")
        unexpected = [stored_as[k] for k in found if k not in expected]
        weights = set(stored_as.values())
        unexpected += [k for k, weight in scales.items() if weight not in weights]
        if unexpected:
            more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
            raise ModelLoadError(f"{path}: unexpected tensors {', '.join(unexpected[:5])}{more}")
        quantized: dict[str, str] = {}  # weight -> its scale
        for mine, info in found.items():
            key = stored_as[mine]
            if fp8 is not None and is_quantized(info, fp8):
                quantized[key] = check_quantized(files, key, info, fp8, scale_of.get(key), tuple(expected[mine].shape))
                continue
            if not expected[mine].is_floating_point():
                if not isinstance(info.torch_dtype, torch.dtype) or info.torch_dtype.is_floating_point or info.torch_dtype == torch.bool:
                    raise ModelLoadError(f"{info.file}: tensor {key} has dtype {info.torch_dtype}; the model's {mine} is an integer table")
            elif info.torch_dtype not in FLOAT_DTYPES:
                raise ModelLoadError(f"{info.file}: tensor {key} has dtype {info.torch_dtype}; supported: float32, float16, bfloat16")
            if info.shape != tuple(expected[mine].shape):
                raise ModelLoadError(f"{info.file}: tensor {key} has shape {info.shape}, the config needs {tuple(expected[mine].shape)}")
        order = files.by_file(stored_as.values())
        model_name = {key: mine for mine, key in stored_as.items()}
        with torch.no_grad():
            for _, key in progress(order):
                target = expected[model_name[key]]  # state_dict tensors share the parameters' storage
                if key in quantized and fp8 is not None:
                    target.copy_(dequantize(fp8, files.read(key), files.read(quantized[key])))
                else:
                    files.read_into(key, target)
    for name, source in aliases.items():
        if name not in found:
            model.get_parameter(name).data = model.get_parameter(source).data


def _tokenizer(path: Path, config: Any) -> Tokenizer:
    vocab = int(config.vocab_size)
    tok_path = path / "tokenizer.json"
    if tok_path.exists():
        tok: Tokenizer = HFTokenizer(tok_path)
        if tok.vocab_size > vocab:
            raise ModelLoadError(f"{tok_path}: {tok.vocab_size} tokens but the model's vocab_size is {vocab}")
        return tok
    if vocab < 256:
        raise ModelLoadError(f"{path}: no tokenizer.json and vocab_size {vocab} < 256 cannot hold the byte tokenizer")
    return ByteTokenizer()


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy when it is a view into a larger storage (packed parameters such as
    Qwen3-Next's experts save as slices of one tensor, which safetensors refuses)."""
    return t.clone() if t.untyped_storage().nbytes() != t.nbytes else t


def save_directory(model: nn.Module, config_dict: Mapping[str, Any], path: Path, max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and the weights (float32; integer tables as they are) for ``model``: ``model.safetensors``, or
    shards with their index past ``max_shard_bytes`` (:func:`engine.weight_files.save_sharded`)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(config_dict), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    aliases = getattr(model, "tied_weights", {})
    tensors = {
        k: _own_storage((v.detach().float() if v.is_floating_point() else v.detach()).cpu())
        for k, v in model.state_dict().items()
        if k not in aliases
    }
    save_sharded(tensors, path, max_shard_bytes)
