"""kernels/triton_numerics helpers. The in-kernel bf16 rounding (bf16_bits) equals torch's
cast on every kind of fp32 value: exact ties between bf16 neighbours (to even), one ulp
either side, both signs, values that round up to infinity, infinities and NaN. The
split tf32 dot keeps fp32 accuracy (the interpreter computes tf32 dots in fp32, so this
checks that head + remainder is the whole operand; the GPU check measures the rest)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qserve.kernels.triton_numerics import dot_pv, out_bits_view, store_out


@triton.jit
def _to_bf16(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    store_out(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask, True)


def test_bf16_rounding_matches_torch(seed):
    grid = torch.randn(2000).to(torch.bfloat16).float() * torch.logspace(-30, 30, 2000)
    grid = grid.to(torch.bfloat16).float()  # bf16 values spread over the exponent range
    up = grid.view(torch.int32) + 0x10000  # the next bf16 above (away from zero)
    ties = (grid.view(torch.int32) + 0x8000).view(torch.float32)  # exactly halfway
    big = torch.tensor([3.3961e38, 3.4e38, -3.4e38, float("inf"), -float("inf"), 0.0, -0.0])
    x = torch.cat([grid, ties, torch.nextafter(ties, up.view(torch.float32)),
                   torch.nextafter(ties, grid), torch.randn(1000) * 1e3, big])
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    target, is_bits = out_bits_view(y)
    assert is_bits
    _to_bf16[(triton.cdiv(x.numel(), 1024),)](x, target, x.numel(), BLOCK=1024)
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    nan = torch.empty(1, dtype=torch.bfloat16)
    _to_bf16[(1,)](torch.tensor([float("nan")]), out_bits_view(nan)[0], 1, BLOCK=16)
    assert bool(nan.isnan().all())


@triton.jit
def _split_dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(c_ptr + m[:, None] * N + n[None, :], dot_pv(a, b, "tf32x2"))


def test_split_tf32_dot_keeps_fp32_accuracy(seed):
    a = torch.rand(16, 64)  # probabilities: full 24-bit mantissas
    b = torch.randn(64, 32).to(torch.bfloat16).float()  # values exact in tf32
    c = torch.empty(16, 32)
    _split_dot[(1,)](a, b, c, M=16, N=32, K=64)
    ref = a.double() @ b.double()
    assert float(((c.double() - ref).abs() / (a.double() @ b.double().abs())).max()) < 1e-6
