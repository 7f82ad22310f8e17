"""BlockPool: exact block ids, LRU eviction order, sentinel, double free, duplicate publish."""

from __future__ import annotations

import pytest

from engine.cache.block_pool import SENTINEL_BLOCK, BlockPool, PoolExhausted
from engine.cache.hashing import PrefixIndex, chain_hashes, root_hash


def make_pool(n: int = 5) -> tuple[BlockPool, PrefixIndex]:
    index = PrefixIndex()
    return BlockPool("full_kv", n, index.add, index.remove), index


def test_allocation_order_and_sentinel() -> None:
    pool, _ = make_pool(5)
    assert [pool.allocate() for _ in range(4)] == [1, 2, 3, 4]
    with pytest.raises(PoolExhausted):
        pool.allocate()
    assert SENTINEL_BLOCK == 0 and pool.ref_count[0] == 0
    pool.check_invariants()


def test_cached_blocks_evicted_lru_and_unhashed_first() -> None:
    pool, index = make_pool(5)
    a, b, c, d = (pool.allocate() for _ in range(4))
    pool.publish(a, b"A")
    pool.publish(b, b"B")
    pool.publish(c, b"C")
    for blk in (b, a, c):  # release order: b is least recently used
        pool.release(blk)
    pool.release(d)  # d caches nothing: it is reused first
    assert pool.allocate() == d
    assert pool.lookup(b"B") == b
    assert pool.allocate() == b  # evicts B
    assert pool.lookup(b"B") is None and index.holders(b"B") == 0
    assert index.holders(b"A") == 1 and index.holders(b"C") == 1
    assert pool.evictions == 1
    pool.check_invariants()


def test_lease_protects_from_eviction() -> None:
    pool, _ = make_pool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.publish(a, b"A")
    pool.release(a)
    pool.release(b)
    pool.lease(a)  # a lookup hit: pinned before any allocation
    assert pool.allocate() == b
    with pytest.raises(PoolExhausted):
        pool.allocate()
    assert pool.lookup(b"A") == a
    pool.check_invariants()


def test_double_free_and_bad_ids_raise() -> None:
    pool, _ = make_pool(3)
    a = pool.allocate()
    pool.release(a)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(a)
    with pytest.raises(RuntimeError, match="sentinel"):
        pool.release(SENTINEL_BLOCK)
    with pytest.raises(RuntimeError, match="holds nothing"):
        pool.lease(a)


def test_duplicate_publish_keeps_the_existing_block() -> None:
    pool, index = make_pool(4)
    a, b = pool.allocate(), pool.allocate()
    assert pool.publish(a, b"X") is True
    assert pool.publish(b, b"X") is False
    assert pool.lookup(b"X") == a and pool.block_hash[b] is None
    assert index.holders(b"X") == 1
    pool.check_invariants()


def test_hash_chain_names_whole_prefixes() -> None:
    root = root_hash("m", "r", 4)
    h1 = chain_hashes(root, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    h2 = chain_hashes(root, [9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(h1) == 2 and len(h2) == 2  # a trailing partial block has no hash
    assert h1[1] != h2[1]  # same block tokens, different parent
    assert chain_hashes(h1[0], [5, 6, 7, 8], 4) == [h1[1]]
    assert root_hash("m", "r", 4) != root_hash("m", "r2", 4)
