"""W8A8 int8 linear in torch: int8 weights with one scale per output channel, inputs
quantized to int8 per row at run time, exact int32 sums (the reference of the C kernel,
kernels/native_int8_gemm.py, and the path wherever that does not run).

    q, s = quantize_rows_int8(x)             # x [T, in] -> int8 [T, in], fp32 [T, 1]
    y = int8_linear_torch(x, w_int8, w_scale)    # [T, out] in x's dtype

    s[t]    = amax_i |x[t, i]| / 127 (fp32); a row of zeros keeps s = 0 and codes 0;
              a row holding inf or NaN gets s = NaN (its outputs are NaN)
    q[t, i] = clamp(round_half_even(x[t, i] / s[t]), -127, 127)
    y[t, o] = fp32(sum_i q[t, i] * w[o, i]) * (s[t] * w_scale[o])  rounded once to x's dtype

compressed-tensors' W8A8 int8 (`type: int`, weights `strategy: channel`, inputs
`strategy: token, dynamic: true`, symmetric). The sums are integers, so any order of
adding them gives the same result: torch's integer matmul, the C kernel's blocks and
threads, one row or a thousand.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] (any float dtype) -> (codes int8 [T, in], scales fp32 [T, 1])."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)  # [T, 1]
    finite = torch.isfinite(amax)
    s = amax / INT8_MAX
    ok = finite & (s > 0)
    q = torch.where(ok, xf / torch.where(ok, s, 1.0), 0.0).round().clamp(-INT8_MAX, INT8_MAX)
    s = torch.where(finite, s, float("nan"))
    return q.to(torch.int8), s


def int_matmul(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q [T, in] int8 @ w [out, in].T int8 -> [T, out] int32, exactly, as an fp64 matmul
    (every sum is an integer below 2^53). Not torch._int_mm: on a CPU without VNNI its
    oneDNN kernel adds pairs of u8 x s8 products in int16 and saturates (measured under
    QSERVE_CPU_CLASS=avx2: sums off by thousands)."""
    return torch.matmul(q.double(), w.t().double()).to(torch.int32)


def int8_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] float, weight [out, in] int8 (-127..127), weight_scale [out] or [1] (any
    shape with that many elements) -> [T, out] in x's dtype (+ bias, added after the
    rounding as the FP8 linear adds it)."""
    q, s = quantize_rows_int8(x)
    acc = int_matmul(q, weight.to(q.device))  # [T, out] int32
    y = (acc.float() * (s * weight_scale.float().reshape(1, -1).to(s.device))).to(x.dtype)
    return y + bias if bias is not None else y


__all__ = ["INT8_MAX", "int8_linear_torch", "int_matmul", "quantize_rows_int8"]
