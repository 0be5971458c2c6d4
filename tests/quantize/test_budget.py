"""The quality budget (quantize/budget.py, quantize/part_probe.py): the measurement against
the source on a tiny model, the search's choice on known part effects, and
`qserve quantize --budget` end to end."""

import json
import sys
from pathlib import Path

import pytest
import torch

from qserve.quantize.budget import (BudgetError, BudgetSpec, Part, PartResult, enumerate_parts,
                                    order_parts, recipe_changes, search)
from qserve.quantize.part_probe import Measurement, PartProbe
from qserve.quantize.pipeline import format_report, quantize
from qserve.quantize.recipe import RecipeError, recipe_from_dict
from qserve.runtime.layers.fp8_linear import Fp8Linear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

SMALL = {"calibration": {"num_samples": 4, "seq_len": 64}}


@pytest.mark.parametrize("text,ppl,kl", [("ppl=+1%", 0.01, 0), ("ppl=2.5%", 0.025, 0),
                                         ("ppl=0.004", 0.004, 0), (" ppl = +0.5 % ", 0.005, 0),
                                         ("kl=0.004", 0, 0.004), ("ppl=+1%, kl=.01", 0.01, 0.01),
                                         ("kl=0.002,ppl=2%", 0.02, 0.002)])
def test_budget_spec_parses(text, ppl, kl):
    spec = BudgetSpec.parse(text)
    assert (spec.ppl, spec.kl) == (pytest.approx(ppl), pytest.approx(kl))


@pytest.mark.parametrize("text", ["kl=", "ppl=", "ppl=-1%", "ppl=150%", "ppl=0", "1%", "kl=0",
                                  "kl=20", "ppl=1%,ppl=2%", "ppl=1%,", "ce=0.1"])
def test_bad_budget_spec_is_named(text):
    with pytest.raises(BudgetError, match="budget"):
        BudgetSpec.parse(text)


@pytest.mark.parametrize("raw,message", [({"budget": {"ppl": 1.5}}, "budget.ppl must be in"),
                                         ({"budget": {"seq_len": 4}}, "budget.seq_len must be >= 16"),
                                         ({"budget": {"kl": -0.1}}, "budget.kl must be in"),
                                         ({"budget": {"tokens": 4}}, "unknown key budget.tokens")])
def test_bad_budget_recipe(raw, message):
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(raw)


def _m(ppl):
    return Measurement(kl=ppl / 10, ppl_increase=ppl, nll_per_word=1.0)


class FakeProbe:
    """Known part effects: restoring a part removes its share of the increase (additive)."""

    def __init__(self, base, shares):
        self.base, self.shares, self.calls = base, shares, []

    def measure(self, restored=frozenset()):
        self.calls.append({p.name for p in restored})
        return _m(self.base - sum(self.shares[p.name] for p in restored))


PARTS = [Part("layers.0.inputs", "inputs", ("a",)), Part("layers.1.inputs", "inputs", ("b",)),
         Part("kv", "kv", layers=(0, 1), cost=100),
         Part("layers.0.weights", "weights", ("a",), cost=1000),
         Part("layers.1.weights", "weights", ("b",), cost=4000)]


def test_search_takes_the_free_parts_first_then_gain_per_byte():
    shares = {"layers.0.inputs": 0.001, "layers.1.inputs": 0.010, "kv": 0.004,
              "layers.0.weights": 0.003, "layers.1.weights": 0.008}
    probe = FakeProbe(0.030, shares)
    result = search(probe, PARTS, BudgetSpec(0.012))
    # order: inputs by gain (1.inputs, 0.inputs), kv (gain/byte 4e-5), 1.weights (2e-6),
    # 0.weights (3e-6 -> before 1.weights)
    assert [p.name for p in order_parts(result.parts)] == [
        "layers.1.inputs", "layers.0.inputs", "kv", "layers.0.weights", "layers.1.weights"]
    # 0.030 - 0.010 - 0.001 - 0.004 = 0.015 > 0.012; + 0.003 = 0.012 meets it
    assert [p.name for p in result.chosen] == [
        "layers.1.inputs", "layers.0.inputs", "kv", "layers.0.weights"]
    assert result.chosen_measured.ppl_increase == pytest.approx(0.012)
    assert {"layers.1.inputs", "layers.0.inputs", "kv"} in probe.calls  # a failing prefix
    changes = recipe_changes(result.chosen)
    assert changes == {"weight_only": ["b"], "ignore": ["a"], "kv_off": True, "head_bf16": False}
    assert "layers.0.weights" in "\n".join(result.table())
    assert result.met is None  # the written artifact is measured by the pipeline
    result.final = _m(0.02)  # re-quantized with the chosen parts, it can still miss
    assert result.met is False and "budget NOT met" in "\n".join(result.table())


def test_search_stops_at_nothing_when_the_artifact_meets_the_budget_and_refuses_the_impossible():
    assert search(FakeProbe(0.005, {}), PARTS, BudgetSpec(0.01)).chosen == []
    shares = {p.name: 0.001 for p in PARTS}
    with pytest.raises(BudgetError, match="even with every part restored"):
        search(FakeProbe(0.050, shares), PARTS, BudgetSpec(0.01))


class NoisyPplProbe:
    """KL falls by each restored part's share; word perplexity does not follow it (as on a
    small model over a few thousand tokens)."""

    def __init__(self, kl, shares, ppl):
        self.kl, self.shares, self.ppl = kl, shares, ppl

    def measure(self, restored=frozenset()):
        names = frozenset(p.name for p in restored)
        return Measurement(kl=self.kl - sum(self.shares[n] for n in names),
                           ppl_increase=self.ppl.get(names, 0.05), nll_per_word=1.0)


def test_a_kl_budget_orders_and_stops_by_kl_and_both_bounds_must_hold():
    shares = {"layers.0.inputs": 0.002, "layers.1.inputs": 0.010, "kv": 0.004,
              "layers.0.weights": 0.003, "layers.1.weights": 0.008}
    # restoring layers.0.inputs alone "gains" the most perplexity: noise the order ignores
    ppl = {frozenset({"layers.0.inputs"}): 0.0}
    probe = NoisyPplProbe(0.030, shares, ppl)
    result = search(probe, PARTS, BudgetSpec(kl=0.012))
    assert [p.name for p in order_parts(result.parts)][:2] == [
        "layers.1.inputs", "layers.0.inputs"]
    # 0.030 - 0.010 - 0.002 - 0.004 = 0.014 > 0.012; + 0.003 = 0.011 meets it
    assert [p.name for p in result.chosen] == [
        "layers.1.inputs", "layers.0.inputs", "kv", "layers.0.weights"]
    assert result.chosen_measured.kl == pytest.approx(0.011)
    result.final = Measurement(kl=0.0115, ppl_increase=0.05, nll_per_word=1.0)
    assert result.met is True  # perplexity is not bounded by this budget
    table = "\n".join(result.table())
    assert "KL within 0.0120" in table and "word perplexity within" not in table
    # both bounded: the same KL with perplexity over its bound does not meet it
    assert not BudgetSpec(ppl=0.01, kl=0.012).holds(result.final)
    assert BudgetSpec(ppl=0.06, kl=0.012).holds(result.final)
    with pytest.raises(BudgetError, match="a budget bounds"):
        BudgetSpec()


def test_order_puts_parts_that_gain_nothing_last_among_their_kind():
    base = _m(0.02)
    results = [PartResult(PARTS[0], _m(0.021), base), PartResult(PARTS[3], _m(0.01), base),
               PartResult(PARTS[1], _m(0.019), base), PartResult(PARTS[4], _m(0.03), base)]
    assert [p.name for p in order_parts(results)] == [
        "layers.1.inputs", "layers.0.inputs", "layers.0.weights", "layers.1.weights"]


class InteractingProbe:
    """Parts whose effects do not add up: restoring layer 1's weights alone in the all-FP8
    artifact makes it worse (errors that cancelled no longer do), but once the inputs are
    unquantized it removes the most; layer 0's weights help a little either way."""

    def measure(self, restored=frozenset()):
        names = {p.name for p in restored}
        inputs = {"layers.0.inputs", "layers.1.inputs"} <= names
        kl = 0.030 - 0.004 * ("layers.0.inputs" in names) - 0.004 * ("layers.1.inputs" in names)
        kl -= 0.002 * ("layers.0.weights" in names)
        if "layers.1.weights" in names:
            kl += -0.015 if inputs else 0.005
        kl -= 0.001 * ("kv" in names)
        return Measurement(kl=kl, ppl_increase=kl, nll_per_word=1.0)


def test_parts_that_cost_bytes_are_ranked_with_the_free_parts_restored():
    result = search(InteractingProbe(), PARTS, BudgetSpec(kl=0.006))
    by_name = {r.part.name: r for r in result.parts}
    # the free parts alone, the others on top of both inputs restored (0.022)
    assert by_name["layers.0.inputs"].reference.kl == pytest.approx(0.030)
    assert by_name["layers.1.weights"].reference.kl == pytest.approx(0.022)
    assert by_name["layers.1.weights"].gain() == pytest.approx(0.015)
    # per byte: layers.1.weights 0.015 / 4000 > layers.0.weights 0.002 / 1000 > kv's
    # 0.001 / 100 is larger still: kv first
    assert [p.name for p in order_parts(result.parts)] == [
        "layers.0.inputs", "layers.1.inputs", "kv", "layers.1.weights", "layers.0.weights"]
    # 0.022 - 0.001 - 0.015 = 0.006 meets it without layer 0's weights
    assert [p.name for p in result.chosen] == ["layers.0.inputs", "layers.1.inputs", "kv",
                                               "layers.1.weights"]
    assert "free parts measured alone" in "\n".join(result.table())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    src = write_tiny_llama(root / "src", num_hidden_layers=2)
    # bf16 like every real source: the artifact's bf16 norms and embedding are then its own
    from safetensors.torch import load_file, save_file
    weights = load_file(str(src / "model.safetensors"))
    save_file({k: v.bfloat16() for k, v in weights.items()}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    art = root / "art"
    quantize(str(src), art, recipe_from_dict(SMALL), dtype=torch.float32)
    return src, art


def test_restoring_every_part_gives_the_source_back(tiny):
    """The oracle: with every linear and the KV cache restored (the LM head is bf16
    already), the artifact computes the source's function: KL ~ 0."""
    src, art = tiny
    rows = torch.randint(2, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    probe = PartProbe(str(art), str(src), rows, words=30)
    model = probe.art.model
    quantized = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    parts = enumerate_parts(model, quantized, sorted(probe.art.kv_scales), kv_cost=10)
    assert sorted(p.name for p in parts) == ["kv", "layers.0.inputs", "layers.0.weights",
                                             "layers.1.inputs", "layers.1.weights"]
    assert all(len(p.modules) == 7 for p in parts if p.kind != "kv")
    base = probe.measure()
    assert base.kl > 1e-5
    everything = probe.measure(set(parts))
    assert everything.kl < 1e-9 and abs(everything.ppl_increase) < 1e-9
    inputs_only = probe.measure({p for p in parts if p.kind == "inputs"})
    assert 0 < inputs_only.kl < base.kl  # weights and KV still FP8
    # measure restores nothing permanently: the artifact is measured again alike
    assert probe.measure() == base
    assert all(isinstance(m, Fp8Linear) and not m.weight_only
               for n, m in model.named_modules() if n in quantized)


def test_quantize_with_a_budget_writes_the_chosen_recipe(tiny, tmp_path):
    src, _ = tiny
    out = tmp_path / "b"
    recipe = recipe_from_dict({**SMALL, "budget": {"ppl": 0.002, "num_samples": 2,
                                                   "seq_len": 48}})
    report = quantize(str(src), out, recipe, dtype=torch.float32)
    r = report.budget
    assert r is not None and r.base.ppl_increase > 0.002 and r.chosen
    assert r.chosen_measured.ppl_increase <= 0.002 and r.final is not None
    manifest = json.loads((out / "qserve.json").read_text())
    rec = manifest["summary"]["budget"]
    assert rec["ppl"] == 0.002 and rec["chosen"] == [p.name for p in r.chosen]
    assert rec["met"] == (r.final.ppl_increase <= 0.002) == r.met
    assert rec["artifact"]["ppl_increase"] == pytest.approx(r.final.ppl_increase)
    changes = recipe_changes(r.chosen)
    assert manifest["recipe"]["weight_only"] == changes["weight_only"]
    assert manifest["recipe"]["ignore"] == ["lm_head", *changes["ignore"]]
    assert manifest["recipe"]["budget"]["ppl"] == 0.0  # the recipe written is the chosen one
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    if changes["weight_only"]:
        assert qc["config_groups"]["group_1"]["targets"] == changes["weight_only"]
    assert (qc["kv_cache_scheme"] is None) == changes["kv_off"]
    assert "budget: word perplexity within +0.20%" in format_report(report)
    # what the kept parts cost in decode speed: both artifacts timed, batch 1 and 16
    for rates in (r.decode_base, r.decode_final):
        assert [d.batch for d in rates] == [1, 16] and all(d.tokens_per_s > 0 for d in rates)
    assert set(rec["decode_tokens_per_s"]["artifact"]) == {"1", "16"}
    assert "decode: nothing restored" in format_report(report)
    from qserve.quantize.builtin_artifact import made_with
    assert made_with(out, recipe)  # the recipe asked for, not only the one chosen


@pytest.mark.parametrize("weights", ["fp8", "int8"])
def test_a_budget_the_plain_recipe_meets_keeps_its_artifact(tiny, tmp_path, monkeypatch, weights):
    """Nothing to restore: the all-FP8 (or int8) artifact is the one written, measured
    once and quantized once, and --force replaces an existing directory with it."""
    from qserve.quantize import pipeline

    src, _ = tiny
    out = tmp_path / "b"
    out.mkdir()
    (out / "old-file").write_text("x")
    calls = []
    real = pipeline.quantize
    monkeypatch.setattr(pipeline, "quantize", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    recipe = recipe_from_dict({**SMALL, "weights": {"type": weights},
                               "budget": {"ppl": 0.9, "kl": 5.0, "num_samples": 2, "seq_len": 48}})
    with pytest.raises(Exception, match="already exists"):
        real(str(src), out, recipe, dtype=torch.float32)
    report = real(str(src), out, recipe, dtype=torch.float32, force=True)
    r = report.budget
    assert r.chosen == [] and r.met and r.final == r.base
    assert len(calls) == 1 and calls[0].name == "all-fp8"  # one quantize, into the scratch
    assert report.out_dir == out and not (out / "old-file").exists()
    manifest = json.loads((out / "qserve.json").read_text())
    assert manifest["summary"]["budget"]["chosen"] == []
    assert manifest["recipe"]["weights"]["type"] == weights
    assert "(the same artifact)" in format_report(report)
    # a built-in recipe with this budget recognises its artifact; another budget does not
    from dataclasses import replace

    from qserve.quantize.builtin_artifact import made_with
    assert made_with(out, recipe) and not made_with(out, replace(
        recipe, budget=replace(recipe.budget, kl=4.0)))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".b.")]  # scratch, old gone
    from qserve.runtime.llm import LLM
    from qserve.runtime.sampling_params import SamplingParams
    assert LLM(str(out)).generate(["a b"], SamplingParams(max_tokens=2))[0].token_ids
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".b.budget-")]  # scratch gone


def test_a_budget_on_w8a8_int8_gives_layers_their_inputs_back_as_int8_weight_only(tiny, tmp_path):
    """W8A8 int8 (int8 weights, int8 inputs per row): a layer's inputs are a free part,
    restored as the same int8 weights with the input as it comes (W8A16). A budget just
    under the plain artifact's KL takes the most sensitive layer's inputs back, and the
    artifact written serves that layer W8A16 and the other W8A8."""
    from qserve.runtime.loaded_model import load

    src, _ = tiny
    w8a8 = {**SMALL, "weights": {"type": "int8"}, "activations": {"dynamic": True},
            "kv_cache": {"enabled": False}}
    probe = {"num_samples": 2, "seq_len": 48}
    plain = quantize(str(src), tmp_path / "plain", recipe_from_dict(
        {**w8a8, "budget": {"kl": 5.0, **probe}}), dtype=torch.float32).budget
    assert plain.chosen == [] and plain.base.kl > 0  # measured once, nothing to restore
    kl = plain.base.kl * 0.99
    report = quantize(str(src), tmp_path / "b", recipe_from_dict(
        {**w8a8, "budget": {"kl": kl, **probe}}), dtype=torch.float32)
    r = report.budget
    assert r.base.kl == pytest.approx(plain.base.kl)  # the same scratch artifact
    inputs = [x for x in r.parts if x.part.kind == "inputs"]
    assert sorted(x.part.name for x in inputs) == ["layers.0.inputs", "layers.1.inputs"]
    assert all(x.gain() > 0 for x in inputs)  # int8 inputs cost KL in both layers
    assert [p.name for p in r.chosen] == [max(inputs, key=PartResult.gain).part.name]
    assert r.chosen_measured.kl <= kl
    layer = r.chosen[0].name.split(".")[1]
    manifest = json.loads((tmp_path / "b" / "qserve.json").read_text())
    assert manifest["recipe"]["weight_only"] == sorted(r.chosen[0].modules)
    model = load(str(tmp_path / "b"), torch.float32).model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(linears) == 14 and all(m.codes == "int8" for m in linears.values())
    for name, m in linears.items():
        kept = f".layers.{layer}." in name
        assert (m.weight_only, m.int8_inputs) == (kept, not kept), name
