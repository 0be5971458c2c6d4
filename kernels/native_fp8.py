"""The FP8 linear's input quantization and output rescale in C, for bf16 on CPU.

    x_q = quantize_values_bf16(x, input_scale)   # bf16 [T, in]: E4M3(x / s) as bf16
    y = rescale_bf16(acc, out_scale)             # bf16 [T, out]: bf16(acc * scale)

Bit-identical to kernels/fp8.py `quantize_fp8_values` and kernels/fp8_gemm.py `_rescale`
(tested on every bf16 value), one pass and one call each (csrc/fp8_activation_cpu.c,
built by native_build.py). `available()` says whether the library is built; callers keep
their torch paths for other dtypes and for machines without a C compiler.
"""

from __future__ import annotations

import torch

from .native_build import cached_library
from .native_call import keyword_calls

# the loaded library with its functions' signatures set, or None where it cannot build
_library = cached_library("fp8_activation_cpu")


def available() -> bool:
    """True when the C library is built and loaded (builds it on first call)."""
    return _library() is not None


def _require(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous bf16 CPU tensor, got {t.dtype} "
                         f"on {t.device}{'' if t.is_contiguous() else ', not contiguous'}.")


@keyword_calls("fp8_activation_cpu")
def quantize_values_bf16(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x bf16 (contiguous), scale fp32 one element -> E4M3 values of x / scale, bf16."""
    _require(x, "x")
    out = torch.empty_like(x)
    _library().qserve_quantize_e4m3_bf16(x=x.data_ptr(), n=x.numel(), scale=float(scale),
                                         out=out.data_ptr(), num_threads=torch.get_num_threads())
    return out


@keyword_calls("fp8_activation_cpu")
def rescale_bf16(acc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """acc bf16 [T, out] (contiguous), scale fp32 [1, out] or one element -> bf16 [T, out]."""
    _require(acc, "acc")
    s = scale.to(torch.float32).contiguous().reshape(-1)
    cols = acc.shape[-1]
    if s.numel() not in (1, cols):
        raise ValueError(f"scale has {s.numel()} elements; need 1 or {cols}.")
    out = torch.empty_like(acc)
    _library().qserve_rescale_bf16(acc=acc.data_ptr(), rows=acc.numel() // max(cols, 1),
                                   cols=cols, scale=s.data_ptr(), scale_len=s.numel(),
                                   out=out.data_ptr(), num_threads=torch.get_num_threads())
    return out


__all__ = ["available", "quantize_values_bf16", "rescale_bf16"]
