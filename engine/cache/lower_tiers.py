"""What a block pool needs of the host/disk tiers below it (DESIGN.md §3 "Tiers").

A pool hands every block it evicts to its lower tiers first (write-back), asks them for an
object's copy while it is in *tier view*, and tells them when an object was declared wrong. The
tiers (:class:`engine.cache.tiers.TierStore`) implement this protocol; the pool
(:class:`engine.cache.block_pool.BlockPool`) only sees the protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from engine.cache.hashing import BlockHash

if TYPE_CHECKING:
    from engine.cache.block_pool import BlockPool


class LowerTiers(Protocol):
    """What a pool needs of the host/disk tiers (:class:`engine.cache.tiers.TierStore`)."""

    version: int

    def readable(self, pool: str, h: BlockHash) -> object | None:
        """The verified-on-write entry of ``pool`` cached under ``h`` (``OFFLOADED``), if any."""
        ...

    def offload(self, pool: BlockPool, block: int, h: BlockHash) -> None:
        """Copy a cached block's object down before the block is reused (write-back)."""
        ...

    def drop(self, pool: str, h: BlockHash) -> None:
        """Forget the lower-tier copy of an object declared wrong."""
        ...
