"""What a CUDA graph of the decode step may contain, and the check that proves a model's decode
forward is capturable without a GPU.

A CUDA graph (``torch.cuda.CUDAGraph``; vLLM's ``CUDAGraphRunner``, SGLang's
``CudaGraphRunner``) records the kernels of one forward and replays them on the same addresses.
Everything the forward does must therefore be a device operation on fixed shapes:

* no host read of a device value (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``,
  ``torch.equal``): the capture fails on CUDA, and a replay would reuse the value read at capture
  time;
* no output whose shape depends on values (``nonzero``, one-argument ``where``, boolean-mask
  indexing, ``unique``, ``masked_select``, ``bincount``, ``repeat_interleave`` by a tensor);
* no tensor built from host data (``torch.tensor([...])``, indexing with a Python list): its
  host-to-device copy is recorded from a host buffer the replay no longer owns.

:class:`forbid_host_sync` raises :class:`HostSyncError` on each of these, on any device, so a test
on CPU catches them in what a capture on CUDA would record (the kernels' launchers run under
Triton's interpreter there, whose own host work is exempt). The model runner runs its capture
and, when asked, its CPU steps under it. What it cannot see: a tensor passed where torch's C++
argument parser wants a number (``torch.arange(t)``, ``x.new_zeros(t)``: the parser reads it
without a Python call), and a CPU tensor moved to the GPU inside the forward (on CPU nothing
moves); the GPU test's real capture covers those.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from engine.model.deepseek_v4_attention import DeepseekV4Attention
from engine.model.qwen3_next_moe import Qwen3NextSparseMoe

_HOST_READS = {
    Tensor.item, Tensor.tolist, Tensor.__int__, Tensor.__float__, Tensor.__bool__, Tensor.__index__,
    Tensor.__complex__, Tensor.cpu, Tensor.numpy, Tensor.is_nonzero, torch.is_nonzero,
    torch.equal, Tensor.equal, torch.allclose, Tensor.allclose,
}  # fmt: skip
_VALUE_SHAPED = {
    torch.nonzero, Tensor.nonzero, torch.argwhere, Tensor.argwhere, torch.masked_select, Tensor.masked_select,
    torch.unique, Tensor.unique, torch.unique_consecutive, Tensor.unique_consecutive, torch.bincount, Tensor.bincount,
}  # fmt: skip
_FROM_HOST = {torch.tensor, torch.as_tensor, Tensor.new_tensor, torch.from_numpy}
_INDEXING = {Tensor.__getitem__, Tensor.__setitem__, Tensor.index_put_, Tensor.index_put, torch.index_put}
_TRITON_DIR = f"{os.sep}triton{os.sep}"


class HostSyncError(RuntimeError):
    """An operation a CUDA graph capture cannot contain ran inside :class:`forbid_host_sync`."""


def _is_mask(index: object) -> bool:
    if isinstance(index, Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, tuple | list):
        return any(_is_mask(i) for i in index)
    return False


def _has_list(index: object) -> bool:
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


def _inside_triton() -> bool:
    """Whether the op was called by Triton itself (its interpreter moves tensors to the host)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if _TRITON_DIR in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class forbid_host_sync(TorchFunctionMode):
    """Raise :class:`HostSyncError` on host reads of device values, value-dependent shapes and
    tensors built from host data (module docstring) inside the ``with`` block, on any device.

    Raises:
        HostSyncError: at the offending call, naming it.
    """

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        reason = None
        if func in _HOST_READS:
            reason = "reads a device value on the host"
        elif func in _VALUE_SHAPED:
            reason = "has an output shape that depends on values"
        elif func in _FROM_HOST and not (func is torch.as_tensor and args and isinstance(args[0], Tensor)):
            reason = "builds a tensor from host data"
        elif func is torch.where and len(args) + len(kwargs) == 1:
            reason = "with one argument is nonzero (a value-dependent shape)"
        elif func in _INDEXING and len(args) > 1 and _is_mask(args[1]):
            if not (func is Tensor.__setitem__ and isinstance(args[2], int | float | bool)):  # masked_fill_
                reason = "indexes with a boolean mask (a value-dependent shape)"
        elif func in _INDEXING and len(args) > 1 and _has_list(args[1]):
            reason = "indexes with a Python list (copied to the device at every call)"
        elif func in (torch.repeat_interleave, Tensor.repeat_interleave) and kwargs.get("output_size") is None:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if (func is torch.repeat_interleave and len(args) == 1 and "repeats" not in kwargs) or isinstance(repeats, Tensor):
                reason = "repeats by a tensor (a value-dependent shape)"
        if reason is not None and not _inside_triton():
            name = getattr(func, "__name__", None) or repr(func)
            raise HostSyncError(f"{name} {reason}: a CUDA graph cannot capture it")
        return func(*args, **kwargs)


def graph_unsafe_reason(model: nn.Module) -> str | None:
    """Why ``model``'s batched decode forward cannot be captured, or None when it can: on the torch
    backend Qwen3-Next's sparse MoE dispatches tokens to experts by value (``unique`` and ``where``
    over the router's choices; the Triton backend's :func:`kernels.fused_moe.fused_moe` has fixed
    shapes); DeepSeek-V4's layers run per row on each sequence's own state
    (:meth:`~engine.model.decode_batch.DecodeBatch.per_row`)."""
    if any(isinstance(m, Qwen3NextSparseMoe) and m.kernel_backend != "triton" for m in model.modules()):
        return "its sparse MoE layers dispatch tokens to experts by value on the torch backend (the Triton backend's fused_moe does not)"
    if any(isinstance(m, DeepseekV4Attention) for m in model.modules()):
        return "its DeepSeek-V4 layers decode per row on per-sequence compressor and indexer state"
    return None
