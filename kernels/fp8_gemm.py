"""W8A8 FP8 GEMM with a static per-tensor input scale and per-channel weight scale.

    y[t, o] = (sum_i fp8(x[t, i] / s_in) * w_q[o, i]) * s_in * s_w[o] + bias[o]

Weight-only (W8A16, input_scale None): y[t, o] = (sum_i x[t, i] * w_q[o, i]) * s_w[o] + bias[o],
the same rounding points without the input quantization.

Torch path (CPU): the FP8 weight is held as its exact E4M3 values in the compute dtype
(bf16 represents every E4M3 value), the input is quantized to FP8 and back (exact in
bf16), the matmul runs in the compute dtype with fp32 accumulation, and the two scales
multiply the result. This is the GPU FP8 GEMM's arithmetic up to the rounding of the
matmul output. When the runtime packs the weight (kernels/cpu_linear.py) the matmul runs
on oneDNN's bf16 layout where the CPU has native bf16, else on an fp32 copy (same values
up to the order of the fp32 sums). kernels/triton_fp8_gemm.py is the GPU path.
"""

from __future__ import annotations

import torch

from . import native_fp8
from .fp8 import FP8_DTYPE, quantize_fp8, quantize_fp8_values
from .inductor import CompiledOrEager
from .cpu_linear import packed_linear

# bf16 on CPU: both passes in C (kernels/native_fp8.py) at every size, where it builds: one
# call, far cheaper than the eager rounding's several ops for a decode input. Otherwise,
# the elements of x from which each input quantization is fastest (2 threads, a 576-wide
# input): eager casts up to 4k elements, eager vectorised rounding up to 64k, then
# inductor's fused loop, whose call overhead only pays off at prompt sizes.
_VALUES_PATH_MIN = 4096
_COMPILED_PATH_MIN = 65536


def _rescale(acc: torch.Tensor, out_scale: torch.Tensor) -> torch.Tensor:
    """fp32 product of the accumulator and the scales ([1, out]), rounded once to acc's dtype."""
    return torch.mul(acc, out_scale).to(acc.dtype)


# one fused pass each instead of ~9 (quantize) and 2 (rescale) eager passes; bit-identical
_quantize_values_fused = CompiledOrEager(quantize_fp8_values, "fp8 input quantization",
                                         dynamic=True)
_rescale_fused = CompiledOrEager(_rescale, "fp8 linear rescale", dynamic=True)


def check_fp8_linear_args(x, weight, weight_scale, input_scale) -> None:
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8 linear: input has {x.shape[-1]} features, weight expects "
                         f"{weight.shape[1]}.")
    if weight_scale.numel() not in (1, weight.shape[0]):
        raise ValueError(f"fp8 linear: weight_scale has {weight_scale.numel()} elements; "
                         f"need 1 or {weight.shape[0]} (one per output channel).")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError("fp8 linear: input_scale must be a single (per-tensor) value "
                         "(or None: weight-only).")


def fp8_linear_torch(
    x: torch.Tensor,  # [T, in] compute dtype
    weight: torch.Tensor,  # [out, in] compute dtype holding E4M3 values (or float8_e4m3fn)
    weight_scale: torch.Tensor,  # [out, 1] or [1] fp32
    input_scale: torch.Tensor | None,  # [1] or [] fp32; None: weight-only, x as it is
    bias: torch.Tensor | None = None,  # [out]
    *,
    packed: bool = False,  # weight is in the CPU packed form (kernels/cpu_linear.py)
    out_scale: torch.Tensor | None = None,  # [1, out|1] fp32 = input_scale * weight_scale
) -> torch.Tensor:  # [T, out] compute dtype
    check_fp8_linear_args(x, weight, weight_scale, input_scale)
    dtype = x.dtype
    if weight.dtype == FP8_DTYPE:
        if packed:
            raise ValueError("fp8 linear: a packed weight holds the E4M3 values in bf16.")
        weight = weight.to(dtype)
    if out_scale is None:
        out_scale = weight_scale.reshape(1, -1).float()
        if input_scale is not None:
            out_scale = input_scale.reshape(1, 1).float() * out_scale
    if input_scale is None:  # weight-only: the matmul of x itself
        acc = packed_linear(x, weight) if packed else torch.matmul(x, weight.t())
        if dtype == torch.bfloat16 and x.device.type == "cpu" and native_fp8.available():
            y = native_fp8.rescale_bf16(acc.contiguous(), out_scale)
        else:
            y = _rescale(acc, out_scale)
        return y + bias if bias is not None else y
    if dtype == torch.bfloat16 and x.device.type == "cpu" and native_fp8.available():
        x_q = native_fp8.quantize_values_bf16(x.contiguous(), input_scale)
        acc = packed_linear(x_q, weight) if packed else torch.matmul(x_q, weight.t())
        y = native_fp8.rescale_bf16(acc.contiguous(), out_scale)
        return y + bias if bias is not None else y
    big = x.numel() >= _COMPILED_PATH_MIN
    if big:  # exact E4M3 values in the compute dtype, one fused pass
        x_q = _quantize_values_fused(x, input_scale.float())
    elif x.numel() >= _VALUES_PATH_MIN:
        x_q = quantize_fp8_values(x, input_scale.float())
    else:  # few elements: the two casts cost less than the vectorised rounding's ops
        x_q = quantize_fp8(x, input_scale).to(dtype)
    # [T, out], fp32 accumulation inside the matmul, rounded to the compute dtype
    acc = packed_linear(x_q, weight) if packed else torch.matmul(x_q, weight.t())
    y = (_rescale_fused if big else _rescale)(acc, out_scale)  # [T, out] dtype
    if bias is not None:
        y = y + bias
    return y


def fp8_linear_scaled_mm(
    x: torch.Tensor,  # [T, in] bf16 / fp16 / fp32
    weight: torch.Tensor,  # [out, in] float8_e4m3fn, row-major
    weight_scale: torch.Tensor,  # [out, 1], [out] or [1] fp32
    input_scale: torch.Tensor,  # [1] or [] fp32
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [T, out], dtype of x
    """The same GEMM through torch._scaled_mm (FP8 tensor cores on CUDA compute capability
    >= 8.9; oneDNN on CPU): x quantized with the static input scale, the FP8 product
    accumulated in fp32 with the input scale applied, then the weight scale (per tensor or
    per output channel) multiplied in fp32 and the result rounded once to x's dtype."""
    check_fp8_linear_args(x, weight, weight_scale, input_scale)
    if weight.dtype != FP8_DTYPE or x.dim() != 2:
        raise ValueError(f"fp8 linear (scaled_mm): weight must be float8_e4m3fn [out, in] and "
                         f"x [T, in]; got {weight.dtype} {list(weight.shape)} and "
                         f"{list(x.shape)}.")
    s_in = input_scale.reshape(()).float()
    x_q = quantize_fp8(x, s_in).contiguous()  # [T, in] float8_e4m3fn
    one = torch.ones((), dtype=torch.float32, device=x.device)
    acc = torch._scaled_mm(x_q, weight.t(), scale_a=s_in, scale_b=one,
                           out_dtype=torch.float32)  # [T, out] fp32, times s_in
    y = (acc * weight_scale.reshape(1, -1)).to(x.dtype)
    return y + bias if bias is not None else y


def fp8_linear_reference(x, weight_fp8, weight_scale, input_scale, bias=None) -> torch.Tensor:
    """float64 reference: quantize the input, then exact products and sums."""
    x_q = quantize_fp8(x, input_scale).double() * input_scale.double().reshape(1, 1)
    w = weight_fp8.double() * weight_scale.double().reshape(-1, 1)
    y = x_q @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y
