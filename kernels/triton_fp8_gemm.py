"""W8A8 FP8 GEMM in Triton: static per-tensor input scale, per-channel weight scale.

    y[t, o] = (sum_i x_q[t, i] * w_q[o, i]) * s_in * s_w[o] + bias[o]

Same math as kernels/fp8_gemm.fp8_linear_torch, tested against its float64
fp8_linear_reference. The wrapper quantizes the input with the one `quantize_fp8`
(torch; the interpreter's fp32 -> fp8 cast is wrong for some values, see
triton_numerics.py), so the kernel receives E4M3 bytes for both operands; tl.dot
multiplies them on FP8 tensor cores with fp32 accumulation; the epilogue applies both
scales and the bias in fp32 and rounds once to the output dtype (bf16 by default).

Tiles: GROUP_M-swizzled program order for L2 reuse of weight tiles; the autotuner picks
among CONFIGS per (M bucket, N, K). Under the interpreter there is one small config
(several configs fail there, and speed does not matter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import FP8_DTYPE, quantize_fp8
from .fp8_gemm import check_fp8_linear_args
from .triton_numerics import check_kernel_device, interpreting, out_bits_view, store_out


def _configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4)]
    shapes = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
        (128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 64, 4, 4),
        (64, 128, 128, 4, 4), (64, 256, 128, 8, 3), (32, 128, 128, 4, 4),
        (16, 128, 128, 4, 5), (16, 64, 256, 4, 4), (64, 64, 128, 4, 5),
        (16, 32, 256, 2, 4), (16, 32, 128, 2, 6),  # few rows: more programs over N
    ]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w,
                          num_stages=s) for m, n, k, w, s in shapes]


@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K"])
@triton.jit
def _fp8_gemm_kernel(
    a_ptr, stride_am,  # x_q [M, K] fp8, row-major
    b_ptr, stride_bn,  # w_q [N, K] fp8, row-major (each output channel's K contiguous)
    c_ptr, stride_cm,  # y [M, N] (int16 bits when OUT_BF16)
    w_scale_ptr, in_scale_ptr, bias_ptr,  # [N] or [1] fp32, [1] fp32, [N]
    M, N, K, M_BUCKET,
    PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr = 8,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
    pid_n = (pid % (GROUP_M * grid_n)) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]  # [BLOCK_M, BLOCK_K]
    b = b_ptr + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = rk < K - k0
        a_t = tl.load(a, mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
        b_t = tl.load(b, mask=kmask[:, None] & (rn < N)[None, :], other=0.0)
        acc = tl.dot(a_t, b_t, acc)
        a += BLOCK_K
        b += BLOCK_K

    nmask = rn < N
    if PER_CHANNEL:
        w_scale = tl.load(w_scale_ptr + rn, mask=nmask, other=0.0)
    else:
        w_scale = tl.load(w_scale_ptr + rn * 0)
    y = acc * (w_scale * tl.load(in_scale_ptr))[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    store_out(c, y, (rm < M)[:, None] & nmask[None, :], OUT_BF16)


def fp8_gemm(x_q: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             input_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel alone on validated, already-quantized x_q [M, K] fp8 -> [M, N] out_dtype
    (benchmarks time this; `out`, if given, must be a row-major [M, N] out_dtype tensor)."""
    m, k = x_q.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out
    out_k, out_bf16 = out_bits_view(out)
    ws = weight_scale.reshape(-1)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _fp8_gemm_kernel[grid](
        x_q, x_q.stride(0), weight, weight.stride(0), out_k, out.stride(0), ws,
        input_scale.reshape(1), bias if bias is not None else ws, m, n, k,
        min(triton.next_power_of_2(m), 4096), PER_CHANNEL=ws.numel() > 1,
        HAS_BIAS=bias is not None, OUT_BF16=out_bf16)
    return out


def fp8_linear_triton(
    x: torch.Tensor,  # [T, in] bf16 / fp16 / fp32
    weight: torch.Tensor,  # [out, in] float8_e4m3fn, row-major
    weight_scale: torch.Tensor,  # [out, 1], [out] or [1] fp32
    input_scale: torch.Tensor,  # [1] or [] fp32
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [T, out], dtype of x
    check_fp8_linear_args(x, weight, weight_scale, input_scale)
    check_kernel_device("fp8_linear", x, weight, weight_scale, input_scale, bias)
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"fp8 linear: x must be [T, in] and weight [out, in], got "
                         f"{list(x.shape)} and {list(weight.shape)}; flatten leading dims.")
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 linear (Triton): weight must be float8_e4m3fn, got {weight.dtype}; "
                         f"keep the artifact's FP8 weight instead of upcasting it.")
    if weight.stride(1) != 1:
        raise ValueError(f"fp8 linear: weight must be row-major [out, in] (strides "
                         f"{weight.stride()}); pass weight.contiguous().")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8 linear: x must be bf16, fp16 or fp32, got {x.dtype}.")
    for name, s in (("weight_scale", weight_scale), ("input_scale", input_scale)):
        if s.dtype != torch.float32:
            raise ValueError(f"fp8 linear: {name} must be float32, got {s.dtype}.")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"fp8 linear: bias must be [{weight.shape[0]}], got {list(bias.shape)}.")
    x_q = quantize_fp8(x, input_scale.reshape(())).contiguous()  # [T, in] fp8
    return fp8_gemm(x_q, weight, weight_scale.contiguous(), input_scale, bias, x.dtype)
