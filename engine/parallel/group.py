"""The tensor-parallel process group of one engine: the collectives its ranks run, counted.

One :class:`TensorParallelGroup` per rank process. It is built on a ``TCPStore`` and a gloo
``ProcessGroupGloo`` of its own (not ``torch.distributed``'s default group), so several engines
can live in one process (tests) and nothing global is left behind when one closes. On the CPU
gloo runs every collective over loopback.

On CUDA the activations (all-reduces, the logits' all-gather) run on an NCCL group; the small
integer exchanges (the cache agreement, sampled tokens) always run on gloo over CPU tensors, as
vLLM keeps a CPU group beside its device group.

Two groups with two timeouts: ``startup`` (loading weights takes a different time on each rank)
for the checks made once at start, and the step group, whose ``timeout_seconds`` bounds how long
a rank waits in any collective of a step — gloo's own default is 30 minutes, so a dead peer would
otherwise hang the engine. A peer that exits closes its sockets, which gloo reports at once.

Source: vLLM's ``GroupCoordinator`` (``vllm/distributed/parallel_state.py``), which wraps the
collectives a model needs behind one object per parallel group.
"""

from __future__ import annotations

import datetime
import pickle
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_TIMEOUT_SECONDS = 20.0
"""How long a rank waits in one collective of a step before the engine calls its peer dead."""

STARTUP_TIMEOUT_SECONDS = 600.0
"""How long the ranks wait for each other while they start (spawn, import, load the weights)."""

_REDUCIBLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


class RankFailed(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or broke its connection.

    Attributes:
        rank: the rank this process believes failed (None when the collective does not say).
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the rendezvous port of a new group)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class TensorParallelGroup:
    """The collectives of one rank in a group of ``size`` ranks.

    Args:
        rank: this process's rank, 0 … size − 1 (rank 0 hosts the store and schedules).
        size: the number of ranks (``tensor_parallel_size``).
        port: the rendezvous port on ``host`` (rank 0 listens there).
        timeout_seconds: the step group's collective timeout.
        startup_timeout_seconds: the store's and the startup group's.

    ``counts`` counts the collectives run on the step group by kind (``all_reduce``,
    ``all_gather``, ``broadcast``), so tests and benchmarks can check how many a step runs.

    Raises:
        RankFailed: the ranks did not all join within ``startup_timeout_seconds``.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        port: int,
        *,
        host: str = "127.0.0.1",
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        startup_timeout_seconds: float = STARTUP_TIMEOUT_SECONDS,
        device: torch.device | None = None,
        peers_alive: Callable[[], None] | None = None,
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of {size}")
        self.rank, self.size, self.timeout_seconds = rank, size, timeout_seconds
        self.device = device or torch.device("cpu")
        """Where the activations this group reduces live (CUDA: an NCCL group carries them)."""
        startup = datetime.timedelta(seconds=startup_timeout_seconds)
        try:
            self._store = dist.TCPStore(host, port, size, rank == 0, timeout=startup, wait_for_workers=False)
            self._join(startup_timeout_seconds, peers_alive)
            # the backend's collectives (allreduce, allgather, broadcast) are not in its type stubs
            self._startup: Any = dist.ProcessGroupGloo(dist.PrefixStore("startup", self._store), rank, size, startup)
            step = datetime.timedelta(seconds=timeout_seconds)
            self._group: Any = dist.ProcessGroupGloo(dist.PrefixStore("step", self._store), rank, size, step)
            self._tensors: Any = self._group
            if self.device.type == "cuda":  # not run on this project's CPU machines: the gpu-marked test covers it
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = step
                self._tensors = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", self._store), rank, size, options)
        except (RuntimeError, dist.DistError) as exc:
            raise RankFailed(f"tensor-parallel rank {rank} of {size} could not join the group on {host}:{port}: {exc}") from exc
        self.counts: Counter[str] = Counter()

    def _join(self, timeout_seconds: float, peers_alive: Callable[[], None] | None) -> None:
        """Every rank says it joined; rank 0 waits until all did, calling ``peers_alive`` (which
        raises for a peer process that died) while it waits, so a worker that dies before
        joining fails the start at once rather than after the startup timeout."""
        self._store.set(f"joined/{self.rank}", "1")
        if self.rank:
            return
        keys = [f"joined/{r}" for r in range(self.size)]
        deadline = time.monotonic() + timeout_seconds
        while not self._store.check(keys):
            if peers_alive is not None:
                peers_alive()
            if time.monotonic() > deadline:
                raise RankFailed(f"tensor-parallel ranks did not all join within {timeout_seconds:g} s")
            time.sleep(0.02)

    # -- tensors -----------------------------------------------------------------------------------
    def all_reduce(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it. A dtype gloo cannot sum is summed
        in float32 and cast back."""
        self.counts["all_reduce"] += 1
        if tensor.dtype in _REDUCIBLE and tensor.is_contiguous():
            self._wait(self._tensors.allreduce([tensor]), "all_reduce")
            return tensor
        work = tensor.float().contiguous()
        self._wait(self._tensors.allreduce([work]), "all_reduce")
        tensor.copy_(work)
        return tensor

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on every rank), in rank order."""
        self.counts["all_gather"] += 1
        return self._gather(self._tensors if tensor.is_cuda else self._group, tensor)

    def _gather(self, group: Any, tensor: Tensor) -> list[Tensor]:
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self._wait(group.allgather([out], [tensor]), "all_gather")
        return out

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same length on every rank), in rank order (on gloo)."""
        self.counts["all_gather"] += 1
        return [t.tolist() for t in self._gather(self._group, torch.tensor(list(values), dtype=torch.int64))]

    def broadcast_ints(self, values: Sequence[int], root: int = 0) -> list[int]:
        """Rank ``root``'s ``values`` on every rank (the same length on every rank)."""
        self.counts["broadcast"] += 1
        t = torch.tensor(list(values), dtype=torch.int64)
        self._wait(self._group.broadcast(t, root), "broadcast")
        return [int(v) for v in t.tolist()]

    def broadcast_object(self, obj: object, root: int = 0) -> object:
        """Rank ``root``'s ``obj`` (pickled) on every rank; other ranks' ``obj`` is ignored."""
        data = pickle.dumps(obj) if self.rank == root else b""
        (length,) = self.broadcast_ints([len(data)], root)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == root else torch.empty(length, dtype=torch.uint8)
        if length:
            self.counts["broadcast"] += 1
            self._wait(self._group.broadcast(buf, root), "broadcast")
        return pickle.loads(buf.numpy().tobytes()) if self.rank != root else obj

    def startup_gather(self, values: Sequence[int]) -> list[list[int]]:
        """:meth:`all_gather_ints` on the startup group (its long timeout), not counted."""
        t = torch.tensor(list(values), dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(self._startup.allgather([out], [t]), "startup all_gather")
        return [o.tolist() for o in out]

    def startup_gather_objects(self, obj: object) -> list[object]:
        """Every rank's ``obj`` (pickled; any size), in rank order, on the startup group."""
        data = pickle.dumps(obj)
        lengths = [row[0] for row in self.startup_gather([len(data)])]
        buf = torch.zeros(max(lengths), dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(buf) for _ in range(self.size)]
        self._wait(self._startup.allgather([out], [buf]), "startup all_gather")
        return [pickle.loads(o[:n].numpy().tobytes()) for o, n in zip(out, lengths, strict=True)]

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait()
        except (RuntimeError, dist.DistError) as exc:
            raise RankFailed(f"tensor-parallel rank {self.rank}: {what} failed (a peer rank died or hung past {self.timeout_seconds:g} s): {exc}") from exc

    def close(self) -> None:
        """Drop the groups and the store (the other ranks' next collective fails at once)."""
        for name in ("_tensors", "_group", "_startup", "_store"):
            if hasattr(self, name):
                delattr(self, name)
