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

# Smallest scale handed out. A zero amax (an all-zero tensor) would otherwise give a zero
# scale and 0/0 on quantization. float32 eps, as llm-compressor does: products of two
# scales (activation x weight, ~1e-14) still stay well inside float32's normal range.
MIN_SCALE = float(torch.finfo(torch.float32).eps)


def scale_from_amax(amax: torch.Tensor | float, qmax: float = FP8_MAX) -> torch.Tensor:
    """Scale that maps `amax` onto `qmax`: `max(amax / qmax, MIN_SCALE)`, float32.

    amax: [] (per tensor) or [C] (per channel), any float dtype, >= 0.
    """
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.clamp(amax / qmax, min=MIN_SCALE)


# Smallest per-token scale (dynamic inputs): a row of zeros still gets a finite scale.
MIN_TOKEN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8: [T, in] any float -> ([T, in] fp32 holding E4M3 values,
    [T, 1] fp32 scales). Each row is multiplied by the reciprocal of its scale
    max|row| / 448 (at least MIN_TOKEN_SCALE), saturated and rounded to E4M3."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_TOKEN_SCALE)
    q = (x.float() * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.float(), scale


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale, saturated at ±448, rounded to E4M3. Returns float8_e4m3fn, x's shape.

    scale: float32, broadcastable to x: a scalar (per tensor) or e.g. [C, 1] for a
    [C, K] weight quantized per output channel.
    """
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    y = x.to(torch.float32) / scale
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_values(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`quantize_fp8(x, scale).to(x.dtype)` without the FP8 dtype: the E4M3 values of
    x / scale in x's (floating) dtype, bit for bit the same (tested on every bf16 value).

    Eager torch converts to and from float8 one element at a time; this rounds on the E4M3
    grid with vectorised fp32 ops instead, which is faster from 16 rows of activations up.
    The grid spacing of |y| in [2^e, 2^(e+1)) is 2^(e-3) for e >= -6 (3 mantissa bits) and
    2^-9 below (subnormals); y / spacing is exact, so round-half-even there is the cast's
    rounding. scale: float32, broadcastable to x.
    """
    y = torch.clamp(x.to(torch.float32) / scale, -FP8_MAX, FP8_MAX)  # fp32
    exponent_bits = torch.bitwise_and(y.view(torch.int32), 0x7F800000)  # biased exponent << 23
    spacing = exponent_bits.clamp_(min=(127 - 6) << 23).sub_(3 << 23).view(torch.float32)
    return torch.round(y.div_(spacing)).mul_(spacing).to(x.dtype)
