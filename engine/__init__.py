"""kvscope's inference engine (DESIGN.md §4).

The public names are imported lazily so that ``import engine.events`` (the telemetry schema the
agent shares) does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.cache.config import CacheConfig
    from engine.llm import LLM
    from engine.outputs import RequestOutput, ScoreOutput
    from engine.sampling import SamplingParams

__all__ = ["LLM", "CacheConfig", "RequestOutput", "SamplingParams", "ScoreOutput"]

_EXPORTS = {
    "LLM": "engine.llm",
    "CacheConfig": "engine.cache.config",
    "RequestOutput": "engine.outputs",
    "ScoreOutput": "engine.outputs",
    "SamplingParams": "engine.sampling",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
