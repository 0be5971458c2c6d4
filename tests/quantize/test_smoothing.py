"""Smoothing folds per-channel factors into the model without changing what it computes."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qserve.runtime.formats.artifact_reader import open_artifact
from qserve.runtime.formats.checkpoint import open_checkpoint
from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import RecipeError, recipe_from_dict
from qserve.quantize.smoothing import (SMOOTHING_TARGETS, SmoothingError, smooth_block,
                                       smoothing_factors)
from qserve.runtime.attention import AttentionMetadata, DenseAttention
from qserve.runtime.fp8_kv_attention import Fp8KVAttention
from qserve.runtime.layers.norm import GemmaRMSNorm, RMSNorm
from qserve.runtime.models.loader import load_model
from qserve.runtime.models.quantized_loader import load_quantized_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_gemma3, write_tiny_llama  # noqa: E402

SMALL = {"calibration": {"num_samples": 4, "seq_len": 64}}
WRITERS = {"llama": write_tiny_llama, "gemma3": write_tiny_gemma3}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def tiny(request, tmp_path_factory):
    return request.param, WRITERS[request.param](tmp_path_factory.mktemp("src") / request.param)


def _forward(model, ids):
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), AttentionMetadata.single(len(ids)),
                       DenseAttention())
        return model.compute_logits(hidden)  # [T, vocab] fp32


def _randomize_norms(model, gen):
    """Random (non-unit) norm weights, so a wrong fold convention cannot pass."""
    for m in model.modules():
        if isinstance(m, (RMSNorm, GemmaRMSNorm)):
            m.weight.data = torch.rand(m.weight.shape, generator=gen) * 1.5 + 0.25


@pytest.mark.parametrize("targets", [SMOOTHING_TARGETS, ("o",), ("down",), ("qkv", "gate_up")])
def test_smoothing_is_an_exact_identity(tiny, targets):
    arch, path = tiny
    gen = torch.Generator().manual_seed(0)
    model = load_model(open_checkpoint(path), torch.float32)
    _randomize_norms(model, gen)
    ids = torch.randint(2, 300, (48,), generator=gen)
    want = _forward(model, ids)
    layers = model.backbone.layers
    for layer in layers:
        before = {n: p.detach().clone() for n, p in layer.named_parameters()}
        factors = smooth_block(layer, lambda: _forward(model, ids), alpha=0.5, targets=targets)
        assert set(factors) == set(targets)
        for s in factors.values():  # per-channel factors away from 1: a real rewrite
            assert s.max() / s.min() > 1.2
        changed = [n for n, p in layer.named_parameters() if not torch.equal(p, before[n])]
        assert changed
    got = _forward(model, ids)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 2e-5 * scale
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_gqa_factors_shared_by_heads_of_one_kv_head(tiny):
    arch, path = tiny
    model = load_model(open_checkpoint(path), torch.float32)
    ids = torch.randint(2, 300, (32,), generator=torch.Generator().manual_seed(2))
    layer = model.backbone.layers[0]
    attn = layer.self_attn
    s = smooth_block(layer, lambda: _forward(model, ids), alpha=0.5, targets=("o",))["o"]
    g = attn.num_heads // attn.num_kv_heads
    per_head = s.reshape(attn.num_kv_heads, g, attn.head_dim)  # [Hkv, g, D]
    assert g > 1
    assert torch.equal(per_head, per_head[:, :1].expand_as(per_head))


def test_factor_formula():
    x = torch.tensor([4.0, 1.0, 0.0])
    w = torch.tensor([1.0, 4.0, 2.0])
    s = smoothing_factors(x, w, 0.5)
    assert torch.allclose(s[:2], torch.tensor([2.0, 0.5]))
    assert s[2] > 0  # a dead channel still gets a usable (floored) factor
    assert torch.allclose(smoothing_factors(x, w, 1.0)[:2], x[:2])


def test_missing_module_is_a_clear_error(tiny):
    arch, path = tiny
    model = load_model(open_checkpoint(path), torch.float32)
    layer = model.backbone.layers[0]
    del layer.mlp.up_proj
    with pytest.raises(SmoothingError, match="smoothing target 'down'"):
        smooth_block(layer, lambda: None, 0.5, ("down",))


def test_artifact_with_smoothing(tiny, tmp_path):
    arch, path = tiny
    plain, smoothed = tmp_path / "plain", tmp_path / "smooth"
    quantize(str(path), plain, recipe_from_dict(SMALL), dtype=torch.float32)
    quantize(str(path), smoothed, recipe_from_dict({**SMALL, "smoothing": {"enabled": True}}),
             dtype=torch.float32)
    art = open_artifact(smoothed)
    assert art.manifest.recipe["smoothing"]["enabled"] is True
    src = open_checkpoint(path)
    name = "model.layers.0.input_layernorm.weight"
    assert not torch.allclose(art.checkpoint.tensor(name).float(), src.tensor(name).float())
    with safe_open(str(plain / "model.safetensors"), "pt") as a, \
            safe_open(str(smoothed / "model.safetensors"), "pt") as b:
        v = "model.layers.0.self_attn.v_scale"
        assert not torch.equal(a.get_tensor(v), b.get_tensor(v))  # KV scales see smoothed V
        w = "model.layers.0.mlp.down_proj.weight"
        assert b.get_tensor(w).dtype == torch.float8_e4m3fn
    ref = load_model(src, torch.float32)
    ids = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(1))
    meta = AttentionMetadata.single(40)
    with torch.inference_mode():
        want = ref.compute_logits(ref(ids, torch.arange(40), meta, DenseAttention()))
    rel = {}
    for label, out in (("plain", plain), ("smoothed", smoothed)):
        qm = load_quantized_model(open_artifact(out), torch.float32)
        with torch.inference_mode():
            got = qm.model.compute_logits(qm.model(ids, torch.arange(40), meta, Fp8KVAttention(
                DenseAttention(), qm.kv_scales)))
        rel[label] = ((got - want).norm() / want.norm()).item()
    # random weights have no outlier channels to tame: smoothing only has to do no harm
    assert 0 < rel["smoothed"] < 1.5 * rel["plain"], rel


@pytest.mark.parametrize("raw,message", [
    ({"smoothing": {"alpha": 1.5}}, "smoothing.alpha must be in [0, 1]"),
    ({"smoothing": {"targets": ["qkv", "lm_head"]}}, "smoothing.targets has 'lm_head'"),
    ({"smoothing": {"targets": ["o", "o"]}}, "lists a target twice"),
    ({"smoothing": {"targets": "o"}}, "smoothing.targets must be list"),
    ({"smoothing": {"enable": True}}, "unknown key smoothing.enable"),
    ({"smoothing": {"enabled": "yes"}}, "smoothing.enabled must be bool"),
])
def test_bad_smoothing_recipes(raw, message):
    with pytest.raises(RecipeError, match=message.replace(".", r"\.").replace("[", r"\[")):
        recipe_from_dict(raw)


def test_smoothing_in_bf16_stays_within_bf16_noise(tiny):
    """Stored in bf16 (as the artifact stores norms), the fold is exact for the rounded
    norm weight; what is left is bf16 rounding of the rescaled weights, no larger than
    the gap between bf16 and fp32 inference of the same model."""
    arch, path = tiny
    gen = torch.Generator().manual_seed(0)
    ref32 = load_model(open_checkpoint(path), torch.float32)
    _randomize_norms(ref32, gen)
    model = load_model(open_checkpoint(path), torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref32.state_dict().items()})
    ids = torch.randint(2, 300, (48,), generator=gen)
    want32, want16 = _forward(ref32, ids), _forward(model, ids)
    for layer in model.backbone.layers:
        smooth_block(layer, lambda: _forward(model, ids), alpha=0.5)
    got = _forward(model, ids)
    bf16_noise = (want16 - want32).abs().max().item()
    assert (got - want32).abs().max().item() < 3 * bf16_noise


def test_report_lists_smoothing_ranges():
    from qserve.quantize.calibrator import CalibrationSummary
    from qserve.quantize.pipeline import QuantizeReport, format_report

    summary = CalibrationSummary(smoothing={"down": (0.125, 8.0)})
    r = QuantizeReport(Path("a"), summary, 100, 50, 1.0, "d", 4, 64)
    assert "smoothing down: factors 1.250e-01..8.000e+00" in format_report(r)
