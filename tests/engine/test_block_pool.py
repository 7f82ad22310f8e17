"""BlockPool: exact block ids, LRU and priority eviction order, sentinel, double free, duplicate
publish, lifecycle states, invalidation, epochs, and what check_invariants catches."""

from __future__ import annotations

import pytest

from engine.cache.block_pool import SENTINEL_BLOCK, BlockPool, PoolExhausted
from engine.cache.hashing import PrefixIndex, chain_hashes, root_hash
from engine.cache.lifecycle import BlockState, IllegalTransition


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


# -- lifecycle states, priorities, invalidation, epochs -----------------------------------------
def test_states_follow_the_lifecycle() -> None:
    pool, _ = make_pool(4)
    assert pool.state == [BlockState.INVALID, BlockState.FREE, BlockState.FREE, BlockState.FREE]
    a, b = pool.allocate(), pool.allocate()
    assert pool.state[a] is BlockState.WRITING
    pool.publish(a, b"A")
    assert pool.state[a] is BlockState.RESIDENT
    pool.lease(a)
    pool.release(a)
    assert pool.state[a] is BlockState.RESIDENT and pool.ref_count[a] == 1
    pool.release(a)
    pool.release(b)
    assert (pool.state[a], pool.state[b]) == (BlockState.CACHED, BlockState.FREE)
    pool.lease(a)
    assert pool.state[a] is BlockState.RESIDENT
    pool.check_invariants()


def test_higher_priority_is_evicted_after_every_lower_one() -> None:
    pool, _ = make_pool(6)
    a, b, c, d, e = (pool.allocate() for _ in range(5))
    for blk, h in ((a, b"A"), (b, b"B"), (c, b"C"), (d, b"D")):
        pool.publish(blk, h)
    pool.release(a, priority=2)  # e.g. a window tail at a cached boundary
    pool.release(b)
    pool.release(c, priority=1)
    pool.release(d)
    pool.release(e, priority=5)  # unpublished: handed out first whatever its priority
    assert [pool.allocate() for _ in range(5)] == [e, b, d, c, a]
    assert pool.evictions == 4
    pool.check_invariants()


def test_shared_block_keeps_the_highest_release_priority() -> None:
    pool, _ = make_pool(4)
    a, b = pool.allocate(), pool.allocate()
    pool.publish(a, b"A")
    pool.publish(b, b"B")
    pool.lease(a)
    pool.release(a, priority=3)  # one holder values it
    pool.release(a)  # the last holder does not: the higher value stands
    pool.release(b, priority=1)
    pool.allocate()  # the empty block
    assert pool.allocate() == b and pool.allocate() == a


def test_invalidate_cached_block_frees_it_first() -> None:
    pool, index = make_pool(4)
    a, b = pool.allocate(), pool.allocate()
    pool.publish(a, b"A")
    pool.publish(b, b"B")
    pool.release(a)
    pool.release(b)
    epoch = pool.epoch[b]
    pool.invalidate(b)
    assert pool.state[b] is BlockState.FREE and pool.epoch[b] == epoch + 1
    assert pool.lookup(b"B") is None and index.holders(b"B") == 0 and not pool.was_evicted(b"B")
    assert pool.num_cached == 1 and pool.num_free == 3
    pool.check_invariants()
    assert pool.allocate() == b  # front of the empty queue
    assert pool.evictions == 0


def test_invalidate_resident_block_drains_its_leases() -> None:
    pool, index = make_pool(3)
    a = pool.allocate()
    pool.publish(a, b"A")
    pool.lease(a)  # a second request reads it
    epoch = pool.epoch[a]
    pool.invalidate(a)
    assert pool.state[a] is BlockState.INVALID and pool.epoch[a] == epoch + 1  # holders see it
    assert pool.lookup(b"A") is None and index.holders(b"A") == 0
    assert pool.num_leased == 1 and pool.num_holding == 1
    pool.check_invariants()
    with pytest.raises(IllegalTransition, match="invalidated"):
        pool.lease(a)
    with pytest.raises(IllegalTransition, match="INVALID; event invalidate"):
        pool.invalidate(a)
    with pytest.raises(IllegalTransition, match="INVALID; event publish"):
        pool.publish(a, b"A")
    pool.release(a)
    assert pool.state[a] is BlockState.INVALID
    pool.release(a)  # the last lease: reclaimed
    assert pool.state[a] is BlockState.FREE and pool.epoch[a] == epoch + 1
    pool.check_invariants()
    assert pool.publish(pool.allocate(), b"A") is True  # the hash can be stored again


def test_invalidate_needs_a_published_block() -> None:
    pool, _ = make_pool(3)
    a = pool.allocate()
    with pytest.raises(IllegalTransition, match="WRITING; event invalidate"):
        pool.invalidate(a)
    pool.release(a)
    with pytest.raises(IllegalTransition, match="FREE; event invalidate"):
        pool.invalidate(a)
    with pytest.raises(RuntimeError, match="sentinel"):
        pool.invalidate(SENTINEL_BLOCK)
    pool.check_invariants()


def test_epoch_bumps_on_allocate_evict_and_invalidate_only() -> None:
    pool, _ = make_pool(2)
    a = pool.allocate()
    assert pool.epoch[a] == 1
    pool.publish(a, b"A")
    pool.lease(a)
    pool.release(a)
    pool.release(a)
    pool.lease(a)
    pool.release(a)
    assert pool.epoch[a] == 1  # publish, lease and release keep the bytes
    assert pool.allocate() == a  # evict (+1), then allocate (+1)
    assert pool.epoch[a] == 3
    pool.publish(a, b"A2")
    pool.invalidate(a)
    assert pool.epoch[a] == 4
    pool.release(a)  # reclaim keeps it; the next allocate bumps
    assert pool.epoch[a] == 4 and pool.epoch[SENTINEL_BLOCK] == 0


def test_illegal_calls_change_nothing() -> None:
    pool, index = make_pool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.publish(a, b"A")
    pool.release(b)
    before = (list(pool.state), list(pool.ref_count), list(pool.epoch), list(pool.block_hash), pool.num_free)
    with pytest.raises(IllegalTransition, match="already published"):
        pool.publish(a, b"A2")
    with pytest.raises(IllegalTransition, match="not leased"):
        pool.publish(b, b"B")
    with pytest.raises(IllegalTransition, match="double free"):
        pool.release(b, priority=3)
    assert (list(pool.state), list(pool.ref_count), list(pool.epoch), list(pool.block_hash), pool.num_free) == before
    assert index.snapshot() == {b"A": 1}
    pool.check_invariants()


def test_check_invariants_names_pool_block_and_state() -> None:
    pool, _ = make_pool(4)
    a, b = pool.allocate(), pool.allocate()
    pool.publish(a, b"A")
    pool.release(a)
    pool.check_invariants()
    pool.ref_count[a] = 1  # a CACHED block that claims a lease
    with pytest.raises(AssertionError, match=r"full_kv: block 1 CACHED disagrees: ref 1"):
        pool.check_invariants()
    pool.ref_count[a] = 0
    pool.state[b] = BlockState.RESIDENT  # in use but never published
    with pytest.raises(AssertionError, match=r"full_kv: block 2 RESIDENT disagrees: ref 1, unpublished"):
        pool.check_invariants()
    pool.state[b] = BlockState.WRITING
    pool.ref_count[SENTINEL_BLOCK] = 1
    with pytest.raises(AssertionError, match="sentinel block 0"):
        pool.check_invariants()
    pool.ref_count[SENTINEL_BLOCK] = 0
    pool.block_hash[b] = b"A"  # two blocks under one hash
    with pytest.raises(AssertionError, match="block 2 WRITING disagrees"):
        pool.check_invariants()
    pool.block_hash[b] = None
    pool.check_invariants()


def test_limit_cached_evicts_the_excess_in_victim_order_and_lifts() -> None:
    pool, index = make_pool(6)
    a, b, c, d = (pool.allocate() for _ in range(4))
    for blk, h in ((a, b"A"), (b, b"B"), (c, b"C")):
        pool.publish(blk, h)
    pool.release(b)
    pool.release(a, priority=1)  # worth more: evicted last
    pool.release(c)
    assert pool.limit_cached(1) == 2  # B (least recent at priority 0), then C
    assert (pool.lookup(b"B"), pool.lookup(b"C"), pool.lookup(b"A")) == (None, None, a)
    assert index.holders(b"B") == 0 and pool.evictions == 2
    pool.publish(d, b"D")
    pool.release(d)  # over the cap again: the lowest-priority victim (D itself) goes at once
    assert pool.lookup(b"D") is None and pool.lookup(b"A") == a
    pool.lease(a)  # leased blocks are never evicted by the cap
    assert pool.limit_cached(0) == 0 and pool.lookup(b"A") == a
    pool.release(a)
    assert pool.lookup(b"A") is None
    assert pool.limit_cached(None) == 0
    e = pool.allocate()
    pool.publish(e, b"E")
    pool.release(e)
    assert pool.lookup(b"E") == e
    with pytest.raises(ValueError):
        pool.limit_cached(-1)
    pool.check_invariants()


def _store(pool: BlockPool, h: bytes, priority: int = 0) -> int:
    """Allocate a block (evicting if needed), publish it under ``h`` and release it."""
    block = pool.allocate()
    pool.publish(block, h)
    pool.release(block, priority=priority)
    return block


def depths(pool: BlockPool, names: bytes) -> dict[bytes, int]:
    """The ghost depth of every one-letter hash in ``names`` that has one."""
    found = {bytes([n]): pool.ghost_depth(bytes([n])) for n in names}
    return {h: d for h, d in found.items() if d is not None}


def test_ghost_depths_are_lru_stack_distances_beyond_the_pool() -> None:
    """Pool of 3 usable blocks. Stored A..F in order: A, B, C are evicted (oldest first). A pool
    one block larger would have kept C, two larger B, three larger A: the depths 1, 2, 3."""
    pool, _ = make_pool(4)
    for h in (b"A", b"B", b"C", b"D", b"E", b"F"):
        _store(pool, h)
    assert depths(pool, b"ABCDEF") == {b"C": 1, b"B": 2, b"A": 3}
    # B stored again (it evicts D): a larger pool would have kept B above A instead of evicting
    # it, so A's depth counts only what is still gone: D (newest), C, A
    _store(pool, b"B")
    assert depths(pool, b"ABCDEF") == {b"D": 1, b"C": 2, b"A": 3}
    assert pool.was_evicted(b"A") and not pool.was_evicted(b"B")
    pool.check_invariants()


def test_ghost_depths_skip_lower_priority_evictions() -> None:
    """A high-priority block (say a checkpoint's window tail) evicted before a run of low-priority
    ones: a pool one block larger keeps it, since it would still evict the low-priority blocks
    first. Pool of 2 usable blocks: H and K (priority 1), then a, b, c (priority 0)."""
    pool, _ = make_pool(3)
    _store(pool, b"H", priority=1)
    _store(pool, b"K", priority=1)
    _store(pool, b"a")  # no priority-0 block cached yet: H, the older priority-1 block, goes
    _store(pool, b"b")  # a goes
    _store(pool, b"c")  # b goes
    assert depths(pool, b"HKabc") == {b"b": 1, b"a": 2, b"H": 1}
    # the check: a pool of 3 usable blocks under the same stores keeps H
    larger, _ = make_pool(4)
    for h, priority in ((b"H", 1), (b"K", 1), (b"a", 0), (b"b", 0), (b"c", 0)):
        _store(larger, h, priority)
    assert larger.present(b"H") and not larger.present(b"b")


def test_ghost_depths_and_spares_match_simulated_lru_pools() -> None:
    """Random stores and re-stores into a single-priority pool: a block's ghost depth d means a
    pool d blocks larger (same stores) still holds it, and one d - 1 larger does not; a cached
    block's spare s, that a pool s blocks smaller still holds it and one s + 1 smaller does not."""
    import random

    rng = random.Random(7)
    names = [bytes([65 + i]) for i in range(12)]
    stores = [rng.choice(names) for _ in range(80)]

    def run(usable: int) -> BlockPool:
        pool, _ = make_pool(usable + 1)
        for h in stores:
            block = pool.lookup(h)
            if block is not None:  # a hit: used again, so most recently released
                pool.lease(block)
                pool.release(block)
            else:
                _store(pool, h)
        return pool

    small = run(3)
    small.check_invariants()
    checked = 0
    for h in names:
        d = small.ghost_depth(h)
        if d is None:
            continue
        assert run(3 + d).present(h), (h, d)
        assert not run(3 + d - 1).present(h), (h, d)
        checked += 1
    assert checked >= 3
    # the mirror: a cached block's spare s means a pool s smaller still holds it, s + 1 smaller not
    large = run(8)
    large.check_invariants()
    checked = 0
    for h in names:
        spare = large.spare_blocks([h])
        if spare is None:
            continue
        assert run(8 - spare).present(h), (h, spare)
        if spare < 7:
            assert not run(8 - spare - 1).present(h), (h, spare)
        checked += 1
    assert checked >= 5


def test_spare_blocks_count_empty_lower_priority_and_earlier_blocks() -> None:
    pool, _ = make_pool(6)  # 5 usable blocks
    _store(pool, b"H", priority=1)
    _store(pool, b"a")
    _store(pool, b"b")
    held = pool.allocate()
    pool.publish(held, b"L")  # leased: outlives every other block
    # one empty block; queue 0: a, b; queue 1: H
    assert [pool.spare_blocks([h]) for h in (b"a", b"b", b"H", b"L")] == [1, 2, 3, 4]
    assert pool.spare_blocks([b"H", b"b", b"L"]) == 2  # b goes first of the three
    assert pool.spare_blocks([b"nope"]) is None and pool.spare_blocks([b"nope", b"H"]) == 3
    # a cap leaves no room: the empty block cannot hold a cached one
    pool.limit_cached(3)
    assert [pool.spare_blocks([h]) for h in (b"a", b"b", b"H")] == [0, 1, 2]
    pool.check_invariants()
