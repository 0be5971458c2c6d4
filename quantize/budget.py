"""The quality budget: which parts of an FP8 artifact to keep closer to bf16 so that its
predictions stay within a perplexity budget of the source's, at the least cost in bytes
read per decoded token.

    qserve quantize SRC --out DIR --budget ppl=+1%      (recipe: budget: {ppl: 0.01})

1. The recipe is quantized as usual (every part FP8), into a scratch directory.
2. Each part is measured alone (quantize/part_probe.py): how much of the artifact's
   word-perplexity increase and KL goes away when only that part is restored, on
   calibration-corpus text (never the eval gates' held-out text).
3. Parts are taken cheapest first: those that cost no bytes (a layer's linear inputs
   left unquantized: same FP8 weights, W8A16), most sensitive first; then the KV cache
   as a whole (bf16 K/V: twice the KV bytes); then a layer's linears whole in bf16 (one
   more byte a weight), most sensitive per byte first. The shortest prefix of that order
   that meets the budget is found by bisection, each step a real measurement.
4. The chosen parts become recipe entries every compressed-tensors reader understands:
   `weight_only` names, `ignore` names, `kv_cache: {enabled: false}`; the recipe is
   quantized again into DIR and the budget is measured on that artifact, which is the
   one recorded.

Parts are per decoder layer (all of a layer's linears together), not per linear: a
measurement is a forward pass over the budget text, and per-linear parts would take ~7x
as many (210 linears against 30 layers on SmolLM2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from ..runtime.formats.errors import QserveError
from .part_probe import Measurement, PartProbe

# what restoring a part costs, by kind: bytes read per decoded token (see Part.cost)
PART_KINDS = ("inputs", "kv", "weights")


class BudgetError(QserveError, ValueError):
    pass


@dataclass(frozen=True)
class BudgetSpec:
    """A budget: the largest relative increase of word perplexity allowed (0.01 = +1%)."""

    ppl: float

    @classmethod
    def parse(cls, text: str) -> "BudgetSpec":
        """"ppl=+1%", "ppl=1%" or "ppl=0.01"."""
        m = re.fullmatch(r"\s*ppl\s*=\s*\+?\s*([0-9]*\.?[0-9]+)\s*(%?)\s*", text or "")
        if not m:
            raise BudgetError(f"budget {text!r} is not understood; give the largest "
                              "perplexity increase, e.g. --budget ppl=+1% (or ppl=0.01).")
        value = float(m.group(1)) / (100 if m.group(2) else 1)
        if not 0 < value < 1:
            raise BudgetError(f"budget {text!r}: the perplexity increase must be between 0 "
                              "and 100%.")
        return cls(value)


@dataclass(frozen=True)
class Part:
    name: str  # "layers.3.inputs", "kv", "layers.3.weights"
    kind: str  # one of PART_KINDS
    modules: tuple[str, ...] = ()  # linear module names (inputs, weights)
    layers: tuple[int, ...] = ()  # attention layers (kv)
    cost: int = 0  # extra bytes read per decoded token when restored


@dataclass
class PartResult:
    part: Part
    alone: Measurement  # the artifact with only this part restored

    def gain(self, base: Measurement) -> float:
        """Perplexity increase removed by restoring this part alone."""
        return base.ppl_increase - self.alone.ppl_increase


@dataclass
class BudgetResult:
    spec: BudgetSpec
    base: Measurement  # every part FP8
    parts: list[PartResult]
    chosen: list[Part]
    chosen_measured: Measurement  # with the chosen parts restored (scratch artifact)
    trials: list[tuple[int, Measurement]] = field(default_factory=list)  # bisection steps
    final: Measurement | None = None  # on the artifact quantized with the chosen recipe

    @property
    def met(self) -> bool | None:
        """Whether the artifact written is within the budget (None: not measured yet).
        It is quantized again with the chosen parts, so its calibration differs from the
        all-FP8 artifact the parts were measured in; on a small model that alone can move
        word perplexity by more than the parts' effects (docs/quality.md)."""
        return None if self.final is None else self.final.ppl_increase <= self.spec.ppl

    def table(self) -> list[str]:
        """The summary lines `qserve quantize` prints."""
        chosen = {p.name for p in self.chosen}
        lines = [f"budget: word perplexity within +{self.spec.ppl:.2%} of bf16 on calibration "
                 f"text; every part FP8: {self.base.ppl_increase:+.2%} (KL {self.base.kl:.4f})",
                 f"{'part':<22} {'cost MB/token':>13} {'alone':>9} {'gain':>8}  kept"]
        for r in sorted(self.parts, key=lambda r: r.part.name):
            lines.append(f"{r.part.name:<22} {r.part.cost / 1e6:>13.3f} "
                         f"{r.alone.ppl_increase:>+9.2%} {r.gain(self.base):>+8.2%}  "
                         f"{'yes' if r.part.name in chosen else ''}")
        cost = sum(p.cost for p in self.chosen)
        lines.append(f"kept {len(self.chosen)} of {len(self.parts)} parts (+{cost / 1e6:.2f} MB "
                     f"per decoded token): {self.chosen_measured.ppl_increase:+.2%} with them "
                     "restored in the all-FP8 artifact"
                     + (f"; {self.final.ppl_increase:+.2%} (KL {self.final.kl:.4f}) on the "
                        "artifact written" if self.final is not None else ""))
        if self.met is False:
            lines.append(f"budget NOT met by the artifact written: {self.final.ppl_increase:+.2%} "
                         f"> +{self.spec.ppl:.2%}")
        return lines

    def to_dict(self) -> dict:
        def m(x: Measurement) -> dict:
            return {"kl": x.kl, "ppl_increase": x.ppl_increase}

        return {"ppl": self.spec.ppl, "met": self.met, "base": m(self.base),
                "parts": [{"name": r.part.name, "kind": r.part.kind, "cost_bytes": r.part.cost,
                           "alone": m(r.alone)} for r in self.parts],
                "chosen": [p.name for p in self.chosen], "chosen_measured": m(self.chosen_measured)}


def enumerate_parts(model: nn.Module, quantized: set[str], kv_layers: list[int],
                    kv_cost: int) -> list[Part]:
    """Per decoder layer: its quantized linears' inputs and its quantized linears whole;
    and the KV cache as one part (compressed-tensors has one kv_cache_scheme).
    model: the artifact's runtime model; quantized: names of its FP8 linears;
    kv_cost: extra bytes per decoded token of a bf16 cache (at the reference context)."""
    per_layer: dict[int, list[tuple[str, int]]] = {}
    for name, module in model.named_modules():
        m = re.search(r"\.layers\.(\d+)\.", name)
        if name in quantized and m:
            per_layer.setdefault(int(m.group(1)), []).append((name, module.weight.numel()))
    parts = []
    for i in sorted(per_layer):
        names = tuple(n for n, _ in per_layer[i])
        parts.append(Part(f"layers.{i}.inputs", "inputs", names, cost=0))
        # bf16 weights: two bytes a weight instead of one
        parts.append(Part(f"layers.{i}.weights", "weights", names,
                          cost=sum(n for _, n in per_layer[i])))
    if kv_layers:
        parts.append(Part("kv", "kv", layers=tuple(kv_layers), cost=kv_cost))
    return parts


def order_parts(results: list[PartResult], base: Measurement) -> list[Part]:
    """Cheapest first: free parts by gain, then the rest by gain per byte (both
    descending); parts whose restoring gains nothing come last."""
    def key(r: PartResult):
        gain = r.gain(base)
        if gain <= 0:
            return (2, 0.0)
        return (0, -gain) if r.part.cost == 0 else (1, -gain / r.part.cost)
    return [r.part for r in sorted(results, key=key)]


def search(probe: PartProbe, parts: list[Part], spec: BudgetSpec,
           progress=lambda msg: None) -> BudgetResult:
    """Measure every part alone, then bisect the shortest prefix of the cheapest-first
    order whose restoring meets the budget (a prefix that meets it is a measurement, not
    an estimate). All parts restored not meeting it is a BudgetError."""
    base = probe.measure()
    progress(f"budget: all FP8 {base.ppl_increase:+.2%} word perplexity, KL {base.kl:.4f}")
    if base.ppl_increase <= spec.ppl:
        return BudgetResult(spec, base, [], [], base)
    results = []
    for k, part in enumerate(parts):
        progress(f"budget: part {k + 1}/{len(parts)} {part.name}")
        results.append(PartResult(part, probe.measure({part})))
    order = order_parts(results, base)
    trials: list[tuple[int, Measurement]] = []

    def meets(n: int) -> Measurement | None:
        m = probe.measure(set(order[:n]))
        trials.append((n, m))
        progress(f"budget: first {n} parts restored: {m.ppl_increase:+.2%}")
        return m if m.ppl_increase <= spec.ppl else None

    best = meets(len(order))
    if best is None:
        raise BudgetError(f"budget ppl=+{spec.ppl:.2%}: even with every part restored the "
                          f"artifact measures {trials[-1][1].ppl_increase:+.2%}; the rest is "
                          "the LM head or parts not measured. Loosen the budget.")
    lo, hi = 0, len(order)  # prefix lo fails (or is empty), prefix hi meets
    while hi - lo > 1:
        mid = (lo + hi) // 2
        m = meets(mid)
        if m is not None:
            hi, best = mid, m
        else:
            lo = mid
    return BudgetResult(spec, base, results, order[:hi], best, trials)


def recipe_changes(chosen: list[Part]) -> dict:
    """The recipe entries that express `chosen`: weight_only and ignore names, KV off."""
    weights = {n for p in chosen if p.kind == "weights" for n in p.modules}
    inputs = {n for p in chosen if p.kind == "inputs" for n in p.modules} - weights
    return {"weight_only": sorted(inputs), "ignore": sorted(weights),
            "kv_off": any(p.kind == "kv" for p in chosen)}
