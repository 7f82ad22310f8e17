"""Whether the kernels' launchers may read device tensors on the host.

Each launcher validates its arguments before it launches: shapes, dtypes and strides (host
metadata, free), and values such as ``seq_lens.max()`` against the block table's width or the
range of block ids (``int(...)`` of a device tensor: a device-to-host copy that waits for the
stream). A CUDA graph capture cannot contain such a wait, and a decode step that is replayed from
a graph never runs the launcher at all, so while :func:`graph_safe` is true the launchers skip
the value checks; the caller (the serving runtime's model runner, which builds those values on
the host) checks them instead before every replay.

:func:`graph_safe` is true while the current CUDA stream is capturing, and inside
:func:`static_launches` (what the model runner uses on every device, so the same path runs on CPU
under Triton's interpreter in tests).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_local = threading.local()


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
