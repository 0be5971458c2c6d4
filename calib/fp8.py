"""FP8 E4M3 (`torch.float8_e4m3fn`) numerics shared by observers and the quantizer.

Symmetric, scale-only quantization: `q = fp8(clamp(x / scale, -448, 448))` and
`x ~= q * scale`. The cast rounds to nearest, ties to even, on the E4M3 grid (3 mantissa
bits, subnormals down to 2**-9, no infinities); the clamp makes out-of-range values and
±inf saturate at ±448 (a bare cast would turn them into NaN). NaN stays NaN.

All arithmetic is done in float32: inputs of other dtypes are converted first (bf16 and
fp16 convert exactly), scales are float32.
"""

from __future__ import annotations

import torch

from ..kernels.fp8 import (FP8_DTYPE, FP8_MAX, MIN_SCALE,  # noqa: F401  (re-exported)
                           quantize_fp8, scale_from_amax)


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q * scale computed in float32, returned as `dtype`. q: float8_e4m3fn."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    return (q.to(torch.float32) * scale).to(dtype)


def qdq_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Quantize-dequantize in float32: the value the FP8 path sees instead of x."""
    return dequantize_fp8(quantize_fp8(x, scale), scale, torch.float32)
