"""int8 weight-only linears (`weights: {type: int8}`): the recipe's checks, the int8 grid,
GPTQ on it, compressed-tensors' pack-quantized layout (config and tensors), and a tiny
random Llama quantized, written, checked and loaded back as weight-only int8 layers."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qserve.calib.grids import GRIDS, weight_grid
from qserve.calib.hessian import HessianAccumulator
from qserve.calib.int8 import quantize_int8
from qserve.calib.observers import make_observer
from qserve.quantize.compressed_tensors import build_quantization_config
from qserve.quantize.gptq import gptq_fp8_shared, gptq_shared
from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import RecipeError, recipe_from_dict
from qserve.runtime.attention import AttentionMetadata, DenseAttention
from qserve.runtime.formats.artifact_reader import open_artifact
from qserve.runtime.formats.checkpoint import open_checkpoint
from qserve.runtime.formats.compressed_tensors import parse_quantization_config
from qserve.runtime.formats.errors import CheckpointError
from qserve.runtime.formats.manifest import Manifest
from qserve.runtime.formats.pack_quantized import pack_int8, packed_columns, unpack_int8
from qserve.runtime.layers.fp8_linear import Fp8Linear
from qserve.runtime.models.loader import load_model
from qserve.runtime.models.quantized_loader import load_quantized_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

SMALL = {"calibration": {"num_samples": 4, "seq_len": 64}}
INT8 = {**SMALL, "weights": {"type": "int8"}}
PROJ = "model.layers.0.mlp.up_proj"


# -- recipe ------------------------------------------------------------------------------
def test_int8_recipe_makes_every_quantized_linear_weight_only():
    r = recipe_from_dict(INT8)
    assert r.weights.type == "int8" and recipe_from_dict({}).weights.type == "fp8"
    assert r.is_weight_only(PROJ) and not r.has_static_input(PROJ)
    assert not r.is_weight_only("lm_head")  # ignored: not quantized at all
    assert r.to_dict()["weights"]["type"] == "int8"


@pytest.mark.parametrize("raw,message", [
    ({"weights": {"type": "int4"}}, "weights.type must be one of fp8, int8"),
    ({"weights": {"type": "int8"}, "smoothing": {"enabled": True}}, "smoothing.enabled false"),
    ({"weights": {"observer_args": {"grid": "int8"}}}, "cannot set grid"),
])
def test_bad_int8_recipes(raw, message):
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(raw)


# -- the int8 grid -------------------------------------------------------------------------
def test_int8_grid_rounds_symmetric_and_saturates():
    x = torch.tensor([[0.0, 0.5, 1.5, -2.5, 126.6, 127.4, 300.0, -1e9]])
    q = quantize_int8(x, torch.tensor(1.0))
    assert q.dtype == torch.int8
    assert q.tolist() == [[0, 0, 2, -2, 127, 127, 127, -127]]  # half to even; never -128
    w = torch.randn(16, 40, generator=torch.Generator().manual_seed(0))
    obs = make_observer("minmax", dim=0, grid="int8")
    obs.observe(w)
    scale = obs.scale().reshape(-1, 1)  # [16, 1]
    assert torch.allclose(scale.squeeze(1), w.abs().amax(1) / 127)
    codes = quantize_int8(w, scale)
    assert codes.abs().amax(1).eq(127).all()  # each row's amax on the grid's edge
    assert ((codes.float() * scale - w).abs() <= scale / 2 + 1e-7).all()
    assert weight_grid("int8") is GRIDS["int8"]


def test_mse_observer_measures_the_error_on_its_grid():
    x = torch.randn(4, 4096, generator=torch.Generator().manual_seed(1))
    for grid in ("fp8", "int8"):
        obs = make_observer("mse", dim=0, grid=grid)
        obs.observe(x)
        alphas, errs = obs.errors()  # [A], [A, C]
        g = weight_grid(grid)
        for a in (0, len(alphas) - 1):
            scale = (alphas[a] * x.abs().amax(1, keepdim=True) / g.qmax)  # [C, 1]
            want = (x - g.qdq(x, scale)).square().mean(1)
            assert torch.allclose(errs[a], want, rtol=1e-5)


# -- GPTQ ------------------------------------------------------------------------------------
def _problem(seed=0, out=48, n_in=96, tokens=2048):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n_in, generator=g)
    mix = torch.randn(n_in, n_in, generator=g) / n_in**0.5 + torch.eye(n_in)
    x = torch.randn(tokens, n_in, generator=g) @ mix  # correlated input features
    return w, x


def test_gptq_int8_lowers_output_error_on_correlated_inputs():
    w, x = _problem()
    scale = (w.abs().amax(1, keepdim=True) / 127).float()
    acc = HessianAccumulator(w.shape[1])
    acc.observe(x)
    (codes,) = gptq_shared([w], acc.hessian(), [scale], GRIDS["int8"], block_size=32)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    ref = x @ w.t()
    err_gptq = (x @ (codes.float() * scale).t() - ref).pow(2).mean()
    err_rtn = (x @ (quantize_int8(w, scale).float() * scale).t() - ref).pow(2).mean()
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)
    # with an identity Hessian nothing is compensated: the codes are round-to-nearest
    (same,) = gptq_shared([w], torch.eye(w.shape[1], dtype=torch.float64), [scale],
                          GRIDS["int8"], 32)
    assert torch.equal(same, quantize_int8(w, scale))
    # the FP8 entry point still gives E4M3 codes from the same algorithm
    (fp8,) = gptq_fp8_shared([w], acc.hessian(), [scale * 127 / 448], 32)
    assert fp8.dtype == torch.float8_e4m3fn


# -- pack-quantized ------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3, 4), (5, 8), (7, 13), (2, 64), (1, 1)])
def test_pack_round_trip(shape):
    codes = torch.randint(-127, 128, shape, dtype=torch.int8,
                          generator=torch.Generator().manual_seed(shape[1]))
    codes.view(-1)[:2] = torch.tensor([-127, 127], dtype=torch.int8)[:codes.numel()]
    packed = pack_int8(codes)
    assert packed.dtype == torch.int32 and packed.shape == (shape[0], packed_columns(shape[1]))
    assert torch.equal(unpack_int8(packed, shape[1]), codes)


def test_pack_layout_is_value_plus_128_low_byte_first():
    codes = torch.tensor([[-128, -1, 0, 127, 5]], dtype=torch.int8)
    packed = pack_int8(codes)  # bytes 0, 127, 128, 255 | 133, 0, 0, 0
    want = [0 | 127 << 8 | 128 << 16 | 255 << 24, 133]
    assert [int(v) & 0xFFFFFFFF for v in packed[0]] == want
    with pytest.raises(ValueError, match="int8"):
        pack_int8(codes.float())
    with pytest.raises(ValueError, match="int32"):
        unpack_int8(packed, 9)


def _compressed_tensors_helpers():
    """compressed-tensors' own pack helpers, loaded from their file alone (the package's
    __init__ pulls in transformers integrations this test needs none of)."""
    spec = importlib.util.find_spec("compressed_tensors")
    if spec is None or spec.origin is None:
        pytest.skip("compressed-tensors is not installed in this environment")
    path = Path(spec.origin).parent / "compressors" / "pack_quantized" / "helpers.py"
    if not path.is_file():
        pytest.skip(f"this compressed-tensors has no {path.name} for pack-quantized")
    mod_spec = importlib.util.spec_from_file_location("_ct_pack_helpers", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shape", [(6, 4), (7, 13), (4, 96)])
def test_pack_matches_compressed_tensors(shape):
    ct = _compressed_tensors_helpers()
    codes = torch.randint(-128, 128, shape, dtype=torch.int8,
                          generator=torch.Generator().manual_seed(7))
    assert torch.equal(pack_int8(codes), ct.pack_to_int32(codes, 8))
    assert torch.equal(unpack_int8(ct.pack_to_int32(codes, 8), shape[1]), codes)
    assert torch.equal(ct.unpack_from_int32(pack_int8(codes), 8, codes.shape), codes)


# -- config --------------------------------------------------------------------------------
def test_int8_config_is_pack_quantized_and_reads_back():
    recipe = recipe_from_dict({"weights": {"type": "int8", "granularity": "tensor"}})
    qc = build_quantization_config(recipe, ["lm_head"], [PROJ])  # weight_only: all anyway
    assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "pack-quantized")
    assert list(qc["config_groups"]) == ["group_0"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["dynamic"], w["strategy"],
            w["group_size"]) == (8, "int", True, False, "tensor", None)
    assert qc["ignore"] == ["lm_head"] and qc["kv_cache_scheme"]["type"] == "float"
    scheme = parse_quantization_config({"quantization_config": qc}, "config.json")
    assert scheme.weight_codes == "int8" and scheme.weight_strategy == "tensor"
    assert scheme.is_weight_only("model.layers.1.self_attn.q_proj")
    assert scheme.kv_strategy == "tensor"
    fp8 = parse_quantization_config(
        {"quantization_config": build_quantization_config(recipe_from_dict({}), [])}, "c")
    assert fp8.weight_codes == "e4m3" and not fp8.is_weight_only(PROJ)


@pytest.mark.parametrize("change,message", [
    (lambda qc: qc.update(format="int-quantized"), "pack-quantized format"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(symmetric=False),
     "static symmetric 8-bit"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=4),
     "static symmetric 8-bit"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="group",
                                                                group_size=128),
     "per channel or per tensor"),
    (lambda qc: qc["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "dynamic": True}),
     "dynamic symmetric 8-bit per token"),
    (lambda qc: qc["config_groups"].update(group_1=dict(qc["config_groups"]["group_0"])),
     "one config group targeting Linear"),
])
def test_int8_config_is_checked(change, message):
    qc = build_quantization_config(recipe_from_dict({"weights": {"type": "int8"}}), [])
    change(qc)
    with pytest.raises(CheckpointError, match=message):
        parse_quantization_config({"quantization_config": qc}, "config.json")


# -- a tiny model end to end ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("src") / "tiny")


@pytest.fixture(scope="module")
def int8_artifact(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "int8"
    quantize(str(tiny), out, recipe_from_dict(INT8), dtype=torch.float32)
    return out


def _rel_error(tiny, artifact, kv: bool = True) -> float:
    ref = load_model(open_checkpoint(tiny), torch.float32)
    qm = load_quantized_model(open_artifact(artifact), torch.float32)
    from qserve.runtime.fp8_kv_attention import Fp8KVAttention

    ids = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(1))
    meta = AttentionMetadata.single(40)
    attn = Fp8KVAttention(DenseAttention(), qm.kv_scales) if kv else DenseAttention()
    with torch.inference_mode():
        want = ref.compute_logits(ref(ids, torch.arange(40), meta, DenseAttention()))
        got = qm.model.compute_logits(qm.model(ids, torch.arange(40), meta, attn))
    return ((got - want).norm() / want.norm()).item()


def test_int8_artifact_layout(int8_artifact, tiny):
    qc = json.loads((int8_artifact / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["type"] == "int"
    src = open_checkpoint(tiny)
    with safe_open(str(int8_artifact / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for layer in range(2):
            for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                base = f"model.layers.{layer}.{proj}"
                out, n_in = src.tensor(f"{base}.weight").shape
                packed = f.get_tensor(f"{base}.weight_packed")
                assert packed.dtype == torch.int32 and packed.shape == (out, n_in // 4)
                assert f.get_tensor(f"{base}.weight_shape").tolist() == [out, n_in]
                scale = f.get_tensor(f"{base}.weight_scale")
                assert scale.dtype == torch.float32 and scale.shape == (out, 1)
                assert f"{base}.weight" not in names and f"{base}.input_scale" not in names
                codes = unpack_int8(packed, n_in)
                assert codes.abs().max() <= 127
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16


def test_int8_artifact_loads_weight_only_and_stays_close(int8_artifact, tiny):
    qm = load_quantized_model(open_artifact(int8_artifact), torch.float32)
    assert len(qm.quantized_modules) == 14
    down = qm.model.model.layers[0].mlp.down_proj
    assert isinstance(down, Fp8Linear) and down.codes == "int8" and down.weight_only
    assert down.input_scale is None
    assert 0 < _rel_error(tiny, int8_artifact) < 0.1


def test_rtn_int8_dequantizes_to_source_and_beats_fp8_weight_only(tiny, tmp_path):
    no_kv = {"algorithm": "rtn"}, {"enabled": False}
    out = tmp_path / "int8"
    quantize(str(tiny), out, recipe_from_dict({**SMALL, "weights": {"type": "int8", **no_kv[0]},
                                               "kv_cache": no_kv[1]}), dtype=torch.float32)
    w = open_checkpoint(tiny).tensor(f"{PROJ}.weight").float()
    ck = open_artifact(out).checkpoint
    s = ck.tensor(f"{PROJ}.weight_scale")  # [out, 1]
    q = unpack_int8(ck.tensor(f"{PROJ}.weight_packed"), w.shape[1])
    assert torch.allclose(s.squeeze(1), w.abs().amax(1) / 127)  # minmax per output channel
    assert torch.equal(q, quantize_int8(w, s))
    fp8 = tmp_path / "fp8"
    quantize(str(tiny), fp8, recipe_from_dict({**SMALL, "weights": no_kv[0],
                                               "kv_cache": no_kv[1], "weight_only": ["re:.*"]}),
             dtype=torch.float32)
    # 255 evenly spaced levels per channel against E4M3's 3 mantissa bits
    assert _rel_error(tiny, out, kv=False) < 0.6 * _rel_error(tiny, fp8, kv=False)


# -- broken artifacts ----------------------------------------------------------------------
def _tamper(src: Path, dst: Path, edit) -> Path:
    """A copy of the artifact at `src` with its tensors edited (the manifest re-signed)."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    manifest = Manifest.read(dst)
    manifest.record_files(dst)
    manifest.write(dst)
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update({f"{PROJ}.weight_packed": t[f"{PROJ}.weight_packed"].to(torch.int64)}),
     rf"{PROJ}.weight_packed must be int32"),
    (lambda t: t.update({f"{PROJ}.weight_packed": t[f"{PROJ}.weight_packed"][:, :-1].clone()}),
     rf"{PROJ}.weight_packed must be int32 \[128, 16\]"),
    (lambda t: t.update({f"{PROJ}.weight_shape": torch.tensor([64, 128])}),
     rf"{PROJ}.weight_shape must be"),
    (lambda t: t.update({f"{PROJ}.input_scale": torch.ones(1)}),
     rf"{PROJ}.input_scale is present but .* weight-only"),
    (lambda t: t.pop(f"{PROJ}.weight_shape"), "needs weight_packed, weight_shape"),
    (lambda t: t.update({f"{PROJ}.weight": torch.zeros(128, 64).to(torch.float8_e4m3fn)}),
     rf"{PROJ}.weight is present"),
    (lambda t: t.pop(f"{PROJ}.weight_scale"), "weight_packed, weight_shape but no weight_scale"),
    (lambda t: t.update({f"{PROJ}.weight_scale": torch.ones(3)}),
     rf"{PROJ}.weight_scale must be a float tensor"),
])
def test_broken_int8_artifact_is_named(int8_artifact, tmp_path, edit, message):
    bad = _tamper(int8_artifact, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_quantized_model(open_artifact(bad), torch.float32)


def test_int8_tensors_in_an_fp8_artifact_are_refused(int8_artifact, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(int8_artifact, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = build_quantization_config(recipe_from_dict({}), ["lm_head"])
    (bad / "config.json").write_text(json.dumps(cfg))
    manifest = Manifest.read(bad)
    manifest.record_files(bad)
    manifest.write(bad)
    with pytest.raises(CheckpointError, match="describes FP8 weights"):
        load_quantized_model(open_artifact(bad), torch.float32)


def test_a_budget_with_int8_weights_restores_weights_and_kv_only(tiny, tmp_path):
    """int8 linears are weight-only already: the budget has no input parts to offer, and
    what it keeps in bf16 is written as an ignore list beside the pack-quantized group."""
    out = tmp_path / "b"
    recipe = recipe_from_dict({**INT8, "budget": {"ppl": 0.0005, "num_samples": 2,
                                                  "seq_len": 48}})
    report = quantize(str(tiny), out, recipe, dtype=torch.float32)
    r = report.budget
    assert r is not None and r.parts
    assert sorted(res.part.kind for res in r.parts) == ["kv", "weights", "weights"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and list(qc["config_groups"]) == ["group_0"]
    qm = load_quantized_model(open_artifact(out), torch.float32)
    assert all(qm.model.get_submodule(n).codes == "int8" for n in qm.quantized_modules)
