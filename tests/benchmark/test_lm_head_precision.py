"""The LM-head precision benchmark's variants and its input checks (the measurement itself
runs on a real model: docs/quality.md)."""

import pytest
import torch

from qserve.kernels.fp8 import quantize_fp8, scale_from_amax
from qserve.runtime.benchmark import lm_head_precision as lhp


def test_an_unknown_model_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        lhp.main(["--model", "nosuch"])
    assert e.value.code == 2
    assert "smollm2-135m" in capsys.readouterr().err


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
    assert names[0] == "as written (bf16)" and len(names) == 6


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
