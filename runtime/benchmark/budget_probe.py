"""The quality budget's measurement of a built-in model's artifact, as the precision
benchmarks (lm_head_precision, activation_precision) set it up from their command line.

    args, bp = from_command_line(description, argv)   # --model, --artifact, --threads
    bp.probe.measure()         # as quantize/budget.py measures a part

The text is the budget's: `num_samples` x `seq_len` rows of the calibration corpus drawn
with the recipe's calibration seed + 1 (other rows than calibration's, never the gates'
held-out text).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from ...quantize.builtin_artifact import builtin_artifact, builtin_recipe
from ...quantize.part_probe import PartProbe
from ...quantize.pipeline import calibration_text
from ...quantize.recipe import Recipe
from ..formats.sources import BUILTIN_MODELS


@dataclass(frozen=True)
class BudgetProbe:
    probe: PartProbe  # the artifact and its source, the budget's rows measured once
    recipe: Recipe  # the model's built-in recipe
    artifact: str  # the artifact's directory
    rows: torch.Tensor  # [N, L] int64 the budget's token rows
    words: int  # the words those rows hold


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(BUILTIN_MODELS),
                    help="a built-in model (the source)")
    ap.add_argument("--artifact", default=None,
                    help="the artifact to measure (default: the model's built-in one)")
    ap.add_argument("--threads", type=int, default=2)


def open_probe(args: argparse.Namespace) -> BudgetProbe:
    """Sets torch's threads to args.threads, makes (or finds) the artifact and measures the
    source on the budget's rows."""
    torch.set_num_threads(args.threads)
    artifact = args.artifact or builtin_artifact(args.model, print)
    recipe = builtin_recipe(args.model)
    b = recipe.budget
    rows, words = calibration_text(args.model, recipe, None, b.num_samples, b.seq_len,
                                   recipe.calibration.seed + 1)
    return BudgetProbe(PartProbe(artifact, args.model, rows, words), recipe, artifact, rows,
                       words)


def from_command_line(description: str, argv: list[str] | None
                      ) -> tuple[argparse.Namespace, BudgetProbe]:
    """A precision benchmark's command line (--model, --artifact, --threads) parsed and its
    probe opened."""
    ap = argparse.ArgumentParser(description=description)
    add_arguments(ap)
    args = ap.parse_args(argv)
    return args, open_probe(args)
