"""Block-wise FP8 weights as released checkpoints store them (DeepSeek-V3 / V4, Qwen3 FP8):
``W.weight`` in ``float8_e4m3fn`` with ``W.weight_scale_inv``, one scale per
``weight_block_size`` block (128 × 128), in float32 or — ``scale_fmt: ue8m0`` — as powers of two
(``float8_e8m0fnu``). ``quantization_config`` says which (``quant_method: fp8``).

Dequantized at load (CPU): ``W[i, j] = q[i, j] · s[i // bn, j // bk]`` computed in float32, then
cast to the model's dtype. Source: DeepSeek-V3's ``weight_dequant`` (inference/kernel.py) and
transformers' ``finegrained_fp8`` integration, whose own dequantization is the tests' reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"
"""``X.weight`` is scaled by ``X.weight_scale_inv`` (transformers' spelling)."""
NATIVE_SCALE = ".scale"
"""…or by ``X.scale`` (DeepSeek-native, as V3 and V4 are released)."""


def scale_names(stored: frozenset[str] | set[str]) -> dict[str, str]:
    """Every scale among the ``stored`` tensor names → the weight it scales: ``X.weight_scale_inv``
    (weight present or not, so an orphan is reported) and ``X.scale`` when ``X.weight`` is stored
    (else ``X.scale`` is an ordinary tensor, such as an mHC ``attn_hc.scale``)."""
    out = {k: k.removesuffix(SCALE_SUFFIX) for k in stored if k.endswith(SCALE_SUFFIX)}
    for k in stored:
        if k.endswith(NATIVE_SCALE) and (weight := k.removesuffix(NATIVE_SCALE) + ".weight") in stored:
            out[k] = weight
    return out
WEIGHT_DTYPES = ("F8_E4M3",)
SCALE_DTYPES = {"float32": ("F32",), "ue8m0": ("F8_E8M0", "F32")}
"""Scale dtype codes accepted per ``scale_fmt`` (a ue8m0 checkpoint may keep float32 scales that are powers of two)."""
KNOWN_KEYS = frozenset(
    {"quant_method", "fmt", "weight_block_size", "activation_scheme", "scale_fmt", "modules_to_not_convert", "dequantize", "expert_dtype"}
)


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """A checkpoint's FP8 layout: the block ``(bn, bk)`` and the scales' format."""

    block: tuple[int, int] = (128, 128)
    scale_fmt: str = "float32"
    expert_dtype: str = "fp8"
    """``fp4``: routed experts packed as e2m1 (:mod:`engine.fp4_weights`), the rest FP8."""

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> Fp8Format:
        """The format ``quantization_config`` declares.

        Raises:
            ValueError: naming the key: another ``quant_method``, ``fmt`` or ``scale_fmt``, a
                static activation scheme, a block that is not two positive integers, an unknown key.
        """
        unknown = sorted(set(raw) - KNOWN_KEYS)
        if unknown:
            raise ValueError(f"quantization_config.{unknown[0]} is not supported")
        if raw.get("quant_method") != "fp8":
            raise ValueError(f"quantization_config.quant_method = {raw.get('quant_method')!r} is not supported (only 'fp8')")
        if raw.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt = {raw.get('fmt')!r} is not supported (only 'e4m3')")
        if raw.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme = {raw.get('activation_scheme')!r} is not supported (only 'dynamic')")
        scale_fmt = raw.get("scale_fmt") or "float32"
        if scale_fmt not in SCALE_DTYPES:
            raise ValueError(f"quantization_config.scale_fmt = {scale_fmt!r} is not supported ({', '.join(SCALE_DTYPES)})")
        block = raw.get("weight_block_size", [128, 128])
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size = {block!r} must be two positive integers")
        expert_dtype = raw.get("expert_dtype") or "fp8"
        if expert_dtype not in ("fp8", "fp4"):
            raise ValueError(f"quantization_config.expert_dtype = {expert_dtype!r} is not supported (fp8, fp4)")
        return cls((int(block[0]), int(block[1])), str(scale_fmt), str(expert_dtype))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scales a weight of ``shape`` ``[..., N, K]`` needs: ``[..., ⌈N/bn⌉, ⌈K/bk⌉]``."""
        bn, bk = self.block
        return (*shape[:-2], -(-shape[-2] // bn), -(-shape[-1] // bk))

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``weight [..., N, K]`` (float8_e4m3fn) times its block scales ``[..., ⌈N/bn⌉,
        ⌈K/bk⌉]`` → float32 ``[..., N, K]``."""
        bn, bk = self.block
        n, k = weight.shape[-2:]
        full = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
        return weight.float() * full
