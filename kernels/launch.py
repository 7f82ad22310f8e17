"""Whether the kernels' launchers may read device tensors on the host, and on which GPU they
launch (:func:`on_tensor_device`).

Each launcher validates its arguments before it launches: shapes, dtypes and strides (host
metadata, free), and values such as ``seq_lens.max()`` against the block table's width or the
range of block ids (``int(...)`` of a device tensor: a device-to-host copy that waits for the
stream). A CUDA graph capture cannot contain such a wait, and a decode step that is replayed from
a graph never runs the launcher at all, so while :func:`graph_safe` is true the launchers skip
the value checks; the caller (the serving runtime's model runner, which builds those values on
the host) checks them instead before every replay.

:func:`graph_safe` is true while the current CUDA stream is capturing, and inside
:func:`static_launches`: what the model runner uses for its warm-up and capture runs, and for
eager steps checked with ``check_graph_safe`` (how tests run the captured path on CPU under
Triton's interpreter). Ordinary eager steps keep the host checks.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import ParamSpec, TypeVar

import torch

_local = threading.local()
_P = ParamSpec("_P")
_R = TypeVar("_R")


def graph_safe(*tensors: torch.Tensor) -> bool:
    """True inside :func:`static_launches` on this thread, or while the current CUDA stream is
    capturing a graph (checked when any of ``tensors`` is on CUDA)."""
    if getattr(_local, "depth", 0):
        return True
    return any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing()


@contextmanager
def static_launches() -> Iterator[None]:
    """Launch without host reads of device values on this thread (nestable)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def on_tensor_device(launcher: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``launcher`` with its first tensor argument's GPU as the current device (Triton
    launches on the current device's current stream, and the current device is per thread:
    without this a model on ``cuda:1`` would launch on ``cuda:0``). A no-op for CPU tensors."""

    @functools.wraps(launcher)
    def launch(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        with torch.cuda.device(first.device) if first is not None and first.is_cuda else nullcontext():
            return launcher(*args, **kwargs)

    return launch
