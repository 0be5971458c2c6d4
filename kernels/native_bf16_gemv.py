"""The bf16 linear for a few rows on CPU, in C (csrc/bf16_gemv_cpu.c), for CPUs without
native bf16 matmuls (AVX2), where torch emulates them.

    packed = pack_bf16_weight(weight)               # once, at load: [out, in] bf16
    y = bf16_gemv(x, packed, bias=None)             # x bf16 [M, in], any M -> [M, out]

fp32 products and sums (even and odd k apart, each in k order), one bf16 rounding of the
output: a bf16 matmul's arithmetic in a fixed order, so a row's result does not depend
on the other rows or the threads. It reads the two bytes of each weight once, half the
bytes of the fp32 copy that kernels/cpu_linear.py keeps for many rows (docs/kernels.md
has the measurements). `available()` says whether the library is built, `vectorized()`
whether it runs on AVX2 FMAs (else a portable scalar loop, the same bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .native_build import cached_library
from .native_call import keyword_calls
from .native_fp8_gemv import MAX_ROWS, PAIR_SLOTS, check_rows

TILE_N = 16  # csrc/bf16_gemv_cpu.c's tile width

_library = cached_library("bf16_gemv_cpu")


def available() -> bool:
    """True when the C library is built and loaded (builds it on first call)."""
    return _library() is not None


def vectorized() -> bool:
    """True when the kernel runs on AVX2 FMAs; False: the portable loop or no library."""
    lib = _library()
    return lib is not None and bool(lib.qserve_bf16_gemv_vector())


@dataclass(frozen=True)
class PackedBf16Weight:
    """An [out, in] bf16 matrix as tiles of 16 channels, each [in / 2 k pairs][16 slots][2]
    (csrc layout)."""

    data: torch.Tensor  # bf16 [out rounded up to 16, in rounded up to even] in tile order
    out_features: int
    in_features: int


def pack_bf16_weight(weight: torch.Tensor) -> PackedBf16Weight:
    """[out, in] bf16 -> the kernel's layout (exact: a permutation, zero-padded)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"weight must be a bf16 matrix, got {weight.dtype} "
                         f"{list(weight.shape)}.")
    n, k = weight.shape
    n16, k2 = -(-n // TILE_N) * TILE_N, k + k % 2
    w = torch.zeros(n16, k2, dtype=torch.bfloat16)
    w[:n, :k] = weight.detach().cpu()
    # [tile, channel, pair, 2] -> [tile, pair, slot, 2]
    tiles = w.view(n16 // TILE_N, TILE_N, k2 // 2, 2).transpose(1, 2)[:, :, PAIR_SLOTS]
    return PackedBf16Weight(tiles.contiguous().view(n16, k2), n, k)


@keyword_calls("bf16_gemv_cpu")
def bf16_gemv(x: torch.Tensor, weight: PackedBf16Weight,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] bf16 (rows may be strided, any M: MAX_ROWS per pass over the weights)
    -> [M, out] bf16."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the native bf16 linear is not available on this machine (no C "
                           "compiler); the torch path runs instead.")
    if not isinstance(weight, PackedBf16Weight):
        raise ValueError(f"weight must be a PackedBf16Weight (pack_bf16_weight of the bf16 "
                         f"matrix), got {type(weight).__name__}.")
    check_rows(x, weight.in_features, "bf16 linear")
    (m, k), n = x.shape, weight.out_features
    b = None
    if bias is not None:
        if bias.numel() != n:
            raise ValueError(f"bf16 linear: bias has {bias.numel()} elements; need {n}.")
        b = bias.reshape(-1).to(torch.float32).contiguous()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    rc = lib.qserve_bf16_gemv(x=x.data_ptr(), m=m, k=k, x_stride=x.stride(0),
                              packed=weight.data.data_ptr(), n=n,
                              bias=None if b is None else b.data_ptr(), out=out.data_ptr(),
                              out_stride=n, num_threads=torch.get_num_threads())
    if rc != 0:
        raise MemoryError("the native bf16 linear could not allocate its input buffer.")
    return out


__all__ = ["MAX_ROWS", "PackedBf16Weight", "available", "bf16_gemv", "pack_bf16_weight",
           "vectorized"]
