"""The LM head as a part with its own format (recipe `lm_head: int8 | fp8 | bf16`): the
recipe's checks, the compressed-tensors config it writes (a group of its own; a
"mixed-precision" config when its format differs from the linears'), a tiny Llama with
FP8 W8A8 linears and an int8 head quantized, loaded and served, and the quality budget
offering the head as a part."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qserve.quantize.budget import Part, chosen_recipe, enumerate_parts, recipe_changes
from qserve.quantize.compressed_tensors import build_quantization_config
from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import RecipeError, recipe_from_dict
from qserve.runtime.attention import AttentionMetadata, DenseAttention
from qserve.runtime.formats.artifact_reader import open_artifact
from qserve.runtime.formats.checkpoint import open_checkpoint
from qserve.runtime.formats.compressed_tensors import parse_quantization_config
from qserve.runtime.formats.errors import CheckpointError
from qserve.runtime.formats.pack_quantized import unpack_int8
from qserve.runtime.layers.fp8_linear import Fp8Linear
from qserve.runtime.models.loader import load_model
from qserve.runtime.models.quantized_loader import load_quantized_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

SMALL = {"calibration": {"num_samples": 4, "seq_len": 64}}
PROJ = "model.layers.0.mlp.up_proj"


# -- recipe ------------------------------------------------------------------------------
def test_an_int8_head_is_weight_only_per_row_whatever_the_linears_are():
    r = recipe_from_dict({"lm_head": "int8", "weights": {"granularity": "tensor"}})
    assert r.ignore == () and not r.is_ignored("lm_head")  # ignore's default drops it
    assert (r.weight_type("lm_head"), r.weight_granularity("lm_head")) == ("int8", "channel")
    assert r.is_weight_only("lm_head") and not r.has_static_input("lm_head")
    # the linears keep the recipe's scheme
    assert (r.weight_type(PROJ), r.weight_granularity(PROJ)) == ("fp8", "tensor")
    assert not r.is_weight_only(PROJ) and r.has_static_input(PROJ)
    fp8 = recipe_from_dict({"lm_head": "fp8"})
    assert fp8.weight_type("lm_head") == "fp8" and fp8.is_weight_only("lm_head")
    bf16 = recipe_from_dict({"lm_head": "bf16"})
    assert bf16.is_ignored("lm_head") and bf16.ignore == ("lm_head",)
    assert recipe_from_dict({"lm_head": "bf16", "ignore": ["lm_head"]}) == bf16


@pytest.mark.parametrize("raw", [{}, {"lm_head": "int8"}, {"lm_head": "bf16"},
                                 {"lm_head": "fp8", "ignore": ["re:.*down_proj"]},
                                 {"weights": {"type": "int8"}, "ignore": []}])
def test_the_recipe_reads_back_from_its_manifest_form(raw):
    r = recipe_from_dict(raw)
    assert recipe_from_dict(r.to_dict()) == r
    assert ("lm_head" in r.to_dict()) == ("lm_head" in raw)  # older manifests read the same


@pytest.mark.parametrize("raw,message", [
    ({"lm_head": "int4"}, "lm_head must be one of int8, fp8, bf16"),
    ({"lm_head": 8}, "lm_head must be one of"),
    ({"lm_head": "int8", "ignore": ["lm_head"]}, "lm_head is int8 but ignore keeps lm_head"),
])
def test_bad_head_formats_are_named(raw, message):
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(raw)


# -- config --------------------------------------------------------------------------------
def test_an_int8_head_beside_fp8_linears_is_a_mixed_precision_config_that_reads_back():
    recipe = recipe_from_dict({"lm_head": "int8"})
    qc = build_quantization_config(recipe, [], ["lm_head"])
    assert qc["format"] == "mixed-precision"
    groups = qc["config_groups"]
    assert groups["group_0"]["targets"] == ["Linear"]
    assert groups["group_0"]["format"] == "float-quantized"
    head = groups["lm_head"]
    assert head["targets"] == ["lm_head"] and head["format"] == "pack-quantized"
    assert head["input_activations"] is None
    w = head["weights"]
    assert (w["type"], w["num_bits"], w["strategy"], w["symmetric"]) == ("int", 8, "channel", True)
    assert "group_1" not in groups  # the head is not also among the FP8 weight-only ones
    scheme = parse_quantization_config({"quantization_config": qc}, "config.json")
    assert scheme.weight_codes == "e4m3" and scheme.codes_of(PROJ) == "e4m3"
    assert scheme.codes_of("lm_head") == "int8" and scheme.is_weight_only("lm_head")
    assert not scheme.is_weight_only(PROJ)


def test_an_fp8_head_is_its_own_weight_only_group_in_one_format():
    recipe = recipe_from_dict({"lm_head": "fp8", "weight_only": [PROJ]})
    qc = build_quantization_config(recipe, [], ["lm_head", PROJ])
    assert qc["format"] == "float-quantized"
    assert all("format" not in g for g in qc["config_groups"].values())  # said once
    assert qc["config_groups"]["group_1"]["targets"] == [PROJ]
    assert qc["config_groups"]["lm_head"]["weights"]["type"] == "float"
    scheme = parse_quantization_config({"quantization_config": qc}, "config.json")
    assert scheme.codes_of("lm_head") == "e4m3"
    assert scheme.is_weight_only("lm_head") and scheme.is_weight_only(PROJ)


def test_a_plain_recipes_config_is_unchanged_by_the_head_option():
    qc = build_quantization_config(recipe_from_dict({}), ["lm_head"])
    assert qc["format"] == "float-quantized" and list(qc["config_groups"]) == ["group_0"]
    assert "format" not in qc["config_groups"]["group_0"]


@pytest.mark.parametrize("change,message", [
    (lambda g: g["lm_head"].update(format="float-quantized"), "pack-quantized format"),
    (lambda g: g["lm_head"].update(targets=["re:.*head"]), "must name its modules"),
    (lambda g: g["lm_head"].update(input_activations=dict(g["group_0"]["input_activations"])),
     "only the Linear group may"),
    (lambda g: g.pop("group_0"), "one config group targeting Linear"),
])
def test_a_broken_head_group_is_named(change, message):
    qc = build_quantization_config(recipe_from_dict({"lm_head": "int8"}), [], [])
    change(qc["config_groups"])
    with pytest.raises(CheckpointError, match=message):
        parse_quantization_config({"quantization_config": qc}, "config.json")


# -- a tiny model end to end ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("src") / "tiny")


@pytest.fixture(scope="module")
def head_artifacts(tiny, tmp_path_factory):
    """The default FP8 recipe (bf16 head) and the same with an int8 head."""
    root = tmp_path_factory.mktemp("art")
    out = {}
    for name, raw in (("bf16", {}), ("int8", {"lm_head": "int8"})):
        quantize(str(tiny), root / name, recipe_from_dict({**SMALL, **raw}), dtype=torch.float32)
        out[name] = root / name
    return out


def _logits(model, ids, kv_scales=None):
    from qserve.runtime.fp8_kv_attention import Fp8KVAttention

    meta = AttentionMetadata.single(len(ids))
    attn = Fp8KVAttention(DenseAttention(), kv_scales) if kv_scales else DenseAttention()
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids)), meta, attn))


def test_the_int8_head_is_written_packed_and_runs_as_an_int8_linear(head_artifacts, tiny):
    art = head_artifacts["int8"]
    with safe_open(str(art / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        packed, scale = f.get_tensor("lm_head.weight_packed"), f.get_tensor("lm_head.weight_scale")
        assert "lm_head.weight" not in names and "lm_head.input_scale" not in names
        assert f.get_tensor(f"{PROJ}.weight").dtype == torch.float8_e4m3fn  # linears FP8
        assert f"{PROJ}.input_scale" in names
    w = open_checkpoint(tiny).tensor("lm_head.weight").float()  # [vocab, hidden]
    assert scale.shape == (w.shape[0], 1)  # one scale a vocabulary row
    # each row's own scale: its largest weight at code 127 (minmax)
    assert torch.allclose(scale.reshape(-1), w.abs().amax(1) / 127, rtol=1e-5)
    codes = unpack_int8(packed, w.shape[1])
    assert codes.abs().max() <= 127 and (codes.abs().amax(1) >= 100).all()
    deq = codes.float() * scale
    assert (deq - w).norm() / w.norm() < 0.02  # GPTQ moves codes, not far
    qm = load_quantized_model(open_artifact(art), torch.float32)
    head = qm.model.lm_head
    assert isinstance(head, Fp8Linear) and head.codes == "int8" and head.weight_only
    proj = qm.model.get_submodule(PROJ)
    assert proj.codes == "e4m3" and not proj.weight_only
    assert "lm_head" in qm.quantized_modules


def test_the_int8_head_costs_little_against_the_bf16_head(head_artifacts, tiny):
    ref = load_model(open_checkpoint(tiny), torch.float32)
    ids = torch.randint(2, 300, (48,), generator=torch.Generator().manual_seed(3))
    want = _logits(ref, ids)
    err = {}
    for name, art in head_artifacts.items():
        qm = load_quantized_model(open_artifact(art), torch.float32)
        got = _logits(qm.model, ids, qm.kv_scales)
        err[name] = ((got - want).norm() / want.norm()).item()
    assert 0 < err["bf16"] < 0.1
    assert err["int8"] < err["bf16"] + 0.02  # the head adds a little to the linears' error


def test_an_engine_serves_the_int8_head_artifact_greedily(head_artifacts):
    """The served path (bf16, packed weights, the C decode path and the int8 head's C
    kernel) against the artifact's own fp32 forward: every greedy token it picks is the
    forward's argmax or within a rounding difference of it."""
    from qserve.runtime.engine import EngineConfig
    from qserve.runtime.llm import LLM
    from qserve.runtime.sampling_params import SamplingParams

    art = str(head_artifacts["int8"])
    llm = LLM(art, dtype=torch.bfloat16, config=EngineConfig(num_kv_blocks=16))
    assert llm.lm.model.lm_head.codes == "int8"
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                ignore_eos=True))[0]
    served = out.token_ids  # the generated tokens
    assert len(served) == 12
    qm = load_quantized_model(open_artifact(art), torch.float32)
    ids = torch.tensor(prompt + served)
    lp = torch.log_softmax(_logits(qm.model, ids, qm.kv_scales)[len(prompt) - 1:-1], -1)
    gap = lp.max(-1).values - lp.gather(1, torch.tensor(served).reshape(-1, 1)).reshape(-1)
    assert (gap <= 0.02).all(), gap  # a garbled head picks far from the argmax


def test_the_budget_offers_a_quantized_head_as_a_part_priced_in_bytes(head_artifacts):
    qm = load_quantized_model(open_artifact(head_artifacts["int8"]), torch.float32)
    model = qm.model
    quantized = set(qm.quantized_modules)
    parts = enumerate_parts(model, quantized, sorted(qm.kv_scales), 1000)
    head = [p for p in parts if p.name == "lm_head.weights"]
    vocab, hidden = model.lm_head.weight.shape
    assert head == [Part("lm_head.weights", "weights", ("lm_head",), cost=vocab * hidden)]
    ch = recipe_changes(head)
    assert ch["head_bf16"] and ch["ignore"] == []  # bf16 again: lm_head: bf16, not an ignore
    plain = load_quantized_model(open_artifact(head_artifacts["bf16"]), torch.float32)
    parts = enumerate_parts(plain.model, set(plain.quantized_modules), [], 0)
    assert not [p for p in parts if p.name == "lm_head.weights"]  # a bf16 head: no part


@pytest.mark.parametrize("raw", [{"lm_head": "int8"}, {"lm_head": "fp8"},
                                 {"weights": {"type": "int8"}, "ignore": []}])
def test_a_budget_that_keeps_the_head_writes_it_back_in_bf16(raw):
    """The recipe the budget quantizes again when it chose the head: a bf16 head (no group
    of its own, lm_head ignored), read back the same from its manifest form."""
    head = Part("lm_head.weights", "weights", ("lm_head",), cost=10)
    layer = Part("layers.0.weights", "weights", (PROJ,), cost=10)
    plain = recipe_from_dict(raw)
    final = chosen_recipe(plain, [head, layer])
    assert final.is_ignored("lm_head") and final.is_ignored(PROJ)
    assert not final.is_weight_only("lm_head")
    assert recipe_from_dict(final.to_dict()) == final
    qc = build_quantization_config(final, ["lm_head", PROJ], [])
    assert "lm_head" not in qc["config_groups"] and "lm_head" in qc["ignore"]
    kept = chosen_recipe(plain, [layer])  # the head not chosen: as the recipe has it
    assert kept.lm_head == plain.lm_head and not kept.is_ignored("lm_head")
