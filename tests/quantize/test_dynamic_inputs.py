"""Dynamic per-token FP8 inputs (`activations: {dynamic: true}`): the layer against a
float64 reference, the compressed-tensors layout it writes and reads, and an artifact of a
tiny random Llama that loads, fuses and runs the same as its unfused self."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qserve.quantize.compressed_tensors import build_quantization_config
from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import recipe_from_dict
from qserve.runtime.attention import AttentionMetadata, DenseAttention
from qserve.runtime.formats.artifact_reader import open_artifact
from qserve.runtime.formats.compressed_tensors import parse_quantization_config
from qserve.runtime.formats.errors import CheckpointError
from qserve.kernels.fp8 import MIN_TOKEN_SCALE, quantize_per_token
from qserve.runtime.layers.fp8_linear import Fp8Linear
from qserve.runtime.layers.fusion import fuse_projections
from qserve.runtime.models.quantized_loader import load_quantized_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

DYNAMIC = {"activations": {"dynamic": True}, "calibration": {"num_samples": 4, "seq_len": 64}}


def _reference(x, w_fp8, w_scale):  # float64: per-row E4M3 rounding, then the product
    x64 = x.double()
    scale = (x64.abs().amax(-1, keepdim=True) / 448).clamp(min=MIN_TOKEN_SCALE)
    q = (x64 / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
    return (q @ w_fp8.double().t()) * scale * w_scale.double().reshape(1, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_linear_matches_a_float64_reference(dtype):
    g = torch.Generator().manual_seed(0)
    w_fp8 = (torch.randn(48, 64, generator=g) * 2).to(torch.float8_e4m3fn)
    w_scale = torch.rand(48, 1, generator=g) * 0.01 + 1e-3
    x = torch.randn(5, 64, generator=g) * torch.tensor([0.01, 1, 30, 0.5, 2]).reshape(5, 1)
    x[3] = 0  # a zero row gets the smallest scale, not a division by zero
    x = x.to(dtype)
    layer = Fp8Linear(w_fp8, w_scale, None, None, dtype, dynamic_input=True)
    assert layer.dynamic_input and not layer.weight_only and not layer.pack()
    got = layer(x).double()
    want = _reference(x, w_fp8, w_scale)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # the bf16 output's rounding
    assert torch.allclose(got, want.to(dtype).double(), rtol=tol, atol=1e-6)
    assert torch.equal(got[3], torch.zeros(48, dtype=torch.float64))
    # rows are quantized independently: a row's output does not depend on the others
    assert torch.equal(layer(x[:1]), layer(x)[:1])
    q, s = quantize_per_token(x)
    assert s[3].item() == pytest.approx(MIN_TOKEN_SCALE, rel=1e-7) and q.dtype == torch.float32


def test_dynamic_and_static_input_scale_exclude_each_other():
    w = torch.zeros(4, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="no static input scale"):
        Fp8Linear(w, torch.ones(4, 1), torch.ones(1), None, torch.float32, dynamic_input=True)


def test_config_says_dynamic_token_and_reads_back():
    qc = build_quantization_config(recipe_from_dict(DYNAMIC), ["lm_head"])
    a = qc["config_groups"]["group_0"]["input_activations"]
    assert a["dynamic"] is True and a["strategy"] == "token"
    scheme = parse_quantization_config({"quantization_config": qc}, "config.json")
    assert scheme.dynamic_inputs and scheme.weight_strategy == "channel"
    a["strategy"] = "tensor"  # dynamic per-tensor: not what the runtime computes
    with pytest.raises(CheckpointError, match="unsupported strategies"):
        parse_quantization_config({"quantization_config": qc}, "config.json")
    a.update(strategy="token", type="int")  # int8 per-token inputs: not FP8
    with pytest.raises(CheckpointError, match="input_activations must be static or dynamic 8-bit"):
        parse_quantization_config({"quantization_config": qc}, "config.json")
    static = build_quantization_config(recipe_from_dict({}), ["lm_head"])
    static["config_groups"]["group_0"]["input_activations"]["strategy"] = "token"
    with pytest.raises(CheckpointError, match="unsupported strategies"):
        parse_quantization_config({"quantization_config": static}, "config.json")


@pytest.fixture(scope="module")
def dynamic_artifact(tmp_path_factory):
    tiny = write_tiny_llama(tmp_path_factory.mktemp("src") / "tiny")
    out = tmp_path_factory.mktemp("art") / "dyn"
    quantize(str(tiny), out, recipe_from_dict({**DYNAMIC, "weight_only": ["re:.*down_proj"]}),
             dtype=torch.float32)
    return out


def test_artifact_has_no_input_scales_and_loads_dynamic(dynamic_artifact):
    with safe_open(str(dynamic_artifact / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any(k.endswith(".input_scale") for k in keys)
    assert "model.layers.0.self_attn.q_proj.weight_scale" in keys
    qm = load_quantized_model(open_artifact(dynamic_artifact), torch.float32)
    layer = qm.model.model.layers[0]
    assert layer.self_attn.q_proj.dynamic_input and not layer.self_attn.q_proj.weight_only
    assert layer.mlp.down_proj.weight_only and not layer.mlp.down_proj.dynamic_input


def test_fused_projections_compute_what_the_parts_do(dynamic_artifact):
    art = open_artifact(dynamic_artifact)
    plain = load_quantized_model(art, torch.float32).model
    fused = load_quantized_model(art, torch.float32).model
    assert fuse_projections(fused) > 0
    assert fused.model.layers[0].self_attn.qkv_proj.dynamic_input
    ids = torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(2))
    meta = AttentionMetadata.single(24)
    with torch.inference_mode():
        a = plain.compute_logits(plain(ids, torch.arange(24), meta, DenseAttention()))
        b = fused.compute_logits(fused(ids, torch.arange(24), meta, DenseAttention()))
    assert torch.allclose(a, b, rtol=0, atol=1e-4)
