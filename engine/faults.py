"""Fault injection for the prefix cache (DESIGN.md §4), off unless a config or a test enables it.

Each fault breaks one thing a real engine has been seen to get wrong; under every fault the
engine must still produce the output of a cold run (by lowering L* or recomputing) and report
the reason in its events:

* ``drop_tail`` — the compressors' uncompressed tail rows never reach their slot (as if lost on
  the way to the cache) → ``uncompressed_tail`` invalidated, ``tail_missing``;
* ``lag_index`` — the indexer's pending rows are stamped one boundary behind the compressed KV
  they go with → ``indexer_state`` invalidated, ``indexer_stale``, with a sync delay of U tokens
  (``engine/cache/indexer_sync.py``);
* ``evict_between_check_and_use`` — a page the lookup matched is invalidated after the lookup
  and before the request leases it → the form is vetoed, ``epoch_changed``, full recompute;
* ``groups_disagree`` — one compressor group (e.g. HCA next to CSA) fails to store its last entry
  page, so the groups of ``compressed_kv`` disagree on the resume point → ``group_disagree``.

* ``corrupt_offloaded_file`` — every file the disk tier writes has its last byte flipped → the
  swap-in's checksum fails, the entry is dropped, ``offload_corrupt`` and a lower L*;
* ``read_during_swap_in`` — swap-ins started by a prefetch are held in flight until a request
  waits for them, so a lookup arrives while they are ``SWAPPING_IN`` → it waits (when
  ``CacheConfig.swap_in_wait``) or resumes lower with ``in_flight_swap``.

With tensor parallelism, ``on_rank`` confines every fault to one rank (None: every rank), and:

* ``lose_shard`` — before each lookup, that rank's pools of the named form lose every object the
  prompt matches (its shard lost or found corrupt), while the other ranks keep theirs → the
  ranks agree on the lower point, every other rank reports ``tp_disagree`` naming that rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.events import Form


@dataclass(frozen=True, slots=True, kw_only=True)
class Faults:
    """Which faults to inject (all off by default); see the module docstring."""

    drop_tail: bool = False
    lag_index: bool = False
    evict_between_check_and_use: bool = False
    groups_disagree: bool = False
    corrupt_offloaded_file: bool = False
    read_during_swap_in: bool = False
    lose_shard: Form | None = None
    on_rank: int | None = None

    @property
    def any(self) -> bool:
        return any(getattr(self, name) for name in self.__dataclass_fields__ if name != "on_rank")


NO_FAULTS = Faults()
