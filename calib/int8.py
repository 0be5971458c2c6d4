"""Symmetric int8 numerics of weight-only linears (W8A16 int), shared by observers, RTN
and GPTQ.

    q = clamp(round(x / scale), -127, 127) as int8,   x ~= q * scale

`round` is round-half-to-even (torch.round), as compressed-tensors rounds. The grid is
symmetric (-128 is never produced), so a zero point is never needed; a scale that maps a
channel's amax onto 127 (`scale_from_amax(amax, INT8_MAX)`) puts that value on the grid's
edge. Arithmetic in float32: inputs of other dtypes are converted first, scales are fp32.
"""

from __future__ import annotations

import torch

INT8_DTYPE = torch.int8
INT8_MAX = 127.0  # largest code used: the symmetric grid is -127..127


def quantize_int8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale rounded to the nearest integer (ties to even), saturated at ±127.
    Returns int8, x's shape. scale: float32, broadcastable to x (a scalar per tensor,
    or e.g. [C, 1] for a [C, K] weight quantized per output channel). x must be finite
    (int8 has no NaN; the observers that make the scales refuse inf/NaN already)."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    y = torch.round(x.to(torch.float32) / scale)
    return y.clamp(-INT8_MAX, INT8_MAX).to(INT8_DTYPE)

