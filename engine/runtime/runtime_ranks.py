"""The runtime on every tensor-parallel rank: rank 0's runtime and its mirrors on the workers
(the lockstep step of :mod:`engine.runtime.runtime`, module docstring).

Rank 0 registers its runtime and asks each worker to build a mirror (:func:`build_mirror`).
Every :meth:`Runtime.step` of rank 0 runs :func:`step_on_rank` on every rank through
``LLM.on_every_rank``: a worker first applies the adds and aborts rank 0 saw since the last
step, then every rank steps. :func:`agree_on_schedule` checks, once per step, that the ranks are
about to run the same chunks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Protocol

from engine.llm import LLM
from engine.parallel.group import TensorParallelGroup


class RankRuntime(Protocol):
    """What a rank's runtime offers this module (:class:`~engine.runtime.runtime.Runtime`)."""

    def add_request(self, prompt: list[int], params: Any, *, request_id: str, session: str) -> Any: ...
    def abort(self, request_id: str) -> bool: ...
    def step_here(self) -> list[Any]: ...
    def build_decode_runner(self) -> None: ...
    def pop_finished(self, request_id: str) -> Any: ...

    @property
    def requests(self) -> dict[str, Any]: ...


_RUNTIMES: dict[str, RankRuntime] = {}
"""This process's runtime of each tensor-parallel engine, by engine id (rank 0's own, or a
worker's mirror of it): one per engine, the latest built (rank 0 steps only that one)."""


def register(llm: LLM, runtime: RankRuntime) -> None:
    """``runtime`` is this rank's runtime of ``llm`` (the latest one built wins)."""
    _RUNTIMES[llm.engine_id] = runtime


def build_mirror(llm: LLM, factory: Callable[..., RankRuntime], options: dict[str, Any]) -> None:
    """On a worker rank: the mirror of rank 0's runtime (``factory``: the runtime class;
    ``options``: its config, static decode, decode batch sizes and CUDA graphs, as rank 0's:
    each rank captures its own graphs over its own static slots). On rank 0, whose runtime
    registered itself: its decode runner, built while the workers build theirs."""
    if not llm.tp_rank:
        _RUNTIMES[llm.engine_id].build_decode_runner()
    else:
        factory(
            llm, options["config"], static_decode=options["static_decode"], decode_batch_sizes=options["decode_batch_sizes"],
            cuda_graphs=options["cuda_graphs"],
        )  # fmt: skip


def step_on_rank(llm: LLM, inputs: list[tuple[str, Any]]) -> list[Any] | None:
    """One step of this rank's runtime of ``llm``: a worker first applies rank 0's adds and
    aborts (``inputs``, in order). Rank 0 returns the step's requests, a worker None."""
    runtime = _RUNTIMES[llm.engine_id]
    if not llm.tp_rank:
        return runtime.step_here()
    for kind, value in inputs:
        if kind == "add":
            runtime.add_request(value["prompt"], value["params"], request_id=value["request_id"], session=value["session"])
        else:
            runtime.abort(value)
    runtime.step_here()
    for rid in [rid for rid, r in runtime.requests.items() if r.finished]:  # rank 0's caller collects its own
        runtime.pop_finished(rid)
    return None


def rank0_says(llm: LLM, decision: bool) -> bool:
    """Rank 0's ``decision`` on every rank (one broadcast; ``decision`` itself in a single
    process): what reads rank-local state (pool occupancy differs after a lost shard) must not
    send the ranks different ways."""
    if llm.ranks is None:
        return decision
    return bool(llm.ranks.group.broadcast_ints([int(decision)])[0])


def agree_on_schedule(group: TensorParallelGroup, chunks: list[tuple[int, int, int]], preemptions: int) -> None:
    """Check that every rank is about to run the same chunks (request serial, start, end) after
    the same number of preemptions: one all-gather of a digest.

    Raises:
        RuntimeError: the ranks' schedules differ (an internal invariant: their pools would
            diverge).
    """
    digest = int.from_bytes(hashlib.sha256(repr((chunks, preemptions)).encode()).digest()[:8], "big") >> 1
    digests = [row[0] for row in group.all_gather_ints([digest])]
    if len(set(digests)) > 1:
        raise RuntimeError(f"tensor-parallel ranks scheduled different steps (digests {[hex(d) for d in digests]}); rank {group.rank} had {chunks}")
