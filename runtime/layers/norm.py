"""RMS normalisation, in the two flavours the supported families use.

Both normalise in fp32. They differ in how the weight is applied:
    RMSNorm (Llama, Qwen, Mistral):  weight * normed.to(x.dtype)
    GemmaRMSNorm (Gemma 3):          (normed * (1 + weight)) in fp32, then cast to x.dtype
The parameter is called `weight` in both, as in the HF checkpoints. bf16 on CPU runs
both in one C call (kernels/native_norm.py: the same roundings, the sum of squares in
another fp32 order).
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels import native_norm


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., dim] fp32
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # [dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim], dtype of x
        if native_norm.usable(x, self.weight):
            return native_norm.rms_norm_bf16(x, self.weight, self.eps, "llama")
        normed = _rms_normalize(x.float(), self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma's norm stores w and scales by (1 + w); GGUF files store 1 + w (see DESIGN.md)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))  # [dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim], dtype of x
        if native_norm.usable(x, self.weight):
            return native_norm.rms_norm_bf16(x, self.weight, self.eps, "gemma")
        out = _rms_normalize(x.float(), self.eps) * (1.0 + self.weight.float())  # fp32
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
