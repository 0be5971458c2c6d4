"""The activation-precision benchmark's per-token quantizers and its swap of the linears
(the measurement itself runs on a real model: docs/quality.md)."""

import torch
from torch import nn

from qserve.kernels.fp8 import FP8_DTYPE
from qserve.runtime.benchmark import activation_precision as ap
from qserve.runtime.layers.fp8_linear import Fp8Linear


def test_int8_per_token_against_a_float64_reference():
    """One scale per row, max|row| / 127; codes rounded half to even in -127..127; a row of
    zeros stays zeros."""
    torch.manual_seed(0)
    x = torch.randn(4, 37) * torch.tensor([[1.0], [100.0], [1e-3], [0.0]])
    x[0, 3] = -x[0].abs().max() * 2  # the amax is a negative value
    xd = x.double()
    s = xd.abs().amax(-1, keepdim=True) / 127
    want = torch.where(s > 0, (xd / s.clamp_min(1e-300)).round().clamp(-127, 127) * s, 0.0)
    got = ap.int8_per_token(x)
    # computed in fp32: a quotient within fp32 rounding of a half step may round the other
    # way (one code apart); everywhere else the same value
    quotient = xd / s.clamp_min(1e-300)
    near_tie = ((quotient - quotient.floor()) - 0.5).abs() < 1e-5
    close = (got.double() - want).abs() <= 1e-6 * want.abs()
    assert bool((close | near_tie).all())
    assert bool(((got.double() - want).abs() <= s * (1 + 1e-6)).all())
    assert bool((got[3] == 0).all())
    codes = (x[:3].double() / s[:3]).round()
    assert int(codes.abs().max()) == 127 and len(torch.unique(codes[0])) > 20


def test_fp8_per_token_keeps_each_rows_amax_and_e4m3_steps():
    torch.manual_seed(1)
    x = torch.randn(3, 64) * torch.tensor([[1.0], [50.0], [0.0]])
    got = ap.fp8_per_token(x)
    amax = x.abs().amax(-1)
    assert torch.equal(got.abs().amax(-1)[:2], amax[:2])  # 448 * (amax / 448): exact here
    s = (amax[:2] / 448).reshape(2, 1)
    codes = (got[:2] / s).to(FP8_DTYPE).float()
    assert torch.equal(codes * s, got[:2])  # every value is a scaled E4M3 value
    assert bool((got[2] == 0).all())


def test_the_linears_inputs_are_swapped_and_put_back():
    torch.manual_seed(2)
    w = torch.randint(-127, 128, (6, 16), dtype=torch.int8)
    model = nn.Sequential(Fp8Linear(w, torch.full((6,), 0.01), None, None, torch.float32),
                          nn.Linear(6, 5))
    lin, plain = model[0], model[1]
    x = torch.randn(3, 16)
    before = model(x)
    with ap.per_token_inputs(model, ap.int8_per_token) as n:
        assert n == 1 and isinstance(model[0], ap.PerTokenInputs) and model[1] is plain
        torch.testing.assert_close(model(x), plain(lin(ap.int8_per_token(x))))
        assert not torch.equal(model(x), before)
    assert model[0] is lin and torch.equal(model(x), before)
    with ap.per_token_inputs(model, ap.int8_per_token, skip=frozenset({"0"})) as n:
        assert n == 0 and model[0] is lin


def test_int8_weights_from_the_source_take_the_linears_place():
    torch.manual_seed(4)
    w = torch.randint(-127, 128, (6, 16), dtype=torch.int8)
    model = nn.Sequential(Fp8Linear(w, torch.full((6,), 0.01), None, None, torch.float32))
    src = torch.randn(6, 16)
    x = torch.randn(3, 16)
    with ap.per_token_inputs(model, ap.int8_per_token, weights=lambda name: ap.int8_per_channel(src)):
        got = model(x)
    s = src.abs().amax(1, keepdim=True) / 127
    want = ap.int8_per_token(x) @ ((src / s).round() * s).T
    torch.testing.assert_close(got, want)
