"""Triton FP8 W8A8 GEMM against the float64 fp8_linear_reference, under the interpreter.

Both sides quantize the input with the same quantize_fp8, so products of E4M3 values are
exact and the error is fp32 accumulation plus the output rounding. Bounds, per element:
  bf16 out: |y - ref| <= 2**-8 |ref| + 1e-5 max|ref|  (half a bf16 ulp; fp32 sums)
  fp32 out: |y - ref| <= 1e-5 max|ref|
Ragged M/N/K (tails of every tile), per-channel and per-tensor weight scales, bias on
and off; the kernel's output NaN-poisoned first. Fresh random inputs (seed printed).
"""

from __future__ import annotations

import pytest
import torch

from qserve.kernels import dispatch
from qserve.kernels.fp8 import quantize_fp8
from qserve.kernels.fp8_gemm import fp8_linear_reference
from qserve.kernels.triton_fp8_gemm import fp8_gemm, fp8_linear_triton


def _problem(m, n, k, per_channel, bias, dtype):
    x = (torch.randn(m, k) * torch.rand(1, k) * 4).to(dtype)  # uneven channel magnitudes
    w = torch.randn(n, k) * torch.rand(n, 1)
    ws = (w.abs().amax(1, keepdim=True) / 448) if per_channel else (w.abs().max() / 448).view(1)
    wq = quantize_fp8(w, ws)  # [n, k] float8_e4m3fn
    s_in = (x.float().abs().max() / 448 * 0.6).view(1)  # some inputs saturate
    b = torch.randn(n).to(dtype) if bias else None
    return x, wq, ws.float(), s_in, b


def _assert_close(y, ref):
    assert not bool(torch.isnan(y).any())
    err = (y.double() - ref).abs()
    top = ref.abs().max()
    if y.dtype == torch.float32:
        bound = 1e-5 * top
    else:
        bound = 2.0 ** -8 * ref.abs() + 1e-5 * top
    worst = float((err - bound).max())
    assert worst <= 0, f"error exceeds the bound by {worst:.3e} (max |ref| {float(top):.3e})"


@pytest.mark.parametrize("m, n, k, per_channel, bias, dtype", [
    (1, 40, 72, True, True, torch.bfloat16),  # decode row
    (37, 100, 130, False, False, torch.float32),
    (20, 64, 64, True, False, torch.bfloat16),  # exact tiles
    (50, 33, 200, True, True, torch.float32),
])
def test_matches_reference(seed, m, n, k, per_channel, bias, dtype):
    x, wq, ws, s_in, b = _problem(m, n, k, per_channel, bias, dtype)
    ref = fp8_linear_reference(x, wq, ws, s_in, b)
    _assert_close(fp8_linear_triton(x, wq, ws, s_in, b), ref)
    poisoned = torch.full((m, n), float("nan"), dtype=dtype)
    y = fp8_gemm(quantize_fp8(x, s_in.view(())), wq, ws, s_in, b, dtype, out=poisoned)
    assert y is poisoned
    _assert_close(y, ref)


def test_bf16_output_is_the_rounded_fp32_output(seed):
    """The in-kernel bf16 rounding (int16 bits, ties to even) equals torch's cast."""
    x, wq, ws, s_in, b = _problem(33, 72, 96, True, True, torch.float32)
    x_q = quantize_fp8(x, s_in.view(()))
    y32 = fp8_gemm(x_q, wq, ws, s_in, b, torch.float32)
    y16 = fp8_gemm(x_q, wq, ws, s_in, b, torch.bfloat16)
    assert torch.equal(y16, y32.to(torch.bfloat16))


def test_dispatch_forced_triton(seed, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    x, wq, ws, s_in, b = _problem(5, 24, 40, True, True, torch.bfloat16)
    _assert_close(dispatch.fp8_linear(x, wq, ws, s_in, b), fp8_linear_reference(x, wq, ws, s_in, b))


@pytest.mark.parametrize("case, match", [
    ("weight_dtype", "float8_e4m3fn"), ("features", "features"), ("scale_n", "one per output"),
    ("in_scale", "per-tensor"), ("x_dim", "flatten"), ("scale_dtype", "float32"),
    ("bias", "bias"),
])
def test_bad_input(case, match):
    x, wq, ws, s_in, b = _problem(3, 16, 32, True, True, torch.bfloat16)
    if case == "weight_dtype":
        wq = wq.to(torch.bfloat16)
    elif case == "features":
        x = x[:, :20]
    elif case == "scale_n":
        ws = ws[:5]
    elif case == "in_scale":
        s_in = torch.ones(2)
    elif case == "x_dim":
        x = x.view(1, 3, 32)
    elif case == "scale_dtype":
        ws = ws.double()
    elif case == "bias":
        b = b[:3]
    with pytest.raises(ValueError, match=match):
        fp8_linear_triton(x, wq, ws, s_in, b)


def test_fp8_linear_layer_runs_the_triton_gemm_when_dispatched(monkeypatch, seed):
    """The runtime's Fp8Linear (what the engine calls) goes through dispatch: with Triton
    chosen it feeds the kernel the FP8 bytes (made once from its exact bf16 values)."""
    from qserve.runtime.layers.fp8_linear import Fp8Linear

    x, wq, ws, s_in, b = _problem(5, 24, 40, True, True, torch.bfloat16)
    layer = Fp8Linear(wq, ws, s_in, b, torch.bfloat16)
    called = []
    real = fp8_linear_triton

    def spy(*args):
        called.append(args[1].dtype)
        return real(*args)

    monkeypatch.setitem(dispatch._resolved, ("fp8_linear", "triton"), spy)
    monkeypatch.setenv("QSERVE_KERNELS", "triton")
    y = layer(x.view(1, 5, 40))  # leading dims are flattened and restored
    assert called == [torch.float8_e4m3fn] and y.shape == (1, 5, 24)
    _assert_close(y[0], fp8_linear_reference(x, wq, ws, s_in, b))
    monkeypatch.setenv("QSERVE_KERNELS", "torch")
    # The torch path rounds three times (accumulator, scaled output, bias add: half a bf16
    # ulp, <= 2**-8 relative, each, against the sizes they round), the kernel once.
    ref = fp8_linear_reference(x, wq, ws, s_in, b)
    size = (ref - b.double()).abs() + b.double().abs()
    err = (layer(x).double() - y[0].double()).abs()
    assert bool((err <= 4 * 2**-8 * size + 1e-6).all()), float((err / size).max())
