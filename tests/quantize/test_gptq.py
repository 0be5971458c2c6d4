"""GPTQ onto the FP8 grid: exact where it must equal rounding, better where it should."""

import pytest
import torch

from qserve.calib.fp8 import quantize_fp8
from qserve.calib.hessian import HessianAccumulator, SharedInput, gram
from qserve.quantize.gptq import gptq_fp8


def _setup(seed=0, out=48, n_in=96, tokens=2048):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n_in, generator=g)
    mix = torch.randn(n_in, n_in, generator=g) / n_in**0.5 + torch.eye(n_in)
    x = torch.randn(tokens, n_in, generator=g) @ mix  # correlated input features
    scale = (w.abs().amax(1, keepdim=True) / 448).float()
    return w, x, scale


def test_identity_hessian_equals_round_to_nearest():
    w, _, scale = _setup()
    codes = gptq_fp8(w, torch.eye(w.shape[1], dtype=torch.float64), scale, block_size=32)
    assert torch.equal(codes.view(torch.uint8), quantize_fp8(w, scale).view(torch.uint8))


def test_gptq_lowers_output_error_on_correlated_inputs():
    w, x, scale = _setup()
    acc = HessianAccumulator(w.shape[1])
    acc.observe(x)
    gptq = gptq_fp8(w, acc.hessian(), scale, block_size=32).float() * scale
    rtn = quantize_fp8(w, scale).float() * scale
    ref = x @ w.t()
    err_gptq = (x @ gptq.t() - ref).pow(2).mean()
    err_rtn = (x @ rtn.t() - ref).pow(2).mean()
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)


def test_hessian_is_mean_outer_product_and_shared_input_counts_once():
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    acc = HessianAccumulator(3)
    shared = SharedInput(acc, 3)
    for _ in range(3):  # q, k and v see the same tensor
        shared.observe(x)
    assert acc.count == 4
    assert torch.allclose(acc.hessian(), (x.double().t() @ x.double()) / 4)


@pytest.mark.parametrize("n", [5, 384, 500, 1536])
def test_gram_matches_the_full_product_and_is_symmetric(n):
    """gram() computes the blocks on and above the diagonal only; the result is x^T x
    (float64 oracle) and exactly symmetric, whatever n is against the block size."""
    x = torch.randn(257, n, generator=torch.Generator().manual_seed(n))
    h = gram(x)
    ref = x.double().t() @ x.double()
    assert torch.equal(h, h.t())
    torch.testing.assert_close(h.double(), ref, rtol=1e-5, atol=1e-3)
    assert torch.allclose(h, x.t() @ x, rtol=1e-5, atol=1e-3)
