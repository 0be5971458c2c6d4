"""W8A8 int8 (`weights: {type: int8}` with `activations: {dynamic: true}`): the recipe,
compressed-tensors' int-quantized config (what llm-compressor writes for W8A8 int8), a
tiny random Llama quantized, written, loaded back and run on the C kernel and on torch
with the same bits, and the refusals of broken configs."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qserve.kernels import native_int8_gemm
from qserve.quantize.compressed_tensors import build_quantization_config
from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import RecipeError, recipe_from_dict
from qserve.runtime.attention import AttentionMetadata, DenseAttention
from qserve.runtime.formats.artifact_reader import open_artifact
from qserve.runtime.formats.checkpoint import open_checkpoint
from qserve.runtime.formats.compressed_tensors import parse_quantization_config
from qserve.runtime.formats.errors import CheckpointError
from qserve.runtime.layers.fp8_linear import Fp8Linear
from qserve.runtime.layers.packing import pack_for_cpu
from qserve.runtime.models.loader import load_model
from qserve.runtime.models.quantized_loader import load_quantized_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

W8A8 = {"calibration": {"num_samples": 4, "seq_len": 64}, "weights": {"type": "int8"},
        "activations": {"dynamic": True}, "kv_cache": {"enabled": False}}
PROJ = "model.layers.0.mlp.up_proj"


def test_recipe_quantizes_inputs_and_keeps_named_linears_weight_only():
    r = recipe_from_dict({**W8A8, "weight_only": ["re:.*down_proj"], "lm_head": "int8"})
    assert not r.is_weight_only(PROJ) and not r.has_static_input(PROJ)
    assert r.is_weight_only("model.layers.0.mlp.down_proj") and r.is_weight_only("lm_head")
    with pytest.raises(RecipeError, match="smoothing"):
        recipe_from_dict({"weights": {"type": "int8"}, "smoothing": {"enabled": True}})


def test_config_is_int_quantized_and_reads_back():
    recipe = recipe_from_dict({**W8A8, "lm_head": "int8"})
    qc = build_quantization_config(recipe, [], ["model.layers.1.mlp.down_proj", "lm_head"])
    assert qc["format"] == "mixed-precision"
    main = qc["config_groups"]["group_0"]
    assert main["format"] == "int-quantized" and main["targets"] == ["Linear"]
    a = main["input_activations"]
    assert (a["type"], a["num_bits"], a["dynamic"], a["strategy"], a["symmetric"]) == \
        ("int", 8, True, "token", True)
    assert qc["config_groups"]["group_1"]["format"] == "pack-quantized"
    assert qc["config_groups"]["lm_head"]["input_activations"] is None
    scheme = parse_quantization_config({"quantization_config": qc}, "config.json")
    assert scheme.weight_codes == "int8" and scheme.dynamic_inputs
    assert not scheme.is_weight_only(PROJ) and scheme.reader_of(PROJ) == "int8-plain"
    assert scheme.is_weight_only("lm_head") and scheme.reader_of("lm_head") == "int8"
    assert scheme.reader_of("model.layers.1.mlp.down_proj") == "int8"


@pytest.mark.parametrize("change,message", [
    (lambda qc: qc["config_groups"]["group_0"]["input_activations"].update(strategy="tensor"),
     "per token"),
    (lambda qc: qc["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
     "dynamic symmetric"),
    (lambda qc: qc["config_groups"]["group_0"]["input_activations"].update(type="float"),
     "dynamic symmetric"),
    (lambda qc: qc.update(format="pack-quantized"), "int-quantized format"),
])
def test_broken_configs_are_named(change, message):
    qc = build_quantization_config(recipe_from_dict(W8A8), ["lm_head"])
    change(qc)
    with pytest.raises(CheckpointError, match=message):
        parse_quantization_config({"quantization_config": qc}, "config.json")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("src") / "tiny")


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "w8a8-int8"
    quantize(str(tiny), out, recipe_from_dict(W8A8), dtype=torch.float32)
    return out


def test_artifact_holds_int8_weights_and_no_input_scales(artifact, tiny):
    qc = json.loads((artifact / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "int-quantized"
    src = open_checkpoint(tiny)
    with safe_open(str(artifact / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        w = f.get_tensor(f"{PROJ}.weight")
        assert w.dtype == torch.int8 and w.shape == src.tensor(f"{PROJ}.weight").shape
        assert w.abs().max() <= 127
        assert f"{PROJ}.input_scale" not in names and f"{PROJ}.weight_packed" not in names


def _logits(model, ids):
    meta = AttentionMetadata.single(len(ids))
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids)), meta, DenseAttention()))


def test_loads_as_w8a8_int8_and_stays_close_to_the_source(artifact, tiny):
    qm = load_quantized_model(open_artifact(artifact), torch.float32)
    up = qm.model.get_submodule(PROJ)
    assert isinstance(up, Fp8Linear) and up.int8_inputs and not up.weight_only
    assert up.weight.dtype == torch.int8 and "int8 W8A8" in repr(up)
    ids = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(1))
    want = _logits(load_model(open_checkpoint(tiny), torch.float32), ids)
    got = _logits(qm.model, ids)
    assert 0 < ((got - want).norm() / want.norm()).item() < 0.1


@pytest.mark.skipif(native_int8_gemm.path() in (None, "portable"),
                    reason="no vectorised int8 kernel here")
def test_the_c_kernel_gives_the_torch_path_s_bits(artifact):
    """bf16 end to end: the packed model's hidden states (C kernel at every row count)
    against the same artifact's on torch's exact integer matmul (the LM head, packed for
    oneDNN on one side, sums in another order: not compared)."""
    ids = torch.randint(2, 300, (33,), generator=torch.Generator().manual_seed(2))
    ref = load_quantized_model(open_artifact(artifact), torch.bfloat16).model
    packed = load_quantized_model(open_artifact(artifact), torch.bfloat16).model
    pack_for_cpu(packed)
    up = packed.get_submodule(PROJ)
    assert up.c_int8_weight is not None and up.weight.dtype == torch.uint8
    meta = AttentionMetadata.single(len(ids))
    with torch.inference_mode():
        got, want = (m(ids, torch.arange(len(ids)), meta, DenseAttention()) for m in (packed, ref))
    assert torch.equal(got, want)


def _pack(tensors):  # the weight as pack-quantized tensors instead
    from qserve.runtime.formats.pack_quantized import pack_int8, weight_shape

    w = tensors.pop(f"{PROJ}.weight")
    tensors[f"{PROJ}.weight_packed"] = pack_int8(w)
    tensors[f"{PROJ}.weight_shape"] = weight_shape(w)


@pytest.mark.parametrize("edit,message", [
    (_pack, "int-quantized"),
    (lambda t: t.update({f"{PROJ}.weight": t[f"{PROJ}.weight"].float()}), "must be int8"),
    (lambda t: t.update({f"{PROJ}.weight": t[f"{PROJ}.weight"][:, :-4].contiguous()}),
     "must be int8"),
    (lambda t: t.update({f"{PROJ}.weight_scale": t[f"{PROJ}.weight_scale"][:3]}),
     "weight_scale must be a float tensor"),
])
def test_broken_w8a8_artifacts_are_named(artifact, tmp_path, edit, message):
    import shutil
    from safetensors.torch import load_file, save_file
    from qserve.runtime.formats.manifest import Manifest

    dst = tmp_path / "broken"
    shutil.copytree(artifact, dst)
    path = dst / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    manifest = Manifest.read(dst)
    manifest.record_files(dst)
    manifest.write(dst)
    with pytest.raises(CheckpointError, match=message):
        load_quantized_model(open_artifact(dst), torch.float32)


@pytest.mark.skipif(native_int8_gemm.path() in (None, "portable"),
                    reason="no vectorised int8 kernel here")
def test_a_w8a8_int8_head_gives_greedy_tokens_without_logits(tiny, tmp_path):
    """`ignore: []` puts the LM head in the Linear group (W8A8 int8 too): packed, its
    greedy tokens come from the kernel's running max and equal the logits' argmax."""
    out = tmp_path / "head"
    quantize(str(tiny), out, recipe_from_dict({**W8A8, "ignore": []}), dtype=torch.float32)
    model = load_quantized_model(open_artifact(out), torch.bfloat16).model
    pack_for_cpu(model)
    head = model.lm_head
    assert isinstance(head, Fp8Linear) and head.int8_inputs and head.c_int8_weight is not None
    hidden = torch.randn(6, head.in_features).to(torch.bfloat16)
    with torch.inference_mode():
        ids = head.greedy_ids(hidden)
        assert ids is not None and torch.equal(ids, model.compute_logits(hidden).argmax(-1))
        assert torch.equal(model.greedy_tokens(hidden), ids)


def test_the_shipped_w8a8_int8_recipe_loads_by_name():
    from qserve.quantize.recipe import load_recipe, presets

    assert "w8a8-int8" in presets()
    r = load_recipe("w8a8-int8")
    assert r.weights.type == "int8" and r.activations.dynamic and not r.kv_cache.enabled
    assert not r.is_ignored("lm_head") and not r.is_weight_only("lm_head")
    assert not r.is_weight_only(PROJ)
    with pytest.raises(RecipeError, match="w8a8-int8"):
        load_recipe("no-such-recipe")


def test_smoothing_is_allowed_with_int8_inputs_and_stays_close(tiny, tmp_path):
    """Smoothing moves input outliers into the weights; with int8 inputs (unlike int8
    weight-only) the recipe takes it, and the artifact stays near the source."""
    out = tmp_path / "smooth"
    quantize(str(tiny), out, recipe_from_dict({**W8A8, "smoothing": {"enabled": True}}),
             dtype=torch.float32)
    qm = load_quantized_model(open_artifact(out), torch.float32)
    assert qm.model.get_submodule(PROJ).int8_inputs
    ids = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(1))
    want = _logits(load_model(open_checkpoint(tiny), torch.float32), ids)
    got = _logits(qm.model, ids)
    assert 0 < ((got - want).norm() / want.norm()).item() < 0.1
