"""Children that die with their parent: Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``).

A child of ``kvscope up``, ``kvscope dashboard`` or ``kvscope serve`` (Streamlit, a
tensor-parallel rank) must not outlive its parent, also when the parent is SIGKILLed and none of
its shutdown code runs. The kernel sends the child the chosen signal when its parent dies:

- :func:`preexec_die_with_parent` — for ``subprocess.Popen(preexec_fn=...)``: armed in the child
  between ``fork`` and ``exec`` (the setting survives ``exec``).
- :func:`die_with_parent` — at the top of a ``multiprocessing`` child's entry function.

Both close the race where the parent died before the signal was armed: the child then compares
``os.getppid()`` with the parent's pid and sends itself the signal at once.

Caveat (``prctl(2)``): the signal fires when the *thread* that forked the child exits, not the
process. Start children from the main thread, or from a thread that lives as long as the process.

Elsewhere than Linux nothing is armed (one log line says so); callers keep their other means (a
supervised process group, a watch on the parent's pid).

No torch import here: the CLI's light commands (``kvscope dashboard``) use it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
"""``<linux/prctl.h>``: set the parent-death signal of the calling process."""


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or None where it does not exist (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl: Callable[..., int] = libc.prctl
    except (OSError, AttributeError):
        return None
    return prctl


def _arm(prctl: Callable[..., int], parent_pid: int, sig: int) -> bool:
    """Ask for ``sig`` at the parent's death; if ``parent_pid`` is no longer the parent (it died
    already), deliver ``sig`` to this process now. Returns whether ``prctl`` succeeded."""
    armed = prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return armed


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """In a child process: receive ``sig`` when the parent (process ``parent_pid``, as the child
    knows it from its parent, never from ``os.getppid()`` read late) dies.

    Returns:
        True when the kernel will send it; False where it cannot (not Linux, or ``prctl``
        failed: logged once here).
    """
    prctl = _prctl()
    if prctl is None:
        log.info("parent-death signal unavailable on %s: this child relies on its parent to stop it", sys.platform)
        return False
    if not _arm(prctl, parent_pid, sig):
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this child relies on its parent to stop it", ctypes.get_errno())
        return False
    return True


def preexec_die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` making the child receive ``sig`` when this
    process (the thread calling ``Popen``) dies; None where that is unavailable (not Linux:
    logged once here).

    libc is looked up here, in the parent, so the child runs only ``prctl`` and ``getppid``
    between ``fork`` and ``exec`` (no import, no lock taken).
    """
    prctl = _prctl()
    if prctl is None:
        log.info("parent-death signal unavailable on %s: children are stopped by their parent only", sys.platform)
        return None
    parent_pid = os.getpid()

    def arm() -> None:
        _arm(prctl, parent_pid, sig)

    return arm
