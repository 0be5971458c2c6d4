"""The W8A8 FP8 linear for a few rows on CPU, in C, reading one byte per weight.

    y = fp8_gemv_bf16(x, weight_fp8, input_scale, out_scale)   # bf16 [M, out]

x bf16 [M, in] (rows may be strided), weight_fp8 float8_e4m3fn [out, in] contiguous,
input_scale fp32 one element, out_scale fp32 [out] or one element (input_scale times the
weight scales). Same rounding points as kernels/fp8_gemm.py's torch path (input quantized
to E4M3, fp32 sums rounded to bf16, rescaled in fp32 and rounded to bf16); the sums run in
another fixed order, so results match it to the last bf16 bit of the sum, not bit for
bit. A row's result does not depend on the other rows, their number or the threads.

Decode steps are bound by reading weights: the bf16 copy oneDNN multiplies is two bytes a
weight, this kernel reads the artifact's E4M3 byte (csrc/fp8_gemv_cpu.c). Up to
`MAX_ROWS` rows it is faster than oneDNN's bf16 matmul here; beyond, the weight is read
once for all rows either way and oneDNN's AMX tiles win. `available()` says whether the
library is built.
"""

from __future__ import annotations

import ctypes

import torch

from .fp8 import FP8_DTYPE
from .native_build import cached_library

# rows up to which Fp8Linear calls this kernel: measured against oneDNN's bf16 matmul over
# SmolLM2-135M's 120 linear shapes, weights streamed from memory, 1 thread: 1 row 16.1 vs
# 34.1 ms, 4 rows 24.2 vs 33.5, 5 rows 29.9 vs 34.9 (25.9 with the 5-row tile, measured
# against the 4 + 1 split in another run), 6 rows 33.2 vs 34.1 (beyond, the kernel's fp32
# multiply-adds cost more than oneDNN's reads: 8 rows 38.9 vs 33.7)
MAX_ROWS = 5

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


# the loaded library with its functions' signatures set, or None where it cannot build
_library = cached_library("fp8_gemv_cpu", {
        "qserve_fp8_gemv_bf16": ([
            _P, _I64, _I64, _I64, ctypes.c_float, _P, _I64, _P, _I64, _P, _I64, ctypes.c_int,
        ], ctypes.c_int),
})


def available() -> bool:
    """True when the C library is built and loaded (builds it on first call)."""
    return _library() is not None


def fp8_gemv_bf16(x: torch.Tensor, weight_fp8: torch.Tensor,
                  input_scale: torch.Tensor | float, out_scale: torch.Tensor) -> torch.Tensor:
    lib = _library()
    if lib is None:
        raise RuntimeError("the native FP8 linear is not available on this machine (no C "
                           "compiler); the torch path runs instead.")
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu" \
            or x.stride(1) != 1:
        raise ValueError(f"x must be a bf16 CPU matrix with contiguous rows, got "
                         f"{x.dtype} {list(x.shape)} strides {list(x.stride())} on {x.device}.")
    if weight_fp8.dtype != FP8_DTYPE or not weight_fp8.is_contiguous() \
            or weight_fp8.device.type != "cpu":
        raise ValueError(f"weight must be a contiguous float8_e4m3fn CPU tensor, got "
                         f"{weight_fp8.dtype} on {weight_fp8.device}.")
    m, k = x.shape
    n = weight_fp8.shape[0]
    if weight_fp8.shape[1] != k:
        raise ValueError(f"fp8 linear: input has {k} features, weight expects "
                         f"{weight_fp8.shape[1]}.")
    s = out_scale.reshape(-1)
    if s.dtype != torch.float32 or not s.is_contiguous():
        s = s.to(torch.float32).contiguous()
    if s.numel() not in (1, n):
        raise ValueError(f"out_scale has {s.numel()} elements; need 1 or {n}.")
    out = torch.empty(m, n, dtype=torch.bfloat16)
    rc = lib.qserve_fp8_gemv_bf16(x.data_ptr(), m, k, x.stride(0), float(input_scale),
                                  weight_fp8.data_ptr(), n, s.data_ptr(), s.numel(),
                                  out.data_ptr(), n, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("the native FP8 linear could not allocate its input buffer.")
    return out


__all__ = ["MAX_ROWS", "available", "fp8_gemv_bf16"]
