"""The W8A8 FP8 linear for a few rows on CPU, in C, reading one byte per weight.

    packed = pack_fp8_weight(weight_fp8)                         # once, at load
    y = fp8_gemv_bf16(x, packed, input_scale, out_scale)         # bf16 [M, out]
    y = fp8_gemv_wonly_bf16(x, packed, weight_scale)             # weight-only (W8A16)
    packed = pack_int8_weight(weight_int8)                       # int8 codes, W8A16 int
    y = fp8_gemv_wonly_bf16(x, packed, weight_scale)             # same call
    ids, values = fp8_gemv_argmax_bf16(x, packed, out_scale)     # greedy tokens of a head

x bf16 [M, in] (rows may be strided, any M), weight_fp8 float8_e4m3fn [out, in],
input_scale fp32 one element, out_scale fp32 [out] or one element (input_scale times the
weight scales). Same rounding points as kernels/fp8_gemm.py's torch path (input quantized
to E4M3, fp32 sums rounded to bf16, rescaled in fp32 and rounded to bf16); the sums run in
another fixed order, so results match it to the last bf16 bit of the sum, not bit for
bit. A row's result does not depend on the other rows, their number or the threads.

Decode steps are bound by reading weights: the bf16 copy oneDNN multiplies is two bytes a
weight; this kernel reads the artifact's E4M3 byte, decodes it to bf16 in L1 and
multiplies with AMX tiles: 4 rows cost ~1.15x one row, 16 rows ~1.6x
(csrc/fp8_gemv_cpu.c). Without AMX, on AVX512-BF16 (with VBMI), it decodes the same way
and multiplies with vdpbf16ps in the same sum order (same bits); with AVX2 and FMA
only, the weight keeps the pair layout with its channels permuted instead of its bytes
(LAYOUT_PAIRS), decoded by integer shifts and multiplied with fp32 FMAs in the same order
(same bits again). The weight is kept in the tile layout the loaded build reads
(`PackedFp8Weight`, same size as the E4M3 matrix up to padding to 16 x 32).
`available()` says whether the library is built, `path()` which of PATHS it takes,
`vectorized()` whether that is AMX, AVX512-BF16 or AVX2 (elsewhere a portable scalar loop
gives the same bits, slowly).

Int8 weights (W8A16 int: -127..127, symmetric) run through the same kernel and layout:
every int8 value is exact in bf16, so they decode by the same byte tables (as sign and
magnitude) or, on the AVX2 path, by widening loads (two's complement); the packed weight
records its codes and the weight-only call picks the C entry for them.

`fp8_gemv_argmax_bf16` is the LM head's greedy step: per row, the channel (vocabulary id)
of the largest output and that output, as torch.argmax finds them in what the static or
weight-only call returns, from the same sums, without making the [M, out] outputs.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from .c_source import define, read
from .fp8 import FP8_DTYPE
from .native_build import cached_library
from .native_call import keyword_calls

# rows one pass over the weights serves on the AMX and portable paths (one AMX A tile; the
# AVX512-BF16 path serves 64, the AVX2 path any number: pass_rows()). A call takes any
# number of rows: beyond a pass it reads the weights again per pass;
# `python -m qserve.runtime.benchmark.linear` compares it with the matmuls it replaces.
MAX_ROWS = 16
TILE_N, TILE_K, BAND_TILES = 16, 32, 4  # csrc/fp8_gemv_cpu.c's layout

# the loaded library with its functions' signatures set, or None where it cannot build
_library = cached_library("fp8_gemv_cpu")
PATHS = ("portable", "avx2", "avx512-bf16", "amx")  # qserve_fp8_gemv_path()'s answers
LAYOUT_TILE, LAYOUT_PAIRS = 0, 1  # csrc/fp8_gemv_cpu.c's tile layouts
# PackedFp8Weight.codes -> csrc/fp8_gemv_cpu.c's number for them (its argmax entry's `codes`)
CODES = {"e4m3": define(read("fp8_gemv_cpu"), "CODES_E4M3"),
         "int8": define(read("fp8_gemv_cpu"), "CODES_INT8")}


def available() -> bool:
    """True when the C library is built and loaded (builds it on first call)."""
    return _library() is not None


def path() -> str | None:
    """The kernel path this build and CPU take (one of PATHS), or None without the library."""
    lib = _library()
    return None if lib is None else PATHS[lib.qserve_fp8_gemv_path()]


def pass_rows() -> int:
    """Rows one pass over the weights serves: MAX_ROWS (one AMX A tile; also the portable
    build), 64 on the AVX512-BF16 path (its row loop reuses each decoded weight block
    across them; above that oneDNN's matmul is faster), or any number on the AVX2 path.
    Every build takes any number of rows in a call, each row with the sums it gets alone
    (batch invariance); beyond pass_rows() it reads the weights once more per pass, where
    a matmul may be faster (runtime/layers/packing.py's c_kernel_rows decides). MAX_ROWS
    without the library."""
    lib = _library()
    return MAX_ROWS if lib is None else _pass_rows(lib)


@functools.cache
def _pass_rows(lib: ctypes.CDLL) -> int:
    """The loaded build's rows per pass, asked once per library (not on every call)."""
    return int(lib.qserve_fp8_gemv_pass_rows())


def vectorized() -> bool:
    """True when the kernel multiplies with vector instructions (AMX, AVX512-BF16 or
    AVX2 + FMA: fast for a few rows); False: the portable scalar loop (slower than a
    matmul) or no library."""
    return path() not in (None, "portable")


@dataclass(frozen=True)
class PackedFp8Weight:
    """An [out, in] E4M3 (or int8) matrix in the kernel's tile layout (csrc/fp8_gemv_cpu.c)."""

    data: torch.Tensor  # uint8 [out rounded up to 16 * in rounded up to 32]
    out_features: int
    in_features: int
    layout: int = LAYOUT_TILE
    codes: str = "e4m3"  # "e4m3" | "int8": what each byte holds


def _byte_order() -> torch.Tensor:
    """Within every 64 bytes: packed byte p holds word order[p] of the natural tile (so
    the kernel's byte interleaves put the bf16 words in order)."""
    order = []
    for p in range(64):
        lane, r = divmod(p, 16)
        order.append(8 * lane + r if r < 8 else 32 + 8 * lane + r - 8)
    return torch.tensor(order)


# LAYOUT_PAIRS: the channel in each slot of a k pair's 16 (the order the AVX2 kernels'
# horizontal adds return; the bf16 linear's tiles use it too); an involution
PAIR_SLOTS = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15])
# LAYOUT_PAIRS: packed byte p of a k pair's 32 holds byte PAIR_BYTES[p] of its slots'
# (channel, k parity) order, so that one 32-byte load decodes to the pair's four weight
# vectors without byte shuffles (csrc/fp8_gemv_cpu.c, decode32_avx2)
PAIR_BYTES = torch.tensor([8 * (p % 4) + p // 4 for p in range(32)])


def pack_fp8_weight(weight_fp8: torch.Tensor, layout: int | None = None) -> PackedFp8Weight:
    """[out, in] float8_e4m3fn -> the kernel's layout (exact: a permutation of the bytes,
    zero-padded). layout: LAYOUT_TILE or LAYOUT_PAIRS; default, the one the loaded
    library reads."""
    if weight_fp8.dtype != FP8_DTYPE or weight_fp8.dim() != 2:
        raise ValueError(f"weight must be a float8_e4m3fn matrix, got {weight_fp8.dtype} "
                         f"{list(weight_fp8.shape)}.")
    layout = _layout() if layout is None else layout
    n, k = weight_fp8.shape
    b = _padded(weight_fp8.detach().cpu().view(torch.uint8))
    if layout == LAYOUT_PAIRS and bool(((b & 0x7F) == 0x7F).any()):
        raise ValueError("the FP8 weight holds NaN bytes (0x7F / 0xFF), which the AVX2 "
                         "kernel does not decode; quantize the checkpoint again (FP8 "
                         "quantization saturates at +-448 and never writes NaN).")
    return PackedFp8Weight(_tiled(b, layout), n, k, layout)


class Int8RangeError(ValueError):
    """An int8 weight holds -128, which the kernel's codes (-127..127) cannot express."""


def pack_int8_weight(weight_int8: torch.Tensor, layout: int | None = None) -> PackedFp8Weight:
    """[out, in] int8 codes in -127..127 -> the kernel's layout: each byte sign and
    magnitude (LAYOUT_TILE, decoded by the byte tables) or two's complement (LAYOUT_PAIRS,
    decoded by widening loads, without PAIR_BYTES), zero-padded as pack_fp8_weight does."""
    if weight_int8.dtype != torch.int8 or weight_int8.dim() != 2:
        raise ValueError(f"weight must be an int8 matrix, got {weight_int8.dtype} "
                         f"{list(weight_int8.shape)}.")
    w = weight_int8.detach().cpu()
    if bool((w == -128).any()):
        raise Int8RangeError("the int8 weight holds -128; symmetric int8 codes are "
                             "-127..127 (quantize the checkpoint again).")
    layout = _layout() if layout is None else layout
    if layout == LAYOUT_PAIRS:
        b = w.view(torch.uint8)
    else:
        b = w.abs().to(torch.uint8) | ((w < 0).to(torch.uint8) << 7)
    n, k = w.shape
    return PackedFp8Weight(_tiled(_padded(b), layout, pair_bytes=False), n, k, layout, "int8")


def _layout() -> int:
    """The tile layout the loaded library reads (LAYOUT_TILE without one)."""
    lib = _library()
    return LAYOUT_TILE if lib is None else lib.qserve_fp8_gemv_layout()


def _padded(b: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k] -> uint8 [n16, k32], zero-padded to whole tiles."""
    n, k = b.shape
    out = torch.zeros(-(-n // TILE_N) * TILE_N, -(-k // TILE_K) * TILE_K, dtype=torch.uint8)
    out[:n, :k] = b
    return out


def _tiled(b: torch.Tensor, layout: int, pair_bytes: bool = True) -> torch.Tensor:
    """uint8 [n16, k32] weight bytes -> the tile layout's stream (a permutation).
    pair_bytes False: LAYOUT_PAIRS keeps each k pair's 32 bytes in slot order (int8 codes,
    decoded by widening loads)."""
    n16, k32 = b.shape
    tiles, blocks = n16 // TILE_N, k32 // TILE_K
    # [tile, channel, block, pair, 2] -> [tile, block, pair, channel, 2]: tdpbf16ps's B
    t = b.view(tiles, TILE_N, blocks, TILE_K // 2, 2).permute(0, 2, 3, 1, 4)
    if layout == LAYOUT_TILE:  # and the decoder's byte order in every 64 bytes
        t = t.reshape(tiles, blocks, -1, 64)[..., _byte_order()]
    else:  # channel c in slot c with bits 1 and 2 swapped (an involution), and within
        # each k pair's 32 bytes decode32_avx2's order: byte 4 l + j is byte 8 j + l
        t = t[:, :, :, PAIR_SLOTS].reshape(tiles, blocks, TILE_K // 2, 32)
        if pair_bytes:
            t = t[..., PAIR_BYTES]
    t = t.reshape(tiles, blocks, -1)
    bands = [t[i:i + BAND_TILES].transpose(0, 1).reshape(-1)  # [block, tile in band, 512]
             for i in range(0, tiles, BAND_TILES)]
    return torch.cat(bands).contiguous()


def check_rows(x: torch.Tensor, in_features: int, what: str) -> None:
    """The checks every C linear makes of its input x [M, in]: bf16 CPU rows with unit
    stride, `in_features` wide. what: "fp8 linear"."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu" \
            or x.stride(1) != 1:
        raise ValueError(f"x must be a bf16 CPU matrix with contiguous rows, got "
                         f"{x.dtype} {list(x.shape)} strides {list(x.stride())} on {x.device}.")
    k = x.shape[1]
    if in_features != k:
        raise ValueError(f"{what}: input has {k} features, weight expects {in_features}.")


def checked_scale(scale: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """A C linear's scale ([n] or one element, any shape) as contiguous fp32, or ValueError
    naming `what` ("out_scale", "weight_scale")."""
    s = scale.reshape(-1)
    if s.dtype != torch.float32 or not s.is_contiguous():
        s = s.to(torch.float32).contiguous()
    if s.numel() not in (1, n):
        raise ValueError(f"{what} has {s.numel()} elements; need 1 or {n}.")
    return s


def _checked(x: torch.Tensor, weight: PackedFp8Weight, scale: torch.Tensor, what: str,
             codes: tuple[str, ...] = ("e4m3",)
             ) -> tuple[ctypes.CDLL, torch.Tensor, torch.Tensor]:
    """The library, the scale as contiguous fp32 and the output buffer, after the checks.
    codes: the weight codes the calling entry takes."""
    lib, s = _checked_scale(x, weight, scale, what, codes)
    return lib, s, torch.empty(x.shape[0], weight.out_features, dtype=torch.bfloat16)


def _checked_scale(x: torch.Tensor, weight: PackedFp8Weight, scale: torch.Tensor, what: str,
                   codes: tuple[str, ...]) -> tuple[ctypes.CDLL, torch.Tensor]:
    """_checked without the output buffer: the library and the scale as contiguous fp32."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the native FP8 linear is not available on this machine (no C "
                           "compiler); the torch path runs instead.")
    if not isinstance(weight, PackedFp8Weight):
        raise ValueError(f"weight must be a PackedFp8Weight (pack_fp8_weight of the "
                         f"float8_e4m3fn matrix), got {type(weight).__name__}.")
    if weight.codes not in codes:
        raise ValueError(f"{weight.codes} weights run weight-only: call fp8_gemv_wonly_bf16.")
    if weight.layout != lib.qserve_fp8_gemv_layout():
        raise ValueError("the weight was packed for another build of the FP8 linear (tile "
                         "layout); pack it again with pack_fp8_weight.")
    check_rows(x, weight.in_features, "fp8 linear")
    return lib, checked_scale(scale, weight.out_features, what)


def _raise_on(rc: int) -> None:
    if rc != 0:
        raise MemoryError("the native FP8 linear could not allocate its input buffer.")


@keyword_calls("fp8_gemv_cpu")
def fp8_gemv_bf16(x: torch.Tensor, weight: PackedFp8Weight,
                  input_scale: torch.Tensor | float, out_scale: torch.Tensor) -> torch.Tensor:
    lib, s, out = _checked(x, weight, out_scale, "out_scale")
    (m, k), n = x.shape, weight.out_features
    _raise_on(lib.qserve_fp8_gemv_bf16(
        x=x.data_ptr(), m=m, k=k, x_stride=x.stride(0), input_scale=float(input_scale),
        packed=weight.data.data_ptr(), n=n, scale=s.data_ptr(), scale_len=s.numel(),
        out=out.data_ptr(), out_stride=n, num_threads=torch.get_num_threads()))
    return out


@keyword_calls("fp8_gemv_cpu")
def fp8_gemv_dynamic_bf16(x: torch.Tensor, weight: PackedFp8Weight,
                          weight_scale: torch.Tensor) -> torch.Tensor:
    """The input scale from this call's rows: max(amax(x), 1e-12) / 448 in fp32; the same
    as fp8_gemv_bf16 with that scale and out_scale = weight_scale * it (fp32), with no
    torch op for the amax."""
    lib, s, out = _checked(x, weight, weight_scale, "weight_scale")
    (m, k), n = x.shape, weight.out_features
    _raise_on(lib.qserve_fp8_gemv_dynamic_bf16(
        x=x.data_ptr(), m=m, k=k, x_stride=x.stride(0), packed=weight.data.data_ptr(), n=n,
        weight_scale=s.data_ptr(), scale_len=s.numel(), out=out.data_ptr(), out_stride=n,
        num_threads=torch.get_num_threads()))
    return out


@keyword_calls("fp8_gemv_cpu")
def fp8_gemv_wonly_bf16(x: torch.Tensor, weight: PackedFp8Weight,
                        weight_scale: torch.Tensor) -> torch.Tensor:
    """Weight-only FP8 (W8A16): the bf16 input as it is times the E4M3 weight, fp32 sums
    rounded to bf16, times weight_scale ([out] or one element) rounded to bf16: the
    static entry's rounding points without the input quantization. Int8 weights
    (pack_int8_weight) take the int8 entry: the same sums of exact products."""
    lib, s, out = _checked(x, weight, weight_scale, "weight_scale", tuple(WONLY_ENTRY))
    (m, k), n = x.shape, weight.out_features
    if weight.codes == "int8":
        rc = lib.qserve_int8_gemv_wonly_bf16(
            x=x.data_ptr(), m=m, k=k, x_stride=x.stride(0), packed=weight.data.data_ptr(), n=n,
            scale=s.data_ptr(), scale_len=s.numel(), out=out.data_ptr(), out_stride=n,
            num_threads=torch.get_num_threads())
    else:
        rc = lib.qserve_fp8_gemv_wonly_bf16(
            x=x.data_ptr(), m=m, k=k, x_stride=x.stride(0), packed=weight.data.data_ptr(), n=n,
            scale=s.data_ptr(), scale_len=s.numel(), out=out.data_ptr(), out_stride=n,
            num_threads=torch.get_num_threads())
    _raise_on(rc)
    return out


# the weight-only C entry for each kind of weight codes (also the step program's)
WONLY_ENTRY = {"e4m3": "qserve_fp8_gemv_wonly_bf16", "int8": "qserve_int8_gemv_wonly_bf16"}


@keyword_calls("fp8_gemv_cpu")
def fp8_gemv_argmax_bf16(x: torch.Tensor, weight: PackedFp8Weight, out_scale: torch.Tensor,
                         input_scale: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens of an LM head: per row of x [M, in] bf16, the channel of the largest
    output and that output, (ids int64 [M], values fp32 [M]), equal to torch.argmax(y, -1)
    and y.float().max(-1).values of y = fp8_gemv_bf16(x, weight, input_scale, out_scale)
    (input_scale > 0: E4M3 weights, static input scale) or fp8_gemv_wonly_bf16(x, weight,
    out_scale) (input_scale 0: weight-only, E4M3 or int8 codes): the lowest id among equal
    outputs, the first NaN above every number. The [M, out] outputs are never made: the C
    kernel keeps a running max per row and thread while it computes them. out_scale: [out]
    or one element, fp32 (input scale times the weight scales; weight-only: the weight
    scales)."""
    takes = ("e4m3",) if input_scale > 0 else tuple(WONLY_ENTRY)
    lib, s = _checked_scale(x, weight, out_scale, "out_scale", takes)
    m, k = x.shape
    ids = torch.empty(m, dtype=torch.int64)  # [M]
    values = torch.empty(m, dtype=torch.float32)  # [M]
    _raise_on(lib.qserve_fp8_gemv_argmax_bf16(
        x=x.data_ptr(), m=m, k=k, x_stride=x.stride(0), input_scale=float(input_scale),
        packed=weight.data.data_ptr(), codes=CODES[weight.codes], n=weight.out_features,
        scale=s.data_ptr(), scale_len=s.numel(), out_ids=ids.data_ptr(),
        out_values=values.data_ptr(), num_threads=torch.get_num_threads()))
    return ids, values


__all__ = ["CODES", "Int8RangeError", "LAYOUT_PAIRS", "LAYOUT_TILE", "MAX_ROWS", "PAIR_SLOTS",
           "PATHS", "WONLY_ENTRY", "PackedFp8Weight", "available", "check_rows", "checked_scale",
           "fp8_gemv_argmax_bf16", "fp8_gemv_bf16", "fp8_gemv_dynamic_bf16",
           "fp8_gemv_wonly_bf16", "pack_fp8_weight", "pass_rows", "pack_int8_weight", "path",
           "vectorized"]
