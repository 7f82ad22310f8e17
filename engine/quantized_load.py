"""Checking and dequantizing a checkpoint's quantized weights at load: block FP8
(:mod:`engine.fp8_weights`) and, with ``expert_dtype: fp4``, packed FP4 experts
(:mod:`engine.fp4_weights`). Every check names the file and the tensor."""

from __future__ import annotations

import torch

from engine.fp4_weights import PACKED_DTYPES, dequantize_fp4, fp4_shapes
from engine.fp8_weights import SCALE_DTYPES, WEIGHT_DTYPES, Fp8Format
from engine.load_errors import ModelLoadError
from engine.weight_files import TensorInfo, WeightFiles


def is_quantized(info: TensorInfo, fmt: Fp8Format) -> bool:
    """Whether the stored tensor is a quantized weight under ``fmt`` (FP8, or packed FP4)."""
    return info.dtype in WEIGHT_DTYPES or (fmt.expert_dtype == "fp4" and info.dtype in PACKED_DTYPES)


def check_quantized(
    files: WeightFiles, key: str, info: TensorInfo, fmt: Fp8Format, scale_key: str | None, target: tuple[int, ...]
) -> str:
    """The scale tensor of quantized weight ``key`` (``scale_key``: ``X.weight_scale_inv`` or
    ``X.scale``, None when neither is stored), checked against the model's ``target`` shape:
    present, its dtype, the weight's and the scale's shapes.

    Raises:
        ModelLoadError: naming the tensor and the file.
    """
    if scale_key is None:
        raise ModelLoadError(f"{info.file}: tensor {key} is {info.torch_dtype} without its {key}_scale_inv (or {key.removesuffix('.weight')}.scale)")
    if len(info.shape) < 2:
        raise ModelLoadError(f"{info.file}: tensor {key} is {info.torch_dtype} of shape {info.shape}; block scaling needs a matrix")
    scale = files.tensors[scale_key]
    if scale.dtype not in SCALE_DTYPES[fmt.scale_fmt]:
        raise ModelLoadError(f"{scale.file}: tensor {scale_key} has dtype {scale.torch_dtype}; scale_fmt {fmt.scale_fmt!r} needs {SCALE_DTYPES[fmt.scale_fmt]}")
    if info.dtype in WEIGHT_DTYPES:
        weight_shape, scale_shape, what = target, fmt.scale_shape(target), f"blocks {fmt.block}"
    else:
        weight_shape, scale_shape = fp4_shapes(target)
        what = "FP4 (two values a byte, one scale per 32)"
    if info.shape != weight_shape:
        raise ModelLoadError(f"{info.file}: tensor {key} has shape {info.shape}, the config needs {weight_shape} ({what} of {target})")
    if scale.shape != scale_shape:
        raise ModelLoadError(f"{scale.file}: tensor {scale_key} has shape {scale.shape}, {what} of {target} need {scale_shape}")
    return scale_key


def dequantize(fmt: Fp8Format, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight of a checked (weight, scale) pair."""
    if weight.dtype in (torch.int8, torch.uint8):
        return dequantize_fp4(weight, scale)
    return fmt.dequantize(weight, scale)
