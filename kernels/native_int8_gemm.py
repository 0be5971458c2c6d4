"""The W8A8 int8 linear on CPU, in C (csrc/int8_gemm_cpu.c): int8 weights, inputs
quantized to int8 per row, exact int32 sums.

    packed = pack_int8_w8a8_weight(weight_int8)         # once, at load
    y = int8_gemm_bf16(x, packed, weight_scale)         # x bf16 [M, in] -> bf16 [M, out]
    ids, values = int8_gemm_argmax_bf16(x, packed, weight_scale)  # greedy tokens of a head

The same bits as kernels/int8_gemm.int8_linear_torch at every number of rows, on every
path (AVX512-VNNI, AVX2, portable) and thread count: the sums are integers. `path()`
says which path the loaded build takes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .c_source import define, read
from .native_build import cached_library
from .native_call import keyword_calls
from .native_fp8_gemv import check_rows, checked_scale

_library = cached_library("int8_gemm_cpu")
PATHS = ("portable", "avx2", "avx512-vnni")  # qserve_int8_gemm_path()'s answers
BAND_N = define(read("int8_gemm_cpu"), "BAND_N")  # channels per band of the layout


def available() -> bool:
    """True when the C library is built and loaded (builds it on first call)."""
    return _library() is not None


@functools.cache
def _path(lib) -> str:
    return PATHS[lib.qserve_int8_gemm_path()]


def path() -> str | None:
    """The path this build takes (one of PATHS), or None without the library."""
    lib = _library()
    return None if lib is None else _path(lib)


class Int8RangeError(ValueError):
    """An int8 weight holds -128, outside the symmetric codes -127..127."""


@dataclass(frozen=True)
class PackedInt8Weight:
    """An [out, in] int8 matrix in the kernel's band layout (csrc/int8_gemm_cpu.c)."""

    data: torch.Tensor  # uint8 [out rounded up to 64 * in rounded up to 4]: w + 128
    out_features: int
    in_features: int


def pack_int8_w8a8_weight(weight_int8: torch.Tensor) -> PackedInt8Weight:
    """[out, in] int8 codes in -127..127 -> bands of 64 channels, each the stream of its
    quads of k: byte (band, quad s, channel c, j) = w[64 band + c, 4 s + j] + 128,
    zero weights in the padding."""
    if weight_int8.dtype != torch.int8 or weight_int8.dim() != 2:
        raise ValueError(f"weight must be an int8 matrix, got {weight_int8.dtype} "
                         f"{list(weight_int8.shape)}.")
    w = weight_int8.detach().cpu()
    if bool((w == -128).any()):
        raise Int8RangeError("the int8 weight holds -128; symmetric int8 codes are "
                             "-127..127 (quantize the checkpoint again).")
    n, k = w.shape
    n64, k4 = -(-n // BAND_N) * BAND_N, -(-k // 4) * 4
    b = torch.full((n64, k4), 128, dtype=torch.int16)
    b[:n, :k] += w.to(torch.int16)
    # [band, channel, quad, j] -> [band, quad, channel, j]
    t = b.to(torch.uint8).view(n64 // BAND_N, BAND_N, k4 // 4, 4).permute(0, 2, 1, 3)
    return PackedInt8Weight(t.contiguous().reshape(-1), n, k)


def _checked(x: torch.Tensor, weight: PackedInt8Weight, weight_scale: torch.Tensor):
    """The library and the scale as contiguous fp32, after the checks every entry makes."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the native int8 linear is not available on this machine (no C "
                           "compiler); the torch path runs instead.")
    if not isinstance(weight, PackedInt8Weight):
        raise ValueError(f"weight must be a PackedInt8Weight (pack_int8_w8a8_weight), got "
                         f"{type(weight).__name__}.")
    check_rows(x, weight.in_features, "int8 linear")
    return lib, checked_scale(weight_scale, weight.out_features, "weight_scale")


def _raise_on(rc: int) -> None:
    if rc != 0:
        raise MemoryError("the native int8 linear could not allocate its input buffers.")


@keyword_calls("int8_gemm_cpu")
def int8_gemm_bf16(x: torch.Tensor, weight: PackedInt8Weight,
                   weight_scale: torch.Tensor) -> torch.Tensor:
    """x [M, in] bf16 (rows may be strided) -> [M, out] bf16; weight_scale [out] or one
    element."""
    lib, s = _checked(x, weight, weight_scale)
    (m, k), n = x.shape, weight.out_features
    out = torch.empty(m, n, dtype=torch.bfloat16)
    _raise_on(lib.qserve_int8_gemm_bf16(
        x=x.data_ptr(), m=m, k=k, x_stride=x.stride(0), packed=weight.data.data_ptr(), n=n,
        scale=s.data_ptr(), scale_len=s.numel(), out=out.data_ptr(), out_stride=n,
        num_threads=torch.get_num_threads()))
    return out


@keyword_calls("int8_gemm_cpu")
def int8_gemm_argmax_bf16(x: torch.Tensor, weight: PackedInt8Weight,
                          weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens of a W8A8 int8 LM head: per row of x [M, in] bf16, (ids int64 [M],
    values fp32 [M]) equal to torch.argmax(y, -1) and y.float().max(-1).values of
    y = int8_gemm_bf16(x, weight, weight_scale) (the lowest id among equal outputs, the
    first NaN), without making y: the kernel keeps a running max per row and thread."""
    lib, s = _checked(x, weight, weight_scale)
    (m, k), n = x.shape, weight.out_features
    ids = torch.empty(m, dtype=torch.int64)  # [M]
    values = torch.empty(m, dtype=torch.float32)  # [M]
    _raise_on(lib.qserve_int8_gemm_argmax_bf16(
        x=x.data_ptr(), m=m, k=k, x_stride=x.stride(0), packed=weight.data.data_ptr(), n=n,
        scale=s.data_ptr(), scale_len=s.numel(), out_ids=ids.data_ptr(),
        out_values=values.data_ptr(), num_threads=torch.get_num_threads()))
    return ids, values


__all__ = ["BAND_N", "Int8RangeError", "PATHS", "PackedInt8Weight", "available",
           "int8_gemm_argmax_bf16", "int8_gemm_bf16", "pack_int8_w8a8_weight", "path"]
