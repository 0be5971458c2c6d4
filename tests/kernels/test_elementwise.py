"""The C decode path's elementwise steps (csrc/elementwise_cpu.c) against float64 and torch:
the gated activation out = bf16(bf16(act(g)) * u) for SiLU and GELU-tanh, over ordinary
values and the ends of the fp32 range."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qserve.kernels.native_elementwise import _library as _elementwise

pytestmark = pytest.mark.skipif(_elementwise() is None, reason="no C compiler")

ACTS = {0: lambda g: F.silu(g), 1: lambda g: F.gelu(g, approximate="tanh")}


def _act64(g: torch.Tensor, act: int) -> torch.Tensor:  # float64 oracle
    if act == 0:
        return g / (1.0 + torch.exp(-g))
    inner = math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)
    # = 0.5 g (1 + tanh(inner)), whose 1 + tanh cancels even in float64 below g ~ -6
    return g / (1.0 + torch.exp(-2.0 * inner))


def _act_mul(gu: torch.Tensor, act: int, threads: int = 1) -> torch.Tensor:
    """[rows, 2n] bf16 -> [rows, n]"""
    rows, n = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    _elementwise().qserve_act_mul_bf16(gu.data_ptr(), rows, n, act, out.data_ptr(), threads)
    return out


@pytest.mark.parametrize("act", [0, 1])
def test_gated_activation_gives_the_same_bits_on_any_threads(act, seed):
    """Rows split over threads (above the size one thread keeps) change no output."""
    gu = (torch.randn(37, 2 * 1536) * 3).bfloat16()  # 37 x 1536 outputs: split
    one = _act_mul(gu, act)
    assert torch.equal(_act_mul(gu, act, threads=2), one)
    assert torch.equal(_act_mul(gu, act, threads=5), one)
    assert torch.equal(_act_mul(gu[:3], act, threads=2), one[:3])  # below: one thread


def _steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 steps of the larger magnitude (0 where equal)."""
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-30)
    return (a.float() - b.float()).abs() / (scale * 2**-7)


@pytest.mark.parametrize("act", [0, 1])
def test_gated_activation_within_one_bf16_step_of_float64_and_torch(act, seed):
    n = 1536
    g = torch.randn(5, n) * torch.logspace(-3, 1.5, n)
    g[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.9, -87.9, 200.0, -200.0])
    u = torch.randn(5, n)
    gu = torch.cat([g, u], 1).bfloat16()
    got = _act_mul(gu, act)
    gb, ub = gu[:, :n], gu[:, n:]
    # the kernel's rounding points, with the activation in float64
    want = (_act64(gb.double(), act).to(torch.bfloat16).float() * ub.float()).to(torch.bfloat16)
    torch_way = (ACTS[act](gb.float()).to(torch.bfloat16).float() * ub.float()).to(torch.bfloat16)
    assert got.shape == (5, n) and bool(torch.isfinite(got.float()).all())
    # below g ~ -3 torch's GELU forms 1 + tanh(y) < 1e-3 from fp32 values near -1: few
    # significant bits survive there, so compare with torch where it is accurate
    torch_ok = gb.float() > -3 if act == 1 else torch.ones_like(gb, dtype=torch.bool)
    for ref, where in ((want, torch.ones_like(torch_ok)), (torch_way, torch_ok)):
        steps = _steps(got, ref)[where]
        # one bf16 step of the activation can become one step (plus rounding) of the product
        assert float(steps.max()) <= 2.01, float(steps.max())
        assert float((steps > 0).float().mean()) < 0.02


@pytest.mark.parametrize("act", [0, 1])
def test_activation_limits(act):
    """Large |g|: act(g) -> g (positive) and -> -0 or a tiny negative (negative), no NaN."""
    g = torch.tensor([1e4, 3e38, -1e4, -3e38, 0.0], dtype=torch.float32)
    gu = torch.cat([g, torch.ones(5)]).reshape(1, 10).bfloat16()
    got = _act_mul(gu, act).float()[0]
    assert got[0] == gu[0, 0].float() and got[1] == gu[0, 1].float()
    assert abs(float(got[2])) < 1e-30 and abs(float(got[3])) < 1e-30 and got[4] == 0


def test_adds_are_torchs_bf16_adds_bit_for_bit(seed):
    """The residual add and the bias add (every row plus one bf16 vector) give the bits of
    torch's bf16 `+`: fp32 sum, one rounding."""
    x = (torch.randn(7, 203) * torch.logspace(-4, 4, 203)).bfloat16()
    y = (torch.randn(7, 203) * 3).bfloat16()
    bias = (torch.randn(203) * 10).bfloat16()
    got = x.clone()
    _elementwise().qserve_add_bf16(got.data_ptr(), y.data_ptr(), got.numel())
    assert torch.equal(got, x + y)
    got = x.clone()
    _elementwise().qserve_add_rows_bf16(got.data_ptr(), bias.data_ptr(), 7, 203)
    assert torch.equal(got, x + bias)
    assert not torch.equal(got, x)  # the rows did change
