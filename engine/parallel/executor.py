"""The worker ranks of a tensor-parallel engine: spawned, driven and stopped by rank 0 (shaped
like vLLM's multiprocess executor).

``LLM(..., tensor_parallel_size=N)`` in the caller's process is rank 0; it spawns ranks
1 … N − 1, each a process that builds the same ``LLM`` on its own shard and then waits on a pipe
for rank 0's calls. Every public call of rank 0 that runs the model (:func:`runs_on_every_rank`) is
sent to the workers first and then run on rank 0; all ranks execute it in lockstep, meeting in
the collectives of the forward and of the cache agreement (:mod:`engine.cache.rank_agreement`).
Rank 0 waits for every worker's reply before it returns.

Commands travel on pipes, not collectives, so a worker may wait for the next one indefinitely
(a collective would time out); a worker exits when its pipe closes (rank 0 gone), so no rank
outlives the engine. A worker that dies is seen at once through its process sentinel.

A worker also dies with rank 0 when rank 0 is SIGKILLed while the worker is busy (loading its
shard, inside a collective): it asks the kernel for SIGKILL at its parent's death
(:mod:`engine.parent_death`). That signal follows the *thread* that started the workers, so build
a tensor-parallel ``LLM`` on the main thread (or one that lives as long as the process).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from engine.parallel.group import STARTUP_TIMEOUT_SECONDS, RankFailed
from engine.parent_death import die_with_parent

log = logging.getLogger(__name__)

_CLOSE = "__close__"
_CALL = "__call__"

F = TypeVar("F", bound=Callable[..., Any])


class WorkerError(RankFailed):
    """A worker raised while running a call (rank 0 usually raised the same: a user error)."""


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a worker needs to join: its rank, the group size, the rendezvous port, the step
    collectives' timeout and its torch threads."""

    rank: int
    size: int
    port: int
    timeout_seconds: float
    threads: int


class RankProcesses:
    """Rank 0's handle on ranks 1 … N − 1.

    Args:
        size: N.
        port: the group's rendezvous port.
        timeout_seconds: the step collectives' timeout (also how long :meth:`collect` waits for
            a worker that is alive but silent after rank 0 finished).
        factory: what each worker builds its engine with (the ``LLM`` class: pickled by name).
        llm_kwargs: the keyword arguments of ``factory`` (picklable); each worker adds its
            ``_rank`` (:class:`RankSpec`).

    Raises:
        RankFailed: a worker died before it could join.
    """

    def __init__(self, size: int, port: int, timeout_seconds: float, factory: Callable[..., Any], llm_kwargs: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // size)
        self.timeout_seconds = timeout_seconds
        self.lock = threading.RLock()
        self.depth = 0
        """Nesting of :func:`runs_on_every_rank` calls on rank 0 (only the outermost is sent)."""
        self.processes: list[tuple[int, mp.process.BaseProcess, Connection]] = []
        """(rank, process, pipe) of every worker."""
        self.failed: RankFailed | None = None
        """Set once a worker died, hung or answered out of turn: every later call is refused."""
        try:
            for rank in range(1, size):
                parent, child = ctx.Pipe()
                spec = RankSpec(rank, size, port, timeout_seconds, threads)
                proc = ctx.Process(target=_worker_main, args=(spec, factory, llm_kwargs, child), name=f"kvscope-tp-rank{rank}", daemon=True)
                proc.start()
                child.close()
                self.processes.append((rank, proc, parent))
            for rank, _, _ in self.processes:
                self._reply(rank, "its start", STARTUP_TIMEOUT_SECONDS)
        except BaseException:
            self.close()
            raise

    def check_alive(self) -> None:
        """Raise :class:`RankFailed` naming the first worker whose process has exited."""
        dead = self.dead()
        if dead:
            raise RankFailed(f"tensor-parallel rank {dead[0]} exited before it joined the group", dead[0])

    def dead(self) -> list[int]:
        """Ranks whose process has exited."""
        return [rank for rank, proc, _ in self.processes if not proc.is_alive()]

    def send(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Ask every worker to run ``LLM.<name>(*args, **kwargs)``.

        Raises:
            RankFailed: a worker is gone.
        """
        if self.failed is not None:
            raise RankFailed(f"the engine lost a tensor-parallel rank earlier ({self.failed}); start a new one", self.failed.rank)
        for rank, _, conn in self.processes:
            try:
                conn.send((name, args, kwargs))
            except (BrokenPipeError, OSError) as exc:
                self.failed = RankFailed(f"tensor-parallel rank {rank} is gone: {exc}", rank)
                raise self.failed from exc

    def ready(self) -> None:
        """Wait until every worker built its engine (its weights loaded and sharded).

        Raises:
            RankFailed: a worker died or failed while building it.
        """
        for rank, _, _ in self.processes:
            self._reply(rank, "building its engine", STARTUP_TIMEOUT_SECONDS)

    def collect(self, *, raise_errors: bool = True) -> list[Any]:
        """Every worker's reply to the last :meth:`send`, in rank order (values of
        :meth:`LLM.on_every_rank`; None otherwise).

        Raises:
            RankFailed: a worker died, stayed silent past the timeout, or (``raise_errors``)
                raised while rank 0 did not.
        """
        replies: list[Any] = []
        failure: RankFailed | None = None
        for rank, _, _ in self.processes:
            try:
                replies.append(self._reply(rank, "a call"))
            except RankFailed as exc:
                failure = failure or exc
                replies.append(None)
        if failure is not None and (raise_errors or not isinstance(failure, WorkerError)):
            self.failed = self.failed or failure  # died, hung, or failed where rank 0 did not: the ranks diverged
        if failure is not None and raise_errors:
            raise failure
        return replies

    def lockstep(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], here: Callable[[], Any]) -> tuple[Any, list[Any]]:
        """Send ``name(*args, **kwargs)`` to every worker, run ``here()`` on rank 0, then await
        every reply: ``(here's result, the workers' replies)``. A collective that failed marks the
        engine failed, naming the dead worker.

        Raises:
            RankFailed: a worker died, hung or failed where rank 0 did not.
        """
        with self.lock:
            self.depth += 1
            try:
                self.send(name, args, kwargs)
                try:
                    result = here()
                except RankFailed as exc:
                    self.collect(raise_errors=False)
                    self.failed = self.failed or self.named(exc)
                    raise self.failed from exc
                except BaseException:
                    self.collect(raise_errors=False)
                    raise
                return result, self.collect()
            finally:
                self.depth -= 1

    def named(self, exc: RankFailed) -> RankFailed:
        """``exc`` naming the dead worker when the collective that failed could not say which."""
        dead = self.dead()
        if exc.rank is not None or not dead:
            return exc
        return RankFailed(f"tensor-parallel rank {dead[0]} died ({exc})", dead[0])

    def _reply(self, rank: int, what: str, timeout_seconds: float | None = None) -> Any:
        _, proc, conn = self.processes[rank - 1]
        timeout = self.timeout_seconds * 2 + 30 if timeout_seconds is None else timeout_seconds
        ready = wait([conn, proc.sentinel], timeout=timeout)
        if conn in ready:
            try:
                status, value = conn.recv()
            except (EOFError, OSError) as exc:
                raise RankFailed(f"tensor-parallel rank {rank} died during {what}", rank) from exc
            if status == "error":
                raise WorkerError(f"tensor-parallel rank {rank} failed during {what}: {value}", rank)
            return value
        if proc.sentinel in ready:
            raise RankFailed(f"tensor-parallel rank {rank} died during {what} (exit code {proc.exitcode})", rank)
        raise RankFailed(f"tensor-parallel rank {rank} did not answer {what} within {timeout:g} s", rank)

    def close(self, timeout_seconds: float = 10.0) -> None:
        """Stop every worker: ask it to close its engine, then terminate what is left."""
        for _, _, conn in self.processes:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send((_CLOSE, (), {}))
        for _, proc, conn in self.processes:
            proc.join(timeout_seconds)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
            conn.close()
        self.processes = []


def runs_on_every_rank(*local_only: str) -> Callable[[F], F]:
    """Make an ``LLM`` method run on every rank: on rank 0 of a tensor-parallel engine it is
    sent to the workers (without the keyword arguments named in ``local_only``, such as
    callbacks), then run here, then every worker's reply is awaited. Elsewhere the method runs
    as it is (a nested call on rank 0 too: the workers run it as part of the outer one)."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            engine_ranks = getattr(self, "ranks", None)
            ranks: RankProcesses | None = None if engine_ranks is None else engine_ranks.workers
            if ranks is None:
                return method(self, *args, **kwargs)
            with ranks.lock:  # re-entrant: the depth is this thread's own call
                if ranks.depth:  # inside a call every rank already runs
                    return method(self, *args, **kwargs)
                shared = {k: v for k, v in kwargs.items() if k not in local_only}
                return ranks.lockstep(method.__name__, args, shared, lambda: method(self, *args, **kwargs))[0]

        return call  # type: ignore[return-value]

    return wrap


def run_on_every_rank(ranks: RankProcesses, target: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> list[Any]:
    """``fn(target, *args)`` on rank 0 (``target``: its ``LLM``) and on every worker (their
    own), in rank order; ``fn`` must be picklable (a module-level function)."""
    mine, theirs = ranks.lockstep(_CALL, (fn, *args), {}, lambda: fn(target, *args))
    return [mine, *theirs]


def _worker_main(spec: RankSpec, factory: Callable[..., Any], llm_kwargs: dict[str, Any], conn: Connection) -> None:
    """A worker rank: build the engine's shard, then run rank 0's calls until told to stop or
    until rank 0 is gone (or SIGKILLed by the kernel when rank 0 dies)."""
    parent = mp.parent_process()
    if parent is not None and parent.pid is not None:
        die_with_parent(parent.pid, signal.SIGKILL)
    import torch

    torch.set_num_threads(spec.threads)
    conn.send(("ok", None))  # started: rank 0 now joins the group with us
    try:
        llm = factory(**llm_kwargs, _rank=spec)
    except BaseException as exc:  # rank 0 fails the same way, or learns why here
        _send(conn, ("error", f"{type(exc).__name__}: {exc}"))
        return
    if not _send(conn, ("ok", None)):  # ready
        return
    while True:
        try:
            name, args, kwargs = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            break
        if name == _CLOSE:
            llm.close()
            break
        try:
            value = args[0](llm, *args[1:]) if name == _CALL else getattr(llm, name)(*args, **kwargs)
            reply: tuple[str, Any] = ("ok", value if name == _CALL else None)
        except BaseException as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}")
        if not _send(conn, reply):
            break
    conn.close()


def _send(conn: Connection, message: tuple[str, Any]) -> bool:
    try:
        conn.send(message)
        return True
    except (BrokenPipeError, OSError):
        return False
