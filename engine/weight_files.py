"""The safetensors files of a model directory, as Hugging Face lays them out: one file, or
shards named by ``model.safetensors.index.json`` (its ``weight_map``: tensor name → file).

Every file is validated by the safetensors library (``safe_open``) and only its header is read
up front, so the whole checkpoint is checked — the index against the files (every shard it names
present, no ``*.safetensors`` file left out, every tensor it names held by its file and every
tensor of a file named) and each file intact — before any tensor is read. Tensors are then read
one at a time with positioned reads straight into the model's parameters
(:meth:`WeightFiles.read_into`; no memory map, whose touched pages would stay resident): loading
holds the model plus at most one tensor, not the checkpoint twice. Layout source: the
safetensors format and transformers' ``modeling_utils`` sharded-checkpoint format.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.load_errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
DTYPES: Mapping[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
"""safetensors dtype codes → torch dtypes."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's header entry: its file, safetensors dtype code (``F32``, ``BF16``,
    ``F8_E4M3``, ...) and shape."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int = 0
    """Byte offset of its data in the file."""
    nbytes: int = 0

    @property
    def torch_dtype(self) -> torch.dtype | str:
        """The torch dtype (the code itself when torch has none)."""
        return DTYPES.get(self.dtype, self.dtype)


class WeightFiles:
    """The checked header of every weight file of a directory; a context manager that keeps the
    files open (memory-mapped) for :meth:`read`.

    Raises (from :meth:`open`):
        ModelLoadError: no weights, an unreadable / truncated / corrupt file (named), a malformed
            index, a shard the index names that is missing, a file the index leaves out, a
            tensor the index names that its file lacks (or the other way round), a tensor in two
            files.
    """

    def __init__(self, directory: Path, files: list[Path], tensors: dict[str, TensorInfo], index: Path | None) -> None:
        self.directory = directory
        self.files = files
        self.tensors = tensors
        self.index = index
        """The index file, when the checkpoint is sharded (None: the files were globbed)."""
        self._stack = ExitStack()
        self._open: tuple[Path, io.BufferedReader] | None = None

    # -- discovery ---------------------------------------------------------------------------
    @classmethod
    def open(cls, directory: Path) -> WeightFiles:
        index = directory / INDEX_FILE
        if index.exists():
            files, mapping = _read_index(index)
        else:
            files, mapping = sorted(directory.glob("*.safetensors")), None
            if not files:
                raise ModelLoadError(f"{directory}: no *.safetensors weights")
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in _header(f).items():
                if name in tensors:
                    raise ModelLoadError(f"{f}: tensor {name} also appears in {tensors[name].file.name}")
                if mapping is not None and mapping.get(name) != f.name:
                    where = f"names it in {mapping[name]}" if name in mapping else "does not name it"
                    raise ModelLoadError(f"{f}: holds tensor {name}, but {INDEX_FILE} {where}")
                tensors[name] = info
        if mapping is not None:
            absent = [name for name in mapping if name not in tensors]
            if absent:
                more = f" (and {len(absent) - 5} more)" if len(absent) > 5 else ""
                shown = ", ".join(f"{n} ({mapping[n]})" for n in absent[:5])
                raise ModelLoadError(f"{index}: names tensors no file holds: {shown}{more}")
        return cls(directory, files, tensors, index if mapping is not None else None)

    # -- reading -----------------------------------------------------------------------------
    def __enter__(self) -> WeightFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._open = None

    def read_into(self, name: str, target: torch.Tensor) -> None:
        """Copy tensor ``name`` into ``target`` (same shape): its bytes are read straight into
        ``target``'s storage when the dtypes agree and it is contiguous, else through one
        temporary tensor — never through a memory map, so a load holds the model plus at most
        one tensor. One file is open at a time (read in :meth:`by_file` order).

        Raises:
            ModelLoadError: its bytes cannot be read (named with the file).
            KeyError: no file holds ``name`` (check :attr:`tensors` first).
        """
        info = self.tensors[name]
        dtype = info.torch_dtype
        direct = target.dtype == dtype and target.is_contiguous() and target.device.type == "cpu"
        buffer = target if direct else torch.empty(info.shape, dtype=dtype)  # type: ignore[arg-type]
        if buffer.nbytes != info.nbytes:
            raise ModelLoadError(f"{info.file}: tensor {name} holds {info.nbytes} bytes, its header's shape and dtype need {buffer.nbytes}")
        if self._open is None or self._open[0] != info.file:
            if self._open is not None:
                self._open[1].close()
            self._open = (info.file, self._stack.enter_context(info.file.open("rb")))
        fh = self._open[1]
        try:
            fh.seek(info.start)
            got = fh.readinto(buffer.reshape(-1).view(torch.uint8).numpy().data)
        except OSError as exc:
            raise ModelLoadError(f"{info.file}: tensor {name} cannot be read ({exc})") from None
        if got != info.nbytes:
            raise ModelLoadError(f"{info.file}: tensor {name} is cut short ({got} of {info.nbytes} bytes)")
        if not direct:
            target.copy_(buffer)

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a new CPU tensor (see :meth:`read_into`)."""
        info = self.tensors[name]
        out = torch.empty(info.shape, dtype=info.torch_dtype)  # type: ignore[arg-type]
        self.read_into(name, out)
        return out

    def by_file(self, names: Iterable[str]) -> dict[Path, list[str]]:
        """``names`` grouped by the file holding them, in file order (one file open at a time)."""
        out: dict[Path, list[str]] = {f: [] for f in self.files}
        for name in names:
            out[self.tensors[name].file].append(name)
        return {f: ns for f, ns in out.items() if ns}

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def _read_index(index: Path) -> tuple[list[Path], dict[str, str]]:
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{index}: cannot read: {exc}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ModelLoadError(f"{index}: expected a JSON object with a weight_map of tensor name -> file name")
    directory = index.parent
    names = sorted(set(weight_map.values()))
    for name in names:
        if Path(name).name != name:
            raise ModelLoadError(f"{index}: weight_map names {name!r}, not a file of this directory")
        if not (directory / name).is_file():
            raise ModelLoadError(f"{directory / name}: missing (a shard {INDEX_FILE} names)")
    left_out = sorted(f.name for f in directory.glob("*.safetensors") if f.name not in set(names))
    if left_out:
        raise ModelLoadError(f"{directory / left_out[0]}: a weight file {INDEX_FILE} does not name")
    return [directory / n for n in names], dict(weight_map)


def _header(f: Path) -> dict[str, TensorInfo]:
    """Every tensor of ``f``: the safetensors library validates the file (a truncated or corrupt
    one is refused), then the header's ``data_offsets`` (format: an 8-byte little-endian length,
    that many bytes of JSON, the data) give where each tensor's bytes lie."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(f), framework="pt"):
            pass
        with f.open("rb") as fh:
            length = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(length))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{f}: not a readable safetensors file ({exc})") from None
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = TensorInfo(f, str(entry["dtype"]), tuple(int(d) for d in entry["shape"]), 8 + length + begin, end - begin)
    return out


def progress(files: Mapping[Path, list[str]]) -> Iterator[tuple[Path, str]]:
    """Every (file, tensor name) of ``files``, with a progress bar per file when stderr is a
    terminal (rich); silent otherwise."""
    if not sys.stderr.isatty():
        for f, names in files.items():
            for name in names:
                yield f, name
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        for f, names in files.items():
            task = bar.add_task(f"loading {f.name}", total=len(names))
            for name in names:
                yield f, name
                bar.advance(task)


def save_sharded(tensors: Mapping[str, torch.Tensor], directory: Path, max_shard_bytes: int | None = None) -> list[Path]:
    """Write ``tensors`` as ``model.safetensors``, or — when they exceed ``max_shard_bytes`` —
    as ``model-0000i-of-0000n.safetensors`` shards (in order, a new shard once the current one
    would pass the limit) with ``model.safetensors.index.json`` (``metadata.total_size``,
    ``weight_map``), as transformers' ``save_pretrained`` does. Returns the files written."""
    from safetensors.torch import save_file

    total = sum(t.nbytes for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(dict(tensors), str(directory / "model.safetensors"))
        return [directory / "model.safetensors"]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(directory / name))
    weight_map = {t: name for name, shard in zip(names, shards, strict=True) for t in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return [directory / name for name in names]
