"""The quality budget: which parts of an FP8 artifact to keep closer to bf16 so that its
predictions stay within a budget of the source's (word perplexity, next-token KL, or
both), at the least cost in bytes read per decoded token.

    qserve quantize SRC --out DIR --budget ppl=+1%       (recipe: budget: {ppl: 0.01})
    qserve quantize SRC --out DIR --budget kl=0.004      (recipe: budget: {kl: 0.004})
    qserve quantize SRC --out DIR --budget ppl=+1%,kl=0.004     (both must hold)

1. The recipe is quantized as usual (every part FP8), into a scratch directory.
2. Each part is measured (quantize/part_probe.py): how much of the artifact's KL and
   word-perplexity increase goes away when that part is restored, on calibration-corpus
   text (never the eval gates' held-out text).
3. Parts are taken cheapest first: those that cost no bytes (a layer's linear inputs
   left unquantized: same weights, W8A16 (from static FP8 inputs, or from per-row FP8 or
   int8 inputs with `activations.dynamic`), most sensitive first; then the parts that
   cost bytes, the KV cache as a whole (bf16 K/V: twice the KV bytes), a layer's
   linears whole in bf16 (one more byte a weight) and a quantized LM head in bf16 (the
   same: on a 150k-word vocabulary the largest single part), most sensitive per byte first.
   Sensitivity is the KL removed by restoring the part: KL is a smooth function of what
   is restored, where word perplexity over a few thousand tokens moves up and down by
   more than one part's effect on a small model (docs/quality.md). A free part is
   measured alone in the all-FP8 artifact; a part that costs bytes is measured with
   every free part restored, where the order puts it (the parts' effects do not add up:
   on SmolLM2 a layer restored alone in the all-FP8 artifact moved KL by +-0.002 of
   0.033, either way). The shortest prefix of that order
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
from dataclasses import dataclass, field, replace

from torch import nn

from ..runtime.decode_rate import DecodeRate, describe
from ..runtime.formats.errors import QserveError
from .part_probe import Measurement, PartProbe
from .recipe import Recipe

# what restoring a part costs, by kind: bytes read per decoded token (see Part.cost)
PART_KINDS = ("inputs", "kv", "weights")


class BudgetError(QserveError, ValueError):
    pass


@dataclass(frozen=True)
class BudgetSpec:
    """A budget: the largest relative increase of word perplexity (0.01 = +1%) and/or the
    largest mean next-token KL(source || artifact) in nats; 0 leaves a measure unbounded,
    and every bounded one must hold."""

    ppl: float = 0.0
    kl: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "BudgetSpec":
        """"ppl=+1%", "ppl=1%", "ppl=0.01", "kl=0.004", or both joined by a comma."""
        values: dict[str, float] = {}
        for item in (text or "").split(","):
            m = re.fullmatch(r"\s*(ppl|kl)\s*=\s*\+?\s*([0-9]*\.?[0-9]+)\s*(%?)\s*", item)
            if not m or m.group(1) in values:
                raise BudgetError(f"budget {text!r} is not understood; give the largest "
                                  "perplexity increase and/or KL, e.g. --budget ppl=+1%, "
                                  "--budget kl=0.004 or --budget ppl=+1%,kl=0.004.")
            values[m.group(1)] = float(m.group(2)) / (100 if m.group(3) else 1)
        if "ppl" in values and not 0 < values["ppl"] < 1:
            raise BudgetError(f"budget {text!r}: the perplexity increase must be between 0 "
                              "and 100%.")
        if "kl" in values and not 0 < values["kl"] < 10:
            raise BudgetError(f"budget {text!r}: the KL must be between 0 and 10 nats.")
        return cls(**values)

    def __post_init__(self):
        if not (self.ppl > 0 or self.kl > 0):
            raise BudgetError("a budget bounds word perplexity (ppl) or KL (kl), or both.")

    def holds(self, m: "Measurement") -> bool:
        return ((self.ppl <= 0 or m.ppl_increase <= self.ppl)
                and (self.kl <= 0 or m.kl <= self.kl))

    def describe(self) -> str:
        bounds = ([f"word perplexity within +{self.ppl:.2%}"] if self.ppl > 0 else []) + \
            ([f"KL within {self.kl:.4f}"] if self.kl > 0 else [])
        return " and ".join(bounds)


def show(m: Measurement) -> str:
    """A measurement as the budget's lines print it."""
    return f"{m.ppl_increase:+.2%} word perplexity, KL {m.kl:.4f}"


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
    measured: Measurement  # the artifact with this part restored (on top of `reference`'s)
    reference: Measurement  # what it is measured against: all FP8, or every free part restored

    def gain(self) -> float:
        """KL removed by restoring this part (the order's sensitivity)."""
        return self.reference.kl - self.measured.kl


@dataclass
class BudgetResult:
    spec: BudgetSpec
    base: Measurement  # every part FP8
    parts: list[PartResult]
    chosen: list[Part]
    chosen_measured: Measurement  # with the chosen parts restored (scratch artifact)
    trials: list[tuple[int, Measurement]] = field(default_factory=list)  # bisection steps
    final: Measurement | None = None  # on the artifact quantized with the chosen recipe
    # measured decode speed (runtime/decode_rate.py) of the all-FP8 artifact and of the one
    # written: what the parts kept cost in tokens a second
    decode_base: list[DecodeRate] = field(default_factory=list)
    decode_final: list[DecodeRate] = field(default_factory=list)

    @property
    def met(self) -> bool | None:
        """Whether the artifact written is within the budget (None: not measured yet).
        It is quantized again with the chosen parts, so its calibration differs from the
        all-FP8 artifact the parts were measured in; on a small model that alone can move
        word perplexity by more than the parts' effects (docs/quality.md)."""
        return None if self.final is None else self.spec.holds(self.final)

    def table(self) -> list[str]:
        """The summary lines `qserve quantize` prints."""
        chosen = {p.name for p in self.chosen}
        lines = [f"budget: {self.spec.describe()} of bf16 on calibration text; nothing "
                 f"restored: {show(self.base)}",
                 "free parts measured alone in the artifact as quantized, the others with every "
                 "free part restored",
                 f"{'part':<22} {'cost MB/token':>13} {'ppl':>9} {'KL':>9} {'KL gain':>8}  kept"]
        for r in sorted(self.parts, key=lambda r: r.part.name):
            lines.append(f"{r.part.name:<22} {r.part.cost / 1e6:>13.3f} "
                         f"{r.measured.ppl_increase:>+9.2%} {r.measured.kl:>9.4f} "
                         f"{r.gain():>+8.4f}  {'yes' if r.part.name in chosen else ''}")
        cost = sum(p.cost for p in self.chosen)
        lines.append(f"kept {len(self.chosen)} of {len(self.parts)} parts (+{cost / 1e6:.2f} MB "
                     f"per decoded token): {show(self.chosen_measured)} with them "
                     "restored in the artifact as quantized"
                     + (f"; {show(self.final)} on the artifact written"
                        if self.final is not None else ""))
        if self.decode_base and self.decode_final:
            lines.append(f"decode: nothing restored {describe(self.decode_base)}; the artifact "
                         f"written {describe(self.decode_final)}"
                         + (" (the same artifact)" if self.decode_final is self.decode_base
                            else " (timed one after the other)"))
        if self.met is False:
            lines.append(f"budget NOT met by the artifact written ({show(self.final)}; "
                         f"the budget: {self.spec.describe()})")
        return lines

    def to_dict(self) -> dict:
        def m(x: Measurement) -> dict:
            return {"kl": x.kl, "ppl_increase": x.ppl_increase}

        return {"ppl": self.spec.ppl, "kl": self.spec.kl, "met": self.met, "base": m(self.base),
                "parts": [{"name": r.part.name, "kind": r.part.kind, "cost_bytes": r.part.cost,
                           "measured": m(r.measured), "against": m(r.reference)}
                          for r in self.parts],
                "chosen": [p.name for p in self.chosen], "chosen_measured": m(self.chosen_measured),
                "decode_tokens_per_s": {
                    "nothing_restored": {str(r.batch): r.tokens_per_s for r in self.decode_base},
                    "artifact": {str(r.batch): r.tokens_per_s for r in self.decode_final}}}


def enumerate_parts(model: nn.Module, quantized: set[str], kv_layers: list[int],
                    kv_cost: int) -> list[Part]:
    """Per decoder layer: its quantized linears' inputs (unless all are weight-only
    already, as with int8 weights) and its quantized linears whole; a quantized LM head
    whole; and the KV cache as one part (compressed-tensors has one kv_cache_scheme).
    model: the artifact's runtime model; quantized: names of its FP8 linears;
    kv_cost: extra bytes per decoded token of a bf16 cache (at the reference context)."""
    per_layer: dict[int, list[tuple[str, int]]] = {}
    quantized_inputs: set[int] = set()  # layers with a linear whose input is quantized
    for name, module in model.named_modules():
        m = re.search(r"\.layers\.(\d+)\.", name)
        if name in quantized and m:
            per_layer.setdefault(int(m.group(1)), []).append((name, module.weight.numel()))
            if not getattr(module, "weight_only", False):
                quantized_inputs.add(int(m.group(1)))
    parts = []
    head = quantized_head(model, quantized)
    for i in sorted(per_layer):
        names = tuple(n for n, _ in per_layer[i])
        if i in quantized_inputs:  # else (e.g. int8 weights) nothing to restore
            parts.append(Part(f"layers.{i}.inputs", "inputs", names, cost=0))
        # bf16 weights: two bytes a weight instead of one
        parts.append(Part(f"layers.{i}.weights", "weights", names,
                          cost=sum(n for _, n in per_layer[i])))
    if head is not None:  # bf16: one more byte a weight, read whole every step
        parts.append(Part("lm_head.weights", "weights", ("lm_head",), cost=head.weight.numel()))
    if kv_layers:
        parts.append(Part("kv", "kv", layers=tuple(kv_layers), cost=kv_cost))
    return parts


def quantized_head(model: nn.Module, quantized: set[str]) -> nn.Module | None:
    """The model's LM head when it is one of the quantized linears (a recipe's
    `lm_head: int8 | fp8`, or every linear int8), else None."""
    return model.get_submodule("lm_head") if "lm_head" in quantized else None


def order_parts(results: list[PartResult]) -> list[Part]:
    """Cheapest first: free parts by gain, then the rest by gain per byte (both
    descending); within each, parts whose restoring gains nothing come last."""
    def key(r: PartResult):
        gain, free = r.gain(), r.part.cost == 0
        if gain <= 0:
            return (0 if free else 1, 1, 0.0)
        return (0, 0, -gain) if free else (1, 0, -gain / r.part.cost)
    return [r.part for r in sorted(results, key=key)]


def search(probe: PartProbe, parts: list[Part], spec: BudgetSpec,
           progress=lambda msg: None) -> BudgetResult:
    """Measure every part (free ones alone, the others with every free part restored),
    then bisect the shortest prefix of the cheapest-first order whose restoring meets the
    budget (a prefix that meets it is a measurement, not an estimate). All parts restored
    not meeting it is a BudgetError."""
    base = probe.measure()
    progress(f"budget: as quantized {show(base)}")
    if spec.holds(base):
        return BudgetResult(spec, base, [], [], base)
    free = [p for p in parts if p.cost == 0]
    results = []
    for k, part in enumerate(free):
        progress(f"budget: part {k + 1}/{len(parts)} {part.name}")
        results.append(PartResult(part, probe.measure({part}), base))
    context = base  # what the parts that cost bytes are measured against
    if free:
        context = probe.measure(set(free))
        progress(f"budget: every free part restored: {show(context)}")
    for k, part in enumerate(p for p in parts if p.cost != 0):
        progress(f"budget: part {len(free) + k + 1}/{len(parts)} {part.name}")
        results.append(PartResult(part, probe.measure(set(free) | {part}), context))
    order = order_parts(results)
    trials: list[tuple[int, Measurement]] = []

    def meets(n: int) -> Measurement | None:
        m = probe.measure(set(order[:n]))
        trials.append((n, m))
        progress(f"budget: first {n} parts restored: {show(m)}")
        return m if spec.holds(m) else None

    best = meets(len(order))
    if best is None:
        raise BudgetError(f"budget ({spec.describe()}): even with every part restored the "
                          f"artifact measures {show(trials[-1][1])}; the rest is in parts "
                          "not offered (a bf16 LM head is never quantized by the budget). "
                          "Loosen the budget.")
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
    """The recipe entries that express `chosen`: weight_only and ignore names, KV off,
    and whether the LM head goes back to bf16."""
    weights = {n for p in chosen if p.kind == "weights" for n in p.modules}
    inputs = {n for p in chosen if p.kind == "inputs" for n in p.modules} - weights
    return {"weight_only": sorted(inputs), "ignore": sorted(weights - {"lm_head"}),
            "kv_off": any(p.kind == "kv" for p in chosen), "head_bf16": "lm_head" in weights}


def chosen_recipe(plain: Recipe, chosen: list[Part]) -> Recipe:
    """`plain` (a recipe without a budget) with the `chosen` parts restored: their
    weight_only and ignore names added, the KV cache off, an LM head with its own format
    back to `lm_head: bf16`."""
    ch = recipe_changes(chosen)
    head = ch["head_bf16"]
    return replace(plain, weight_only=tuple(plain.weight_only) + tuple(ch["weight_only"]),
                   ignore=tuple(plain.ignore) + tuple(ch["ignore"]) + (("lm_head",) if head else ()),
                   lm_head="bf16" if head and plain.lm_head else plain.lm_head,
                   kv_cache=replace(plain.kv_cache,
                                    enabled=plain.kv_cache.enabled and not ch["kv_off"]))
