"""Named models: tiny random-weight configs of every family, and trained checkpoints shipped with
kvscope (``engine/weights/<name>/``). ``engine.LLM(model=NAME)`` accepts these names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


@dataclass(frozen=True, slots=True, kw_only=True)
class Preset:
    """A random-weight config (``model_type`` plus the fields that differ from the family's
    defaults) or a checkpoint directory."""

    model_type: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    directory: Path | None = None


PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        "kvscope_hybrid-tiny": Preset(model_type="kvscope_hybrid"),
    }
)


def preset_names() -> list[str]:
    return sorted(PRESETS)


def check_model_ref(ref: str | Path) -> None:
    """Fail early (before anything is started) on a reference that names no preset and no
    directory.

    Raises:
        ValueError: naming the reference and the presets.
    """
    if str(ref) in PRESETS or Path(ref).is_dir():
        return
    raise ValueError(f"unknown model {str(ref)!r}: not a preset ({', '.join(preset_names())}) and not a model directory")
