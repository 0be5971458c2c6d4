"""Rotary position embedding of bf16 heads in C on CPU (csrc/rotary_cpu.c).

    out = rotary_bf16(x, cos, sin)   # x [T, H, D] bf16, cos/sin [T, D] bf16 -> [T, H, D]

runtime/layers/rotary.py's `apply_rotary` in one call instead of ~6 torch ops, bit for bit
(tested). `usable()` says whether these tensors can take it (bf16 on CPU, heads
contiguous in each token, the library built).
"""

from __future__ import annotations

import torch

from .native_build import cached_library
from .native_call import keyword_calls

# the loaded library with its functions' signatures set, or None where it cannot build
_library = cached_library("rotary_cpu")


def available() -> bool:
    """True when the C library is built and loaded (builds it on first call)."""
    return _library() is not None


def usable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if x.dim() != 3 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return False
    t, h, d = x.shape
    return (d % 2 == 0 and x.stride(2) == 1 and x.stride(1) == d
            and cos.dtype == sin.dtype == torch.bfloat16 and cos.shape == sin.shape == (t, d)
            and cos.is_contiguous() and sin.is_contiguous() and _library() is not None)


@keyword_calls("rotary_cpu")
def rotary_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if not usable(x, cos, sin):
        raise ValueError(f"rotary_bf16 takes bf16 CPU x [T, H, D] (heads contiguous) and "
                         f"contiguous bf16 cos/sin [T, D]; got x {x.dtype} {list(x.shape)}, "
                         f"cos {cos.dtype} {list(cos.shape)}.")
    t, h, d = x.shape
    out = torch.empty(t, h, d, dtype=torch.bfloat16)
    _library().qserve_rotary_bf16(x=x.data_ptr(), tokens=t, token_stride=x.stride(0), heads=h,
                                  dim=d, cos=cos.data_ptr(), sin=sin.data_ptr(),
                                  out=out.data_ptr())
    return out


__all__ = ["available", "rotary_bf16", "usable"]
