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
    w = torch.randn(40, 24)
    x = torch.randn(3, 24)
    scale = scale_from_amax(w.abs().amax(1, keepdim=True))
    want = x @ (quantize_fp8(w, scale).float() * scale).T
    torch.testing.assert_close(lhp.fp8_head(w, True)(x).float(), want, rtol=1e-5, atol=1e-5)
    s8 = w.abs().amax(1, keepdim=True) / 127
    want8 = x @ ((w / s8).round().clamp(-127, 127) * s8).T
    torch.testing.assert_close(lhp.int8_head(w)(x), want8)
    names = [name for name, _, _ in lhp.variants(w)]
    assert names[0] == "as written (bf16)" and len(names) == 4
