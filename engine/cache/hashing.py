"""The prefix hash chain and the prefix index.

Block i of a sequence (tokens ``[i·U, (i+1)·U)``) has the hash
``h_i = BLAKE2b-128(h_{i−1} ‖ tokens_i as little-endian int32)`` with ``h_{−1}`` a root derived
from the model name, its revision and U, so a hash names a whole prefix, never a block's tokens
alone (as vLLM's prefix caching hashes a block together with its parent's hash).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes
"""16-byte digest naming the prefix ``[0, (i+1)·U)``."""


def root_hash(model: str, revision: str, unit_tokens: int) -> BlockHash:
    """The parent hash of block 0 for one model revision and prefix-match unit."""
    return hashlib.blake2b(f"kvscope|{model}|{revision}|U={unit_tokens}".encode(), digest_size=16).digest()


def chain_hashes(parent: BlockHash, token_ids: Sequence[int], unit_tokens: int) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block gets none).

    ``parent`` is the hash of the block just before ``token_ids[0]`` (the root for a prompt).
    """
    data = np.asarray(token_ids, dtype="<i4").tobytes()
    step = 4 * unit_tokens
    out: list[BlockHash] = []
    h = parent
    for i in range(len(token_ids) // unit_tokens):
        h = hashlib.blake2b(h + data[i * step : (i + 1) * step], digest_size=16).digest()
        out.append(h)
    return out


class PrefixIndex:
    """Which prefixes (by block hash) some form still holds state for.

    Every cached object (a page of any KV form, a recurrent checkpoint) registers the hash it is
    keyed by when it is published and unregisters it when it is evicted; a hash is in the index
    while at least one object holds it. The *hash hit* of a prompt is the longest prefix whose
    hash is in the index — the classic prefix-cache figure, before any form is validated.
    """

    def __init__(self) -> None:
        self._holders: dict[BlockHash, int] = {}

    def add(self, h: BlockHash) -> None:
        self._holders[h] = self._holders.get(h, 0) + 1

    def remove(self, h: BlockHash) -> None:
        count = self._holders.get(h, 0)
        if count <= 0:
            raise RuntimeError(f"prefix index: removing hash {h.hex()} that no object holds")
        if count == 1:
            del self._holders[h]
        else:
            self._holders[h] = count - 1

    def holders(self, h: BlockHash) -> int:
        return self._holders.get(h, 0)

    def __len__(self) -> int:
        return len(self._holders)

    def hit_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading blocks of the longest indexed prefix (scans right to left)."""
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in self._holders:
                return i + 1
        return 0

    def snapshot(self) -> dict[BlockHash, int]:
        return dict(self._holders)
