"""FP4 expert weights as DeepSeek-V4 releases them (``expert_dtype: fp4``).

A routed expert's ``X.weight [N, K]`` is stored as ``int8 [N, K/2]``: two ``e2m1`` values per
byte, element ``2j`` in the low nibble and ``2j + 1`` in the high one, each nibble
``s·e·m`` (sign, 2 exponent bits, 1 mantissa bit) meaning one of
``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (negated with the sign bit). Its scale ``[N, K/32]``
(``float8_e8m0fnu`` with ``scale_fmt: ue8m0``, else float32) covers 32 consecutive elements of
a row (MXFP4's block, OCP Microscaling spec v1.0). Dequantized at load:
``W[n, k] = e2m1(q[n, k]) · s[n, k // 32]`` in float32. Source of the layout: transformers'
``finegrained_fp8`` integration (``FP8Experts`` allocation and ``Fp8Dequantize._unpack_fp4``),
whose dequantization is the tests' reference.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit code (index = the nibble)."""
FP4_BLOCK = 32
"""Elements of a row sharing one scale."""
PACKED_DTYPES = ("I8", "U8")
"""safetensors dtype codes of packed FP4 storage."""


def fp4_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(stored weight shape, scale shape) of an FP4 weight whose dequantized shape is
    ``[..., N, K]``: ``[..., N, K/2]`` and ``[..., N, ⌈K/32⌉]``."""
    *lead, n, k = shape
    return (*lead, n, k // 2), (*lead, n, -(-k // FP4_BLOCK))


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``packed [..., N, K/2]`` (int8 or uint8) and ``scale [..., N, ⌈K/32⌉]`` → float32
    ``[..., N, K]``."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = packed.contiguous().view(torch.uint8)
    values = torch.stack((table[(codes & 0xF).long()], table[(codes >> 4).long()]), dim=-1).flatten(-2)
    k = values.shape[-1]
    full = scale.float().repeat_interleave(FP4_BLOCK, dim=-1)[..., :k]
    return values * full


def quantize_fp4(w: torch.Tensor, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse for tests and tools: ``w [N, K]`` (K even) → (int8 ``[N, K/2]``, scales
    ``[N, ⌈K/32⌉]``), each block scaled so its largest magnitude maps to 6 (ue8m0: the scale
    rounded up to a power of two) and every value rounded to the nearest e2m1 code."""
    k = w.shape[-1]
    blocks = torch.nn.functional.pad(w.float(), (0, -k % FP4_BLOCK)).unflatten(-1, (-1, FP4_BLOCK))
    scale = blocks.abs().amax(dim=-1).clamp(min=1e-12) / 6.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scaled = w.float() / scale.repeat_interleave(FP4_BLOCK, dim=-1)[:, :k]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = (scaled[..., None] - table).abs().argmin(dim=-1).to(torch.uint8)  # [N, K]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu) if ue8m0 else scale
