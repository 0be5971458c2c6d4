"""What the LM head's precision costs: an artifact's next-token KL and word perplexity
against its source with the LM head as written and quantized in memory.

    python -m qserve.runtime.benchmark.lm_head_precision [--model smollm2-135m]
        [--artifact DIR] [--threads 2]

Measured as the quality budget measures a part (quantize/part_probe.py: fp32 compute,
KL(source || artifact) per predicted token and the relative increase of word perplexity),
on the budget's text: other rows of the calibration corpus than calibration's, never the
gates' held-out text. The artifact's own head as written, then variants of the source's
LM head [vocab, hidden] (its bf16 weights, so an artifact whose head is already quantized
is measured with each variant in its place, not quantized twice):
- bf16, the source's head as it is;
- FP8 W8A16, one scale per vocabulary row or one for the tensor: the runtime's own
  weight-only Fp8Linear, what a compressed-tensors artifact without `lm_head` in its
  ignore list would hold;
- int8 W8A16, one scale per row, round to nearest: quantize-dequantize in fp32 (what the
  recipe's `lm_head: int8` holds, without its GPTQ);
- int4, one scale per row and block of 32 inputs, round to nearest, with the input as it
  is (W4A16) or quantized to int8 per block of 32 (W4A8, what an integer dot-product
  kernel reads): quantize-dequantize in fp32 (qserve has no int4 head: this says what one
  would cost);
- the same W4A16 int4 head rounded by GPTQ (quantize/gptq.py, block 128, dampening 0.01,
  the scales of round to nearest fixed beforehand) on the Hessian of the head's input over
  the recipe's calibration rows (the artifact's final hidden states; the budget's rows are
  other rows).
Bytes are the LM head's per decoded token (it is read whole for every step).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ...calib.grids import WeightGrid
from ...calib.hessian import HessianAccumulator
from ...kernels.fp8 import quantize_fp8, scale_from_amax
from ...quantize.gptq import gptq_shared
from ...quantize.part_probe import Measurement
from ...quantize.pipeline import calibration_text
from ..attention import AttentionMetadata, DenseAttention
from ..layers.fp8_linear import Fp8Linear
from . import budget_probe


def fp8_head(w: torch.Tensor, per_row: bool) -> nn.Module:
    """w [vocab, hidden] fp32 -> weight-only FP8 linear (scales from each row's or the
    tensor's amax)."""
    amax = w.abs().amax(1, keepdim=True) if per_row else w.abs().amax().reshape(1, 1)
    scale = scale_from_amax(amax)
    return Fp8Linear(quantize_fp8(w, scale), scale.reshape(-1), None, None, torch.float32)


def int8_head(w: torch.Tensor) -> nn.Module:
    """w [vocab, hidden] fp32 -> its int8 per-row quantize-dequantize, as an fp32 linear."""
    scale = (w.abs().amax(1, keepdim=True) / 127.0).clamp_min(1e-12)
    head = nn.Linear(w.shape[1], w.shape[0], bias=False)
    head.weight.data = (w / scale).round().clamp(-127, 127) * scale
    return head


INT4_GRID = WeightGrid("int4", 7.0, torch.int8,  # codes -8..7, scale amax / 7 (symmetric)
                       lambda x, s: torch.round(x.float() / s).clamp(-8, 7).to(torch.int8))


class Int4GroupHead(nn.Module):
    """w [vocab, hidden] fp32 -> int4 weights with one scale per row and block of 32
    inputs (round to nearest), quantize-dequantized in fp32; with `int8_inputs` the input
    too, to int8 with one scale per row and block of 32 (W4A8). With `hessian` ([hidden,
    hidden] float64, E[x x^T] of the head's input) the weights are rounded by GPTQ instead of
    to nearest."""

    def __init__(self, w: torch.Tensor, int8_inputs: bool, hessian: torch.Tensor | None = None):
        super().__init__()
        if w.shape[1] % 32:
            raise ValueError(f"an int4 head's blocks of 32 inputs need a width that 32 "
                             f"divides; this head is {w.shape[1]} wide.")
        blocks = w.reshape(w.shape[0], -1, 32)
        scale = blocks.abs().amax(-1, keepdim=True) / 7.0
        if hessian is not None:  # GPTQ onto the same grid with the same scales
            s = scale.squeeze(-1).clamp_min(1e-30)  # [vocab, hidden / 32]
            codes = gptq_shared([w], hessian, [s], INT4_GRID)[0]  # [vocab, hidden] int8
            q = codes.float().reshape(blocks.shape) * (scale > 0)
        else:
            q = torch.where(scale > 0, blocks / scale.clamp_min(1e-30), 0).round().clamp(-8, 7)
        self.weight = nn.Parameter((q * scale).reshape(w.shape), requires_grad=False)
        self.int8_inputs = int8_inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_inputs:
            xb = x.float().reshape(*x.shape[:-1], -1, 32)
            s = xb.abs().amax(-1, keepdim=True) / 127.0
            x = (torch.where(s > 0, xb / s.clamp_min(1e-30), 0).round().clamp(-127, 127)
                 * s).reshape(x.shape)
        return x.float() @ self.weight.t()


def variants(w: torch.Tensor, hessian: torch.Tensor | None = None
             ) -> list[tuple[str, nn.Module | None, float]]:
    """(name, LM head module or None for the artifact's own, bytes per weight); with the
    head input's Hessian, also the GPTQ int4 head."""
    group = 0.5 + 2 / 32  # 4 bits a weight and a bf16 scale per 32
    gptq = [] if hessian is None else [
        ("int4 W4A16, scales per 32, GPTQ (simulated)", Int4GroupHead(w, False, hessian), group)]
    bf16 = nn.Linear(w.shape[1], w.shape[0], bias=False)
    bf16.weight.data = w
    return [("as written", None, 0.0),  # main() counts the artifact's own bytes
            ("bf16 (the source's)", bf16, 2.0),
            ("FP8 W8A16, per-row scales", fp8_head(w, True), 1.0),
            ("FP8 W8A16, one scale", fp8_head(w, False), 1.0),
            ("int8 W8A16, per-row scales (simulated)", int8_head(w), 1.0),
            ("int4 W4A16, scales per 32 (simulated)", Int4GroupHead(w, False), group),
            ("int4 W4A8, scales per 32, int8 inputs per 32 (simulated)",
             Int4GroupHead(w, True), group), *gptq]


def head_input_hessian(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """E[x x^T] [hidden, hidden] float64 of the LM head's input (the final hidden states)
    over rows [N, L] of token ids, each a sequence from its start."""
    acc = None
    with torch.inference_mode():
        for ids in rows:
            n = ids.shape[0]
            hidden = model(ids, torch.arange(n), AttentionMetadata.single(n), DenseAttention())
            acc = acc or HessianAccumulator(hidden.shape[-1])
            acc.observe(hidden.float())
    return acc.hessian()


def main(argv=None) -> None:
    t0 = time.perf_counter()
    args, bp = budget_probe.from_command_line(__doc__.split("\n\n")[0], argv)
    probe, recipe, artifact, rows, words = bp.probe, bp.recipe, bp.artifact, bp.rows, bp.words
    b = recipe.budget
    model = probe.art.model
    own = model.lm_head
    w = probe.src.model.lm_head.weight.detach().float()  # the source's: bf16 values
    calib_rows, _ = calibration_text(args.model, recipe, None, b.num_samples, b.seq_len,
                                     recipe.calibration.seed)  # not the budget's rows
    hessian = head_input_hessian(model, calib_rows)
    print(f"{artifact}: LM head {list(w.shape)}, {rows.shape[0]} x {rows.shape[1]} budget "
          f"tokens ({words} words), {args.threads} thread(s)\n")
    print("| LM head | bytes / token | KL vs source | word ppl vs source |")
    print("|---|---:|---:|---:|")
    for name, head, per_weight in variants(w, hessian):
        model.lm_head = own if head is None else head
        if head is None:  # the artifact's own: one byte a weight if 8-bit, else bf16's two
            per_weight = 1.0 if isinstance(own, Fp8Linear) else 2.0
        m: Measurement = probe.measure()
        print(f"| {name} | {w.numel() * per_weight / 1e6:.1f} MB | {m.kl:.5f} | "
              f"{m.ppl_increase * 100:+.2f}% |")
    model.lm_head = own
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
