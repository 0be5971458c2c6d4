"""Weight grids: the code sets a quantized weight is rounded onto, registered by name.

A grid says what one code holds (its torch dtype), the largest magnitude it represents
(`qmax`: an observer's scale is amax / qmax) and how to round onto it. The recipe's
`weights.type` names one; observers (MSE's error estimate), RTN and GPTQ read it here
instead of switching on the name.

    fp8   E4M3 codes (float8_e4m3fn), qmax 448   (calib/fp8.py)
    int8  symmetric int codes -127..127, qmax 127  (calib/int8.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .errors import CalibrationError
from .fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8
from .int8 import INT8_DTYPE, INT8_MAX, quantize_int8


@dataclass(frozen=True)
class WeightGrid:
    name: str
    qmax: float  # the largest magnitude a code holds: scale = amax / qmax
    dtype: torch.dtype  # what the codes are stored as
    # (x any float, scale fp32 broadcastable to x) -> codes, x's shape, `dtype`
    quantize: Callable[[torch.Tensor, torch.Tensor | float], torch.Tensor]

    def qdq(self, x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
        """Quantize-dequantize in float32: the value the quantized path sees instead of x."""
        scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        return self.quantize(x, scale).to(torch.float32) * scale


GRIDS: dict[str, WeightGrid] = {
    "fp8": WeightGrid("fp8", FP8_MAX, FP8_DTYPE, quantize_fp8),
    "int8": WeightGrid("int8", INT8_MAX, INT8_DTYPE, quantize_int8),
}


def weight_grid(name: str) -> WeightGrid:
    grid = GRIDS.get(name)
    if grid is None:
        raise CalibrationError(f"unknown weight grid {name!r}; the grids are "
                               f"{', '.join(sorted(GRIDS))}.")
    return grid
