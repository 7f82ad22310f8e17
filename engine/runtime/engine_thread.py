"""One thread for all of an engine's model work: loading, stepping, closing.

torch runs its CPU kernels' parallel loops on OpenMP thread teams (libgomp), one team per thread
that starts a parallel loop. Once a second thread has a team of its own, libgomp manages more
threads than there are cores and its workers stop spinning between loops (its throttled spin
count), so every small kernel pays a wake-up: measured on 2 cores, a 128×256 by 256×512 linear
runs 1.7× slower on a second thread once the first has run one, and the replay of the bundled
trace 2× slower with the model loaded on the main thread and stepped on another. An engine whose
model is built, stepped and closed on one :class:`EngineThread` keeps one team.

``kvscope up``/``replay`` build their engine on one (:func:`engine.trace.replay.replay` steps
there) and ``kvscope serve`` runs its :class:`~engine.runtime.engine_loop.EngineLoop` on the
thread that built the engine.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], "Future[Any]"]


class EngineThread:
    """A daemon thread running the callables given to it, one at a time, in order.

    Args:
        name: the thread's name (shown by ``py-spy``, ``top -H`` and log records).
    """

    def __init__(self, name: str = "kvscope-engine") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def here(self) -> bool:
        """Whether the caller is this thread."""
        return threading.current_thread() is self._thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Queue ``fn(*args, **kwargs)``; its future holds the result or what it raised.

        Raises:
            RuntimeError: the thread was closed.
        """
        if not self._thread.is_alive():
            raise RuntimeError(f"engine thread {self._thread.name} is not running")
        future: Future[T] = Future()
        self._jobs.put((fn, args, kwargs, future))
        return future

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on this thread (at once when called from it), waiting for it;
        re-raises what it raised."""
        if self.here:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def close(self, timeout_seconds: float | None = 30.0) -> None:
        """Stop after the queued callables; waits up to ``timeout_seconds`` (from another thread)."""
        self._jobs.put(None)
        if not self.here:
            self._thread.join(timeout_seconds)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, kwargs, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)
