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


def _int4_grid():
    from qserve.calib.grids import WeightGrid

    return WeightGrid("int4", 7.0, torch.int8,
                      lambda x, s: torch.round(x.float() / s).clamp(-8, 7).to(torch.int8))


def test_group_scales_round_each_column_with_its_groups_scale():
    """Scales [out, G]: with an identity Hessian (no error to spread) GPTQ is round to
    nearest with each column's group scale; one group is the per-channel path."""
    from qserve.quantize.gptq import gptq_shared

    w, _, _ = _setup(out=8, n_in=64)
    grid = _int4_grid()
    s = w.reshape(8, 2, 32).abs().amax(-1) / 7  # [8, 2]: one scale per row and 32 inputs
    eye = torch.eye(64, dtype=torch.float64)
    codes = gptq_shared([w], eye, [s], grid, block_size=16)[0]
    want = grid.quantize(w, s.repeat_interleave(32, dim=1))
    assert torch.equal(codes, want) and int(codes.abs().max()) <= 8
    one = gptq_shared([w], eye, [s[:, :1]], grid, block_size=16)[0]
    assert torch.equal(one, grid.quantize(w, s[:, :1]))
    with pytest.raises(ValueError, match="group scales must all be"):
        gptq_shared([w], eye, [s[:, :1].expand(8, 3).contiguous()], grid)


def test_group_scales_lower_output_error_on_correlated_inputs():
    from qserve.quantize.gptq import gptq_shared

    w, x, _ = _setup(out=48, n_in=96)
    grid = _int4_grid()
    s = w.reshape(48, 3, 32).abs().amax(-1) / 7
    acc = HessianAccumulator(96)
    acc.observe(x)
    full = s.repeat_interleave(32, dim=1)
    gptq = gptq_shared([w], acc.hessian(), [s], grid, block_size=32)[0].float() * full
    rtn = grid.quantize(w, full).float() * full
    ref = x @ w.t()
    err_gptq = (x @ gptq.t() - ref).pow(2).mean()
    err_rtn = (x @ rtn.t() - ref).pow(2).mean()
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)
