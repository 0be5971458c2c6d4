"""What quantizing the linears' inputs per token would cost: an artifact's next-token KL and
word perplexity against its source with its linears' inputs as the artifact computes them
and quantized per token in memory.

    python -m qserve.runtime.benchmark.activation_precision [--model smollm2-135m]
        [--artifact DIR] [--threads 2]

Measured as the quality budget measures a part (quantize/part_probe.py: fp32 compute,
KL(source || artifact) per predicted token and the relative increase of word perplexity),
on the budget's text: other rows of the calibration corpus than calibration's, never the
gates' held-out text. Every quantized linear (Fp8Linear) keeps its weights as written;
its input is:
- as the artifact computes it (unquantized for W8A16, a static FP8 scale for W8A8);
- int8 with one scale per token (max|row| / 127, round half to even, codes -127..127:
  compressed-tensors' dynamic `strategy: token` int8 inputs, what an integer dot-product
  kernel multiplies, e.g. vpmaddubsw on AVX2, VNNI, AMX-INT8), every linear or all but the
  LM head;
- FP8 E4M3 with one scale per token (max|row| / 448: vLLM's dynamic FP8).
And W8A8-int8 as a whole: int8 inputs per token with int8 weights made from the source's
(one scale per output channel, max|row| / 127, round to nearest; a recipe would round by
GPTQ, so this bounds its loss from above). A row of zeros stays zeros. This says what such a recipe would cost before any kernel or
format for it exists; qserve serves none of the per-token variants.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from ...kernels.fp8 import quantize_fp8
from ..layers.fp8_linear import Fp8Linear
from . import budget_probe


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x [..., k] -> its int8 quantize-dequantize with one scale per row (max|row| / 127),
    in x's dtype."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(s > 0, xf / s.clamp_min(1e-30), 0.0).round().clamp(-127, 127)
    return (q * s).to(x.dtype)


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x [..., k] -> its E4M3 quantize-dequantize with one scale per row (max|row| / 448),
    in x's dtype."""
    xf = x.float()
    s = (xf.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-30)
    return (quantize_fp8(xf, s).float() * s).to(x.dtype)


def int8_per_channel(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] -> its int8 quantize-dequantize with one scale per output channel
    (max|row| / 127), fp32."""
    s = w.float().abs().amax(-1, keepdim=True) / 127.0
    return torch.where(s > 0, w.float() / s.clamp_min(1e-30), 0.0).round().clamp(-127, 127) * s


class PerTokenInputs(nn.Module):
    """A quantized linear's weights as written (weight-only), or `weight` ([out, in] fp32)
    in their place, its input quantized by `quantize` first."""

    def __init__(self, linear: Fp8Linear, quantize: Callable[[torch.Tensor], torch.Tensor],
                 weight: torch.Tensor | None = None):
        super().__init__()
        if weight is None:
            self.inner = Fp8Linear(linear.weight.detach(), linear.weight_scale, None,
                                   linear.bias, linear.weight.dtype, codes=linear.codes)
        else:
            self.inner = nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None)
            self.inner.weight.data = weight.to(linear.weight.dtype)
            if linear.bias is not None:
                self.inner.bias.data = linear.bias.detach().clone()
        self.quantize = quantize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.quantize(x))


@contextmanager
def per_token_inputs(model: nn.Module, quantize, skip: frozenset[str] = frozenset(),
                     weights: Callable[[str], torch.Tensor] | None = None):
    """Every Fp8Linear of `model` but those named in `skip` takes PerTokenInputs' place,
    with weights(name) in place of its own where given; put back on exit."""
    swapped = [(name, m) for name, m in model.named_modules()
               if isinstance(m, Fp8Linear) and name not in skip]
    try:
        for name, m in swapped:
            model.set_submodule(name, PerTokenInputs(
                m, quantize, None if weights is None else weights(name)))
        yield len(swapped)
    finally:
        for name, m in swapped:
            model.set_submodule(name, m)


VARIANTS = [  # (name, quantize or None for the artifact's own inputs, skip the LM head,
    #             int8 weights from the source's instead of the artifact's)
    ("as written", None, False, False),
    ("int8 per token, every linear", int8_per_token, False, False),
    ("int8 per token, the LM head's input as it is", int8_per_token, True, False),
    ("FP8 per token, every linear", fp8_per_token, False, False),
    ("W8A8-int8: int8 per token, int8 weights (round to nearest)", int8_per_token, False, True),
]


def main(argv=None) -> None:
    t0 = time.perf_counter()
    args, bp = budget_probe.from_command_line(__doc__.split("\n\n")[0], argv)
    probe, recipe, rows, words = bp.probe, bp.recipe, bp.rows, bp.words
    b = recipe.budget
    model = probe.art.model
    head = {name for name, m in model.named_modules() if m is getattr(model, "lm_head", None)}
    print(f"{args.model}'s artifact, {rows.shape[0]} x {rows.shape[1]} budget tokens "
          f"({words} words), {args.threads} thread(s); its recipe's budget: KL "
          f"{b.kl or 'unbounded'}, word ppl {f'+{b.ppl:.1%}' if b.ppl else 'unbounded'}\n")
    print("| linears' inputs | linears | KL vs source | word ppl vs source |")
    print("|---|---:|---:|---:|")
    source = dict(probe.src.model.named_modules())
    for name, quantize, skip_head, int8_weights in VARIANTS:
        if quantize is None:
            m, n = probe.measure(), sum(isinstance(x, Fp8Linear) for x in model.modules())
        else:
            weights = (lambda lin: int8_per_channel(source[lin].weight.detach())) \
                if int8_weights else None
            with per_token_inputs(model, quantize, frozenset(head if skip_head else ()),
                                  weights) as n:
                m = probe.measure()
        print(f"| {name} | {n} | {m.kl:.5f} | {m.ppl_increase * 100:+.2f}% |")
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
