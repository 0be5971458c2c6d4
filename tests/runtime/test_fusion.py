"""Fused q|k|v and gate|up projections (and packed weights) compute what the separate
HF-named modules compute, for bf16 checkpoints and FP8 artifacts, Llama and Gemma 3."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import recipe_from_dict
from qserve.runtime.attention import AttentionMetadata, DenseAttention
from qserve.runtime.layers.fp8_linear import Fp8Linear
from qserve.runtime.layers.fusion import fuse_linears, fuse_projections
from qserve.runtime.layers.packing import pack_for_cpu
from qserve.runtime.loaded_model import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_gemma3, write_tiny_llama  # noqa: E402

IDS = torch.tensor([2, 17, 45, 99, 3, 250, 31, 7])


def _logits(model, ids=IDS):
    meta = AttentionMetadata.single(len(ids))
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(ids)), meta, DenseAttention())
        return model.compute_logits(hidden).double()


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def checkpoint(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    write = write_tiny_llama if request.param == "llama" else write_tiny_gemma3
    return write(root / "ckpt")


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_and_packed_model_matches_separate_modules(checkpoint, fp8, tmp_path):
    source = str(checkpoint)
    if fp8:
        quantize(source, tmp_path / "art",
                 recipe_from_dict({"calibration": {"num_samples": 4, "seq_len": 64}}),
                 dtype=torch.float32)
        source = str(tmp_path / "art")
    lm = load(source, torch.bfloat16)
    before = _logits(lm.model)
    layers = len(lm.model.backbone.layers)
    assert fuse_projections(lm.model) == 2 * layers
    assert fuse_projections(lm.model) == 0  # idempotent
    attn = lm.model.backbone.layers[0].self_attn
    assert not hasattr(attn, "q_proj") and attn.qkv_proj is not None
    assert isinstance(attn.qkv_proj, Fp8Linear) == fp8
    fused = _logits(lm.model)
    pack_for_cpu(lm.model)
    packed = _logits(lm.model)
    # 4 rows: FP8 linears read their E4M3 bytes in C (kernels/native_fp8_gemv.py)
    few = _logits(lm.model, IDS[:4])
    assert fp8 == (getattr(attn.qkv_proj, "c_weight", None) is not None)
    # bf16 activations: a different fp32 summation order may move a value by one bf16 ulp
    # and that can spread a little through the layers; the logits stay within bf16 noise
    for got, want in ((fused, before), (packed, before), (few, before[:4])):
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.05)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


def test_engine_can_drop_the_fp8_bytes(tmp_path):
    from qserve.runtime.engine import EngineConfig, LLMEngine

    quantize(str(write_tiny_llama(tmp_path / "ckpt")), tmp_path / "art",
             recipe_from_dict({"calibration": {"num_samples": 4, "seq_len": 64}}),
             dtype=torch.float32)
    for keep in (True, False):
        lm = load(str(tmp_path / "art"), torch.bfloat16)
        LLMEngine.from_model(lm, EngineConfig(num_kv_blocks=8, keep_fp8_weights=keep))
        linears = [m for m in lm.model.modules() if isinstance(m, Fp8Linear)]
        assert linears and all(m.packed for m in linears)
        assert all((m.c_weight is not None) == keep for m in linears)


def test_fp8_group_with_different_input_scales_stays_separate():
    w = torch.randn(8, 16).to(torch.float8_e4m3fn)
    a = Fp8Linear(w, torch.ones(1), torch.tensor([0.1]), None, torch.bfloat16)
    b = Fp8Linear(w, torch.ones(1), torch.tensor([0.2]), None, torch.bfloat16)
    assert fuse_linears([a, b]) is None
    c = Fp8Linear(w, torch.full((8,), 0.5), torch.tensor([0.1]), None, torch.bfloat16)
    fused = fuse_linears([a, c])  # per-tensor and per-channel weight scales mix exactly
    x = torch.randn(3, 16).bfloat16()
    assert torch.equal(fused(x), torch.cat([a(x), c(x)], -1))
