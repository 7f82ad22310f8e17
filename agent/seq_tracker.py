"""Which batch seqs each engine's batches were received and stored under: the idempotency and
gap bookkeeping of :mod:`agent.ingest`, kept as intervals (seqs mostly arrive in order)."""

from __future__ import annotations

import bisect
import threading

from agent.store import Store

LEGACY_SEQ_FLOOR = 2**40
"""Seqs at or above this as an engine's first come from the old wall-clock numbering (µs)."""


class SeqRanges:
    """A set of non-negative ints kept as sorted, disjoint, closed intervals (seqs mostly arrive
    in order, so an engine's set is one interval plus its holes)."""

    __slots__ = ("_count", "_ends", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._count = 0

    @property
    def max(self) -> int:
        """The largest member, -1 when empty."""
        return self._ends[-1] if self._ends else -1

    @property
    def count(self) -> int:
        return self._count

    @property
    def min(self) -> int:
        """The smallest member, -1 when empty."""
        return self._starts[0] if self._starts else -1

    @property
    def missing(self) -> int:
        """How many seqs are not members: in ``[0, highest below LEGACY_SEQ_FLOOR]`` (seqs start
        at 0) plus, for the old wall-clock numbering (seqs at or above :data:`LEGACY_SEQ_FLOOR`,
        clients before seqs started at 0), in ``[lowest, highest]`` of those. An engine id that
        used both numberings (upgraded in place) is counted in each separately."""
        low_top, low_count = -1, 0
        high_bottom, high_top, high_count = -1, -1, 0
        for start, end in zip(self._starts, self._ends, strict=True):
            if start < LEGACY_SEQ_FLOOR:
                low_end = min(end, LEGACY_SEQ_FLOOR - 1)
                low_top, low_count = low_end, low_count + low_end - start + 1
            if end >= LEGACY_SEQ_FLOOR:
                high_start = max(start, LEGACY_SEQ_FLOOR)
                if high_bottom < 0:
                    high_bottom = high_start
                high_top, high_count = end, high_count + end - high_start + 1
        low = low_top + 1 - low_count
        high = high_top - high_bottom + 1 - high_count if high_count else 0
        return low + high

    def top_in_numbering(self, seq: int) -> int | None:
        """The highest member in ``seq``'s numbering (below :data:`LEGACY_SEQ_FLOOR`, or at or
        above it): -1 when the engine has none below the floor, None when none at or above it
        (the first seq of the old numbering is not a gap)."""
        legacy = seq >= LEGACY_SEQ_FLOOR
        i = bisect.bisect_left(self._starts, LEGACY_SEQ_FLOOR)  # intervals starting at/above
        if legacy:
            if i < len(self._starts):
                return self._ends[-1]
            if i > 0 and self._ends[i - 1] >= LEGACY_SEQ_FLOOR:
                return self._ends[i - 1]
            return None
        if i == 0:
            return -1
        return min(self._ends[i - 1], LEGACY_SEQ_FLOOR - 1)

    def __contains__(self, seq: object) -> bool:
        if not isinstance(seq, int):
            return False
        i = bisect.bisect_right(self._starts, seq) - 1
        return i >= 0 and self._ends[i] >= seq

    def add_range(self, lo: int, hi: int) -> None:
        """Append ``lo..hi`` (inclusive) above every member and not adjacent to the last
        interval (how :meth:`SeqTracker.load` reads islands).

        Raises:
            ValueError: the range is empty, overlaps or touches the current members.
        """
        if hi < lo or (self._ends and lo <= self._ends[-1] + 1):
            raise ValueError(f"range {lo}..{hi} is not above the current intervals")
        self._starts.append(lo)
        self._ends.append(hi)
        self._count += hi - lo + 1

    def add(self, seq: int) -> None:
        i = bisect.bisect_right(self._starts, seq) - 1
        if i >= 0 and self._ends[i] >= seq:
            return
        joins_left = i >= 0 and self._ends[i] == seq - 1
        joins_right = i + 1 < len(self._starts) and self._starts[i + 1] == seq + 1
        if joins_left and joins_right:
            self._ends[i] = self._ends[i + 1]
            del self._starts[i + 1], self._ends[i + 1]
        elif joins_left:
            self._ends[i] = seq
        elif joins_right:
            self._starts[i + 1] = seq
        else:
            self._starts.insert(i + 1, seq)
            self._ends.insert(i + 1, seq)
        self._count += 1


class SeqTracker:
    """Per engine: the seqs stored (for idempotency) and the seqs received at all — stored or
    filed as rejected — (for gaps). Loaded from ``ingest_batches``; updated after each commit.

    A gap is a seq in ``[0, max received]`` never received: the engine's client dropped that
    batch (its spool was full) or it is still in flight. Seqs start at 0 per engine id and
    continue across the engine's restarts (:meth:`next_seq`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stored: dict[str, SeqRanges] = {}
        self._seen: dict[str, SeqRanges] = {}

    @classmethod
    def load(cls, store: Store) -> SeqTracker:
        """Read every engine's stored and received seqs (as intervals) from ``ingest_batches``."""
        tracker = cls()
        islands = """
            SELECT engine_id, min(seq), max(seq) FROM (
                SELECT engine_id, seq,
                       seq - row_number() OVER (PARTITION BY engine_id ORDER BY seq) AS island
                FROM (SELECT DISTINCT engine_id, seq FROM ingest_batches WHERE {where})
            ) GROUP BY engine_id, island ORDER BY engine_id, 2
        """
        with store.cursor() as cur:
            for target, where in (
                (tracker._stored, "status = 'stored'"),
                (tracker._seen, "status IN ('stored', 'rejected')"),
            ):
                for engine_id, lo, hi in cur.execute(islands.format(where=where)).fetchall():
                    target.setdefault(engine_id, SeqRanges()).add_range(lo, hi)
        return tracker

    def is_stored(self, engine_id: str, seq: int) -> bool:
        with self._lock:
            ranges = self._stored.get(engine_id)
            return ranges is not None and seq in ranges

    def top(self, engine_id: str, seq: int) -> int | None:
        """The highest seq received from ``engine_id`` in ``seq``'s numbering (see
        :meth:`SeqRanges.top_in_numbering`)."""
        with self._lock:
            ranges = self._seen.get(engine_id)
            if ranges is None:
                return None if seq >= LEGACY_SEQ_FLOOR else -1
            return ranges.top_in_numbering(seq)

    def next_seq(self, engine_id: str) -> int:
        """One above the highest seq received from ``engine_id`` (stored or filed rejected) in
        the 0-based numbering, 0 for an engine never heard of: where a restarted engine keeping
        its id continues (``GET /v1/ingest/next-seq``, :mod:`engine.run_seq`)."""
        top = self.top(engine_id, 0)
        return 0 if top is None else top + 1

    def mark(self, engine_id: str, seq: int, *, stored: bool) -> None:
        """Record a committed batch: ``stored`` or filed as rejected."""
        with self._lock:
            self._seen.setdefault(engine_id, SeqRanges()).add(seq)
            if stored:
                self._stored.setdefault(engine_id, SeqRanges()).add(seq)

    def stored_tops(self) -> dict[str, int]:
        """Engine id → the highest seq stored in the 0-based numbering (below
        :data:`LEGACY_SEQ_FLOOR`), for engines with one."""
        with self._lock:
            tops = {e: r.top_in_numbering(0) for e, r in self._stored.items()}
        return {e: t for e, t in tops.items() if t is not None and t >= 0}

    def missing(self) -> dict[str, int]:
        """Engine id → seqs never received below its highest, for engines with any."""
        with self._lock:
            return {e: r.missing for e, r in self._seen.items() if r.missing}


def _gap(top: int | None, seq: int) -> tuple[int, int] | None:
    """The seqs ``seq`` jumps over past ``top`` (the highest received in its numbering), if any."""
    if top is None or seq <= top + 1:
        return None
    return (top + 1, seq - 1)
