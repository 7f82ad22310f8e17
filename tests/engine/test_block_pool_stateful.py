"""The block lifecycle table, its generated doc, and a Hypothesis state machine that drives a
BlockPool against a reference model, checking every invariant after every step."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.cache.block_pool import BlockPool, PoolExhausted
from engine.cache.hashing import BlockHash, PrefixIndex
from engine.cache.lifecycle import (
    TRANSITIONS,
    BlockState,
    Event,
    IllegalTransition,
    render_markdown,
    transition,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "cache-lifecycle.md"
BUMPING = {Event.ALLOCATE, Event.EVICT, Event.INVALIDATE, Event.SWAP_OUT_BEGIN, Event.SWAP_FAIL}


# -- the transition table ------------------------------------------------------------------------
def test_doc_is_generated_from_the_table() -> None:
    assert DOC.read_text(encoding="utf-8") == render_markdown(), (
        "docs/cache-lifecycle.md is stale; regenerate it with "
        "`python -m engine.cache.lifecycle > docs/cache-lifecycle.md`"
    )


@pytest.mark.parametrize("state", list(BlockState))
@pytest.mark.parametrize("event", list(Event))
def test_each_pair_is_applied_or_refused_by_the_table(state: BlockState, event: Event) -> None:
    states, epochs = [BlockState.FREE, state], [0, 5]
    row = TRANSITIONS.get((state, event))
    if row is None:
        with pytest.raises(IllegalTransition, match=f"pool: block 1 is {state}; event {event} is not allowed") as err:
            transition(states, epochs, 1, event, owner="pool")
        assert (err.value.block, err.value.state, err.value.event) == (1, state, event)
        assert states == [BlockState.FREE, state] and epochs == [0, 5]  # nothing changed
    else:
        assert transition(states, epochs, 1, event, owner="pool") is row.target
        assert states == [BlockState.FREE, row.target]
        assert epochs == [0, 6 if event in BUMPING else 5]
        assert row.bumps_epoch == (event in BUMPING) and row.precondition and row.rollback


def test_tier_entry_round_trip_and_failures() -> None:
    """A tier entry: created by a copy down, read back (inclusive: it stays OFFLOADED), a
    cancelled swap-in leaves it intact, a failed one drops it with a new epoch."""
    states, epochs = [BlockState.FREE], [3]
    for event, expected in (
        (Event.SWAP_OUT_BEGIN, BlockState.SWAPPING_OUT),
        (Event.SWAP_OUT_DONE, BlockState.OFFLOADED),
        (Event.SWAP_IN_BEGIN, BlockState.SWAPPING_IN),
        (Event.SWAP_CANCEL, BlockState.OFFLOADED),
        (Event.SWAP_IN_BEGIN, BlockState.SWAPPING_IN),
        (Event.SWAP_IN_DONE, BlockState.OFFLOADED),
    ):
        assert transition(states, epochs, 0, event) is expected
    assert epochs == [4]  # only the copy down made a new object
    transition(states, epochs, 0, Event.SWAP_IN_BEGIN)
    assert transition(states, epochs, 0, Event.SWAP_FAIL) is BlockState.FREE and epochs == [5]
    with pytest.raises(IllegalTransition, match="allowed from FREE: allocate, swap_out_begin"):
        transition(states, epochs, 0, Event.SWAP_IN_DONE)


def test_every_state_is_reachable_and_returns_to_free() -> None:
    succ: dict[BlockState, set[BlockState]] = {s: set() for s in BlockState}
    for (source, _), row in TRANSITIONS.items():
        succ[source].add(row.target)

    def reach(start: BlockState) -> set[BlockState]:
        seen, todo = {start}, [start]
        while todo:
            for nxt in succ[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    assert reach(BlockState.FREE) == set(BlockState)
    assert all(BlockState.FREE in reach(s) for s in BlockState)


# -- the pool against a reference model --------------------------------------------------------
HASHES: list[BlockHash] = [bytes([i]) * 16 for i in range(5)]  # few hashes: publishes collide


@dataclass
class Model:
    """What the pool should hold: per-block state, ref count, hash, epoch, and the free queues
    (empty blocks front first; evictable blocks keyed by (priority, release sequence))."""

    n: int
    state: list[BlockState] = field(init=False)
    ref: list[int] = field(init=False)
    hash: list[BlockHash | None] = field(init=False)
    epoch: list[int] = field(init=False)
    empty: list[int] = field(init=False)
    evictable: dict[int, tuple[int, int]] = field(default_factory=dict)
    held_priority: dict[int, int] = field(default_factory=dict)
    evicted: set[BlockHash] = field(default_factory=set)
    evictions: int = 0
    clock: int = 0

    def __post_init__(self) -> None:
        self.state = [BlockState.INVALID] + [BlockState.FREE] * (self.n - 1)
        self.ref = [0] * self.n
        self.hash = [None] * self.n
        self.epoch = [0] * self.n
        self.empty = list(range(1, self.n))

    def cached(self) -> dict[BlockHash, int]:
        return {h: b for b, h in enumerate(self.hash) if h is not None}

    def next_block(self) -> int | None:
        """The block the next allocation must hand out: empty first, then the lowest priority,
        least recently released evictable block."""
        if self.empty:
            return self.empty[0]
        if self.evictable:
            return min(self.evictable, key=self.evictable.__getitem__)
        return None


class BlockPoolMachine(RuleBasedStateMachine):
    """Random interleavings of allocate (with eviction and exhaustion), publish with colliding
    hashes, lookup and lease of cached blocks, release with random priority, invalidate and
    double free; the pool must agree with the model after every step."""

    pool: BlockPool
    index: PrefixIndex
    model: Model

    def __init__(self) -> None:
        super().__init__()
        self.leases: list[int] = []  # one entry per lease this test holds

    @initialize(n=st.integers(min_value=2, max_value=6))
    def make_pool(self, n: int) -> None:
        self.index = PrefixIndex()
        self.pool = BlockPool("full_kv", n, self.index.add, self.index.remove)
        self.model = Model(n)

    def snapshot(self) -> tuple[object, ...]:
        p = self.pool
        return (
            list(p.state), list(p.ref_count), list(p.epoch), list(p.block_hash),
            p.num_free, p.evictions, self.index.snapshot(),
        )

    # -- rules ---------------------------------------------------------------------------------
    @rule()
    def allocate(self) -> None:
        m = self.model
        expected = m.next_block()
        if expected is None:
            before = self.snapshot()
            with pytest.raises(PoolExhausted):
                self.pool.allocate()
            assert self.snapshot() == before
            return
        victim = m.hash[expected]
        assert self.pool.allocate() == expected
        if expected in m.evictable:  # evicted: the lowest priority, then least recently released
            del m.evictable[expected]
            assert victim is not None
            m.hash[expected] = None
            m.evicted.add(victim)
            m.evictions += 1
            m.epoch[expected] += 1
            assert self.pool.lookup(victim) is None and self.pool.was_evicted(victim)
        else:
            m.empty.remove(expected)
        m.state[expected] = BlockState.WRITING
        m.ref[expected] = 1
        m.epoch[expected] += 1
        self.leases.append(expected)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(min_value=0), h=st.sampled_from(HASHES))
    def publish(self, i: int, h: BlockHash) -> None:
        m, block = self.model, self.leases[i % len(self.leases)]
        if m.state[block] is not BlockState.WRITING:  # already published, or invalidated
            before = self.snapshot()
            with pytest.raises(IllegalTransition):
                self.pool.publish(block, h)
            assert self.snapshot() == before
            return
        stored = h not in m.cached()
        assert self.pool.publish(block, h) is stored
        if stored:
            m.state[block] = BlockState.RESIDENT
            m.hash[block] = h
            m.evicted.discard(h)

    @rule(h=st.sampled_from(HASHES))
    def lookup_and_lease(self, h: BlockHash) -> None:
        block = self.pool.lookup(h)
        assert block == self.model.cached().get(h)
        if block is None:
            return
        self.pool.lease(block)
        m = self.model
        m.evictable.pop(block, None)
        m.state[block] = BlockState.RESIDENT
        m.ref[block] += 1
        self.leases.append(block)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(min_value=0), priority=st.integers(min_value=0, max_value=2))
    def release(self, i: int, priority: int) -> None:
        m, block = self.model, self.leases.pop(i % len(self.leases))
        self.pool.release(block, priority=priority)
        m.ref[block] -= 1
        if m.ref[block]:
            m.held_priority[block] = max(m.held_priority.get(block, priority), priority)
            return
        priority = max(m.held_priority.pop(block, priority), priority)
        if m.state[block] is BlockState.RESIDENT:
            m.state[block] = BlockState.CACHED
            m.evictable[block] = (priority, m.clock)
            m.clock += 1
        else:  # WRITING (never published) or INVALID: reused first
            m.state[block] = BlockState.FREE
            m.empty.insert(0, block)

    @rule(b=st.integers(min_value=1, max_value=5))
    def invalidate(self, b: int) -> None:
        m = self.model
        block = 1 + (b - 1) % (m.n - 1)
        state = m.state[block]
        if state not in (BlockState.RESIDENT, BlockState.CACHED):
            before = self.snapshot()
            with pytest.raises(IllegalTransition, match=f"block {block} is {state}; event invalidate"):
                self.pool.invalidate(block)
            assert self.snapshot() == before
            return
        self.pool.invalidate(block)
        m.hash[block] = None
        m.epoch[block] += 1
        if state is BlockState.CACHED:
            del m.evictable[block]
            m.state[block] = BlockState.FREE
            m.empty.insert(0, block)
        else:
            m.state[block] = BlockState.INVALID

    @rule(b=st.integers(min_value=1, max_value=5), priority=st.integers(min_value=0, max_value=2))
    def double_free_or_bad_lease(self, b: int, priority: int) -> None:
        m = self.model
        block = 1 + (b - 1) % (m.n - 1)
        if m.ref[block]:
            return
        before = self.snapshot()
        with pytest.raises(RuntimeError, match="double free"):
            self.pool.release(block, priority=priority)
        if m.state[block] is BlockState.FREE:
            with pytest.raises(RuntimeError, match="holds nothing"):
                self.pool.lease(block)
        assert self.snapshot() == before

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def pool_is_consistent(self) -> None:
        self.pool.check_invariants()

    @invariant()
    def pool_agrees_with_model(self) -> None:
        p, m = self.pool, self.model
        assert p.state == m.state
        assert p.ref_count == m.ref
        assert p.block_hash == m.hash
        assert p.epoch == m.epoch
        assert sorted(self.leases) == sorted(b for b in range(m.n) for _ in range(m.ref[b]))
        assert all(p.lookup(h) == m.cached().get(h) for h in HASHES)
        assert all(p.was_evicted(h) == (h in m.evicted) for h in HASHES)
        assert p.num_free == len(m.empty) + len(m.evictable)
        assert p.num_cached == len(m.cached()) and p.evictions == m.evictions
        assert self.index.snapshot() == dict(Counter(h for h in m.hash if h is not None))

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        while self.leases:  # every lease given back: nothing leaks
            self.pool.release(self.leases.pop())
        self.pool.check_invariants()
        assert self.pool.num_leased == 0
        assert BlockState.INVALID not in self.pool.state[1:]


BlockPoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_block_pool_state_machine = BlockPoolMachine.TestCase
