"""FP8 E4M3 numerics of the runtime: the one definition of "quantize to FP8".

Symmetric, scale-only: `q = fp8(clamp(x / scale, -448, 448))`, `x ~= q * scale`. The cast
rounds to nearest even on the E4M3 grid; the clamp saturates out-of-range values (a bare
cast would give NaN). Arithmetic in float32. Calibration (calib/fp8.py) and the KV store
and GEMM references here share this function, so the scales the quantizer measures are
applied exactly as the runtime applies them.

Quantize in torch, not inside Triton kernels: the Triton interpreter's fp32->fp8 cast is
wrong for some values, so kernels receive already-quantized bytes or do the division
and clamp themselves and leave the cast to the wrapper.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 value: 1.75 * 2**8


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale, saturated at ±448, rounded to E4M3. Returns float8_e4m3fn, x's shape.

    scale: float32, broadcastable to x: a scalar (per tensor) or e.g. [C, 1] for a
    [C, K] weight quantized per output channel.
    """
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    y = x.to(torch.float32) / scale
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
