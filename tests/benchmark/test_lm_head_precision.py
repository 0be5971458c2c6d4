"""The LM-head precision benchmark's variants and its input checks (the measurement itself
runs on a real model: docs/quality.md)."""

import pytest
import torch

from qserve.kernels.fp8 import quantize_fp8, scale_from_amax
from qserve.runtime.benchmark import lm_head_precision as lhp


def test_heads_compute_their_quantized_weights():
    torch.manual_seed(0)
    w = torch.randn(40, 32)  # a width the int4 variants' blocks of 32 divide
    x = torch.randn(3, 32)
    scale = scale_from_amax(w.abs().amax(1, keepdim=True))
    want = x @ (quantize_fp8(w, scale).float() * scale).T
    torch.testing.assert_close(lhp.fp8_head(w, True)(x).float(), want, rtol=1e-5, atol=1e-5)
    s8 = w.abs().amax(1, keepdim=True) / 127
    want8 = x @ ((w / s8).round().clamp(-127, 127) * s8).T
    torch.testing.assert_close(lhp.int8_head(w)(x), want8)
    names = [name for name, _, _ in lhp.variants(w)]
    assert names[:2] == ["as written", "bf16 (the source's)"] and len(names) == 7
    assert torch.equal(lhp.variants(w)[1][1](x), x @ w.T)


def test_int4_heads_quantize_per_block_of_32():
    """Against a float64 quantize-dequantize written here: one scale (amax / 7) per row
    and 32 inputs, codes -8..7; W4A8 also rounds the input per row and 32 to int8."""
    torch.manual_seed(1)
    w = torch.randn(5, 64)
    w[0, :32] = 0  # an all-zero block: codes and scale 0
    x = torch.randn(3, 64)
    wd = w.double().reshape(5, 2, 32)
    sw = wd.abs().amax(-1, keepdim=True) / 7
    qw = torch.where(sw > 0, (wd / sw.clamp_min(1e-300)).round().clamp(-8, 7), 0) * sw
    want16 = x.double() @ qw.reshape(5, 64).T
    torch.testing.assert_close(lhp.Int4GroupHead(w, False)(x).double(), want16,
                               rtol=1e-5, atol=1e-5)
    xd = x.double().reshape(3, 2, 32)
    sx = xd.abs().amax(-1, keepdim=True) / 127
    qx = ((xd / sx).round().clamp(-127, 127) * sx).reshape(3, 64)
    torch.testing.assert_close(lhp.Int4GroupHead(w, True)(x).double(), qx @ qw.reshape(5, 64).T,
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(lhp.Int4GroupHead(w, True)(x), x @ w.T, atol=1e-3)  # it is lossy


def test_an_int4_head_of_a_width_32_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="blocks of 32 inputs need a width that 32 divides; "
                                         "this head is 24 wide"):
        lhp.Int4GroupHead(torch.randn(4, 24), False)


def test_a_gptq_int4_head_rounds_onto_the_same_grid_and_lowers_the_heads_error():
    """With an identity Hessian (nothing to spread) GPTQ rounds to nearest: the round to
    nearest head exactly; with the Hessian of correlated inputs, a smaller output error on
    them, with the same scales and codes -8..7."""
    torch.manual_seed(3)
    w = torch.randn(40, 64)
    eye = torch.eye(64, dtype=torch.float64)
    assert torch.equal(lhp.Int4GroupHead(w, False, eye).weight, lhp.Int4GroupHead(w, False).weight)
    x = torch.randn(2048, 64) @ (torch.randn(64, 64) / 8 + torch.eye(64))
    h = (x.double().T @ x.double()) / x.shape[0]
    gptq, rtn = lhp.Int4GroupHead(w, False, h), lhp.Int4GroupHead(w, False)
    ref = x @ w.T
    err = lambda head: float((head(x) - ref).pow(2).mean())  # noqa: E731
    assert err(gptq) < 0.8 * err(rtn)
    scale = w.reshape(40, 2, 32).abs().amax(-1, keepdim=True) / 7
    codes = gptq.weight.reshape(40, 2, 32) / scale
    assert bool(((codes - codes.round()).abs() < 1e-4).all()) and int(codes.abs().max()) <= 8
    assert [n for n, _, _ in lhp.variants(w, h)][-1] == "int4 W4A16, scales per 32, GPTQ (simulated)"
