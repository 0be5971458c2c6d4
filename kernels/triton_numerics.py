"""Number formats inside the Triton kernels, written so the interpreter computes them exactly.

The Triton interpreter (TRITON_INTERPRET=1, how these kernels are tested on CPU) gets
some casts wrong, measured with triton 3.7.1:
- fp32 -> float8e4nv is wrong for some values, and fp32 -> bf16 truncates instead of
  rounding to nearest even (e.g. 87.996 -> 87.5 instead of 88.0);
- bf16 arithmetic is wrong: kernels load bf16 and convert to fp32 before any math;
- float8e4nv -> fp32 is right for every finite code (only the NaN codes 0x7F/0xFF read as
  ±480; the KV store saturates, so a pool never holds them).
So the kernels never cast down with `.to()`: `e4m3_code` and `bf16_bits` round in integer
and fp32 arithmetic that is exact on both the interpreter and the GPU, and the kernels
store the resulting bits through uint8 / int16 views. The results are bit-identical to
torch's casts (round to nearest even), which is what lets the tests compare bytes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when triton.jit runs kernels in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_kernel_device(what: str, *tensors: torch.Tensor) -> torch.device:
    """All tensors on one device that can run Triton: CUDA, or CPU under the interpreter."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"{what}: tensors are on several devices {sorted(map(str, devices))}; "
                         f"move them to one device.")
    device = devices.pop()
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{what}: the Triton kernel needs CUDA tensors (got {device}); use the "
                         f"torch path (kernels/dispatch.py picks it on CPU) or set "
                         f"TRITON_INTERPRET=1 before importing the kernel to interpret it.")
    return device


def out_bits_view(out: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor the kernel stores into, whether it stores bf16 bits as int16)."""
    if out.dtype == torch.bfloat16:
        return out.view(torch.int16), True
    return out, False


@triton.jit
def bf16_bits(x):
    """fp32 -> the int16 bits of the nearest bf16 (ties to even), as torch's .to(bfloat16)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = tl.where(x != x, bits | 0x400000, rounded)  # NaN stays a (quiet) NaN
    return (rounded >> 16).to(tl.int16)


@triton.jit
def store_out(ptr, x, mask, OUT_BF16: tl.constexpr):
    """Store fp32 x into an output of the kernel's dtype (bf16 via its rounded bits)."""
    if OUT_BF16:
        tl.store(ptr, bf16_bits(x), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_f32(ptr, mask, FP8: tl.constexpr):
    """Load pool elements as fp32: FP8 pools are passed as their uint8 bytes."""
    if FP8:
        raw = tl.load(ptr, mask=mask, other=0)
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def e4m3_code(y):
    """fp32 y (already x / scale) -> uint8 E4M3 code of fp8(clamp(y, -448, 448)).

    Exactly kernels/fp8.quantize_fp8's cast: saturating, round to nearest even, sign kept
    on zero and NaN. Normal range (|y| >= 2**-6): round the fp32 mantissa to 3 bits in
    integer arithmetic (a carry moves into the exponent, as it should), then rebias the
    exponent from 127 to 7. Subnormal range: the grid step is 2**-9, so the code is
    round_half_even(|y| * 512), computed with floor and an exact remainder.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    a = tl.minimum(tl.abs(y), 448.0)
    a = tl.where(y != y, 0.0, a)  # NaN: code set below; keep the arithmetic finite
    abits = a.to(tl.int32, bitcast=True)
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    t = a * 512.0
    f = tl.floor(t)
    rem = t - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    sub = (f + tl.where((rem > 0.5) | ((rem == 0.5) & odd), 1.0, 0.0)).to(tl.int32)
    code = tl.where(a >= 0.015625, normal, sub)
    code = tl.where(y != y, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap), with tanh(x) = 1 - 2 / (exp(2x) + 1) (saturates cleanly)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


# p @ v with bf16/fp16 q: "tf32x2" (split in two tf32 dots, fp32 accuracy) or "tf32"
# (one dot; p rounded to tf32, ~2**-11 relative per probability; half the tensor-core
# work of p @ v). The GPU check times both on the decode goal case.
PV_TF32_MODE = "tf32x2"


def dot_precisions(q_dtype: torch.dtype) -> tuple[str, str]:
    """(q @ k, p @ v) precisions of the attention kernels for a q dtype."""
    if q_dtype == torch.float32:
        return "ieee", "ieee"
    return "tf32", PV_TF32_MODE  # q @ k: bf16/fp16 q and K values are exact in tf32


@triton.jit
def dot_pv(a, b, PRECISION: tl.constexpr):
    """a @ b where b is exact in tf32 (E4M3, bf16, fp16 values).

    "ieee": one exact-fp32 dot. "tf32": one tf32 tensor-core dot (a rounded to tf32).
    "tf32x2": a is split into its tf32 head (low 13 mantissa bits cleared) and the exact
    fp32 remainder, two tf32 dots; the product keeps ~21 bits of a instead of 11.
    """
    if PRECISION == "tf32x2":
        head = (a.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        return (tl.dot(head, b, input_precision="tf32")
                + tl.dot(a - head, b, input_precision="tf32"))
    else:
        return tl.dot(a, b, input_precision=PRECISION)
