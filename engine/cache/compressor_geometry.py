"""The geometry of DeepSeek-V4 compressed layers as the cache sees it (DESIGN.md §3).

A compressor of ratio r turns every complete group of r tokens into one compressed entry; after
L tokens the complete entries cover ``[0, b)``, ``b = ⌊L/r⌋·r`` (:func:`boundary`), and the
compressor keeps the pending rows ``[b, L)`` plus, when overlapping (CSA), the previous group's
rows (:func:`tail_rows`). Entries are stored in pages of ``P = max(U, r)`` tokens
(:func:`page_tokens`). Layers whose main (``MAIN``) or indexer (``INDEXER``) compressor share one
geometry and element type form a :class:`CompressorGroup`, stored together.

Used by the entry pages (:mod:`engine.cache.entry_pages`), the boundary slots
(:mod:`engine.cache.boundary_slots`) and the forms of :mod:`engine.cache.compressed`.

Source of the state's math: DeepSeek-V4 paper §2.3 and transformers'
``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` / ``DeepseekV4Indexer``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine.model.state import (
    CompressedLayerSpec,
    CompressedLayerState,
    CompressorSpec,
    CompressorState,
)

# which compressor of a layer a group holds
MAIN = "compressor"
INDEXER = "indexer"


def page_tokens(unit_tokens: int, ratio: int) -> int:
    """Tokens one entry page covers: ``max(U, r)``.

    Raises:
        ValueError: r neither divides U nor is a multiple of it.
    """
    if unit_tokens % ratio and ratio % unit_tokens:
        raise ValueError(
            f"compression ratio {ratio} neither divides the prefix-match unit U = {unit_tokens} nor is a "
            f"multiple of it; choose CacheConfig.unit_tokens accordingly (e.g. {ratio} or a divisor of it)"
        )
    return max(unit_tokens, ratio)


def boundary(tokens: int, ratio: int) -> int:
    """``b = ⌊L/r⌋·r``: the prefix the complete compressed entries cover."""
    return tokens - tokens % ratio


def tail_rows(spec: CompressorSpec, tokens: int) -> tuple[int, int]:
    """(pending rows, previous-group rows) a compressor keeps after ``tokens`` tokens."""
    b = boundary(tokens, spec.ratio)
    prev = spec.ratio if spec.overlapping and b >= spec.ratio else 0
    return tokens - b, prev


@dataclass(frozen=True, slots=True)
class CompressorGroup:
    """Layers whose compressor (main or indexer) shares one geometry and element type."""

    which: str
    spec: CompressorSpec
    dtype: torch.dtype
    layers: tuple[int, ...]


def compressor_groups(specs: Mapping[int, CompressedLayerSpec], which: str) -> list[CompressorGroup]:
    """Group the layers of ``specs`` by the geometry of their main (``MAIN``) or indexer
    (``INDEXER``) compressor, in layer order."""
    members: dict[tuple[CompressorSpec, torch.dtype], list[int]] = {}
    for layer in sorted(specs):
        spec = specs[layer].compressor if which == MAIN else specs[layer].indexer
        if spec is not None:
            members.setdefault((spec, specs[layer].dtype), []).append(layer)
    return [CompressorGroup(which, spec, dtype, tuple(layers)) for (spec, dtype), layers in members.items()]


def compressor_state(state: CompressedLayerState, which: str) -> CompressorState:
    """The main (``MAIN``) or indexer (``INDEXER``) compressor state of a layer.

    Raises:
        RuntimeError: the layer state lacks that compressor (an internal invariant).
    """
    cstate = state.compressor if which == MAIN else state.indexer
    if cstate is None:
        raise RuntimeError(f"a compressed layer state without its {which} state")
    return cstate

