"""Static W8A8 FP8 linear layer (the runtime form of a compressed-tensors FP8 linear).

Replaces an `nn.Linear` of a quantized artifact. On CPU the FP8 weight is upcast once at
load to the compute dtype (exact: every E4M3 value is a bf16 value) and the input is
quantized to FP8 and back with the static input scale, so numerics match the GPU FP8 path
(kernels/fp8_gemm.py); memory holds bf16 weights, the artifact on disk holds FP8.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.fp8_gemm import fp8_linear_torch


class Fp8Linear(nn.Module):
    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                 input_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        out_features, in_features = weight_fp8.shape
        self.in_features, self.out_features = in_features, out_features
        # [out, in] compute dtype, the exact E4M3 values
        self.weight = nn.Parameter(weight_fp8.to(dtype), requires_grad=False)
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1, 1))  # [out|1, 1]
        self.register_buffer("input_scale", input_scale.float().reshape(1))  # [1]
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        y = fp8_linear_torch(x.reshape(-1, self.in_features), self.weight, self.weight_scale,
                             self.input_scale, self.bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 W8A8 static"
