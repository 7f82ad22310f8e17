"""The prefix cache: per-form pools, the hash chain, the resume-point coordinator.

The public names are imported lazily (as in ``engine/__init__.py``) so that
``from engine.cache.config import CacheConfig`` — what the command line's flag defaults need —
does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.cache.config import CacheConfig
    from engine.cache.coordinator import FormLookup, ResumePlan
    from engine.cache.prefix_cache import FormOccupancy, PrefixCache

__all__ = ["CacheConfig", "FormLookup", "FormOccupancy", "PrefixCache", "ResumePlan"]

_EXPORTS = {
    "CacheConfig": "engine.cache.config",
    "FormLookup": "engine.cache.coordinator",
    "ResumePlan": "engine.cache.coordinator",
    "FormOccupancy": "engine.cache.prefix_cache",
    "PrefixCache": "engine.cache.prefix_cache",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.cache' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
