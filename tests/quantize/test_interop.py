"""Interoperability: the artifact is a compressed-tensors FP8 checkpoint.

The oracle is transformers with the `compressed-tensors` library (the reader vLLM uses
for this format): it must parse our quantization_config into the static FP8 scheme,
load the FP8 weights byte for byte, and run the model (activations fake-quantized with
our input scales) to the same fp32 logits as qserve's runtime.
"""

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qserve.quantize.pipeline import quantize
from qserve.quantize.recipe import recipe_from_dict
from qserve.runtime.attention import AttentionMetadata, DenseAttention
from qserve.runtime.loaded_model import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import write_tiny_llama  # noqa: E402

pytest.importorskip("compressed_tensors", reason="pip install compressed-tensors (test extra)")


@pytest.mark.parametrize("weights", ["channel", "tensor"])
def test_transformers_compressed_tensors_runs_artifact(tmp_path, weights):
    from transformers import AutoModelForCausalLM

    src = write_tiny_llama(tmp_path / "src")
    art = tmp_path / "art"
    recipe = {"calibration": {"num_samples": 4, "seq_len": 64},
              "weights": {"granularity": weights}}
    quantize(str(src), art, recipe_from_dict(recipe), dtype=torch.float32)

    theirs = AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32).eval()
    layer = theirs.model.layers[1].mlp.down_proj
    scheme = layer.quantization_scheme
    assert (scheme.weights.type, scheme.weights.num_bits, scheme.weights.strategy) == (
        "float", 8, weights)
    assert (scheme.input_activations.strategy, scheme.input_activations.dynamic) == ("tensor", False)
    with safe_open(str(art / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("model.layers.1.mlp.down_proj.weight")
    assert torch.equal(layer.weight.view(torch.uint8), stored.view(torch.uint8))

    assert _logit_gap(load(str(art), torch.float32), theirs) < 1e-4


def _logit_gap(ours, theirs) -> float:
    """Largest |logit difference| between qserve's runtime and transformers on 24 random
    tokens, fp32. Same math in another order: fp32 rounding differs by ~1e-7, and an
    activation that lands on an FP8 rounding boundary may round the other way, so the
    callers allow 1e-4."""
    ids = torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = theirs(ids[None]).logits[0]
        got = ours.model.compute_logits(
            ours.model(ids, torch.arange(24), AttentionMetadata.single(24), DenseAttention()))
    return (got - want).abs().max().item()


def test_weight_only_linears_are_a_named_group_transformers_reads(tmp_path):
    """Linears the recipe keeps weight-only (FP8 weights, unquantized input: W8A16) are a
    second config group naming them; compressed-tensors gives them that scheme (an exact
    name outranks "Linear"), the rest keep static input scales, and the logits agree."""
    from transformers import AutoModelForCausalLM

    src = write_tiny_llama(tmp_path / "src")
    art = tmp_path / "art"
    recipe = {"calibration": {"num_samples": 4, "seq_len": 64},
              "weight_only": ["re:.*mlp\\.down_proj", "model.layers.0.self_attn.o_proj"]}
    quantize(str(src), art, recipe_from_dict(recipe), dtype=torch.float32)
    with safe_open(str(art / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.down_proj.weight_scale" in names
    assert "model.layers.1.mlp.down_proj.input_scale" not in names
    assert "model.layers.0.self_attn.o_proj.input_scale" not in names
    assert "model.layers.1.self_attn.o_proj.input_scale" in names

    theirs = AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32).eval()
    for layer, wonly in ((theirs.model.layers[1].mlp.down_proj, True),
                         (theirs.model.layers[0].self_attn.o_proj, True),
                         (theirs.model.layers[1].self_attn.o_proj, False),
                         (theirs.model.layers[0].mlp.gate_proj, False)):
        scheme = layer.quantization_scheme
        assert (scheme.weights.type, scheme.weights.num_bits) == ("float", 8)
        assert (scheme.input_activations is None) == wonly

    ours = load(str(art), torch.float32)
    assert ours.model.model.layers[1].mlp.down_proj.weight_only
    assert not ours.model.model.layers[1].self_attn.o_proj.weight_only
    assert _logit_gap(ours, theirs) < 1e-4


@pytest.mark.parametrize("head", ["int8", "fp8"])
def test_a_head_with_its_own_format_is_a_group_transformers_reads(tmp_path, head):
    """`lm_head: int8 | fp8` beside FP8 W8A8 linears: compressed-tensors gives the head
    its own weight-only scheme (int8 from a "mixed-precision" config's pack-quantized
    group, or FP8), the linears keep theirs, and the logits agree with qserve's."""
    from transformers import AutoModelForCausalLM

    src = write_tiny_llama(tmp_path / "src")
    art = tmp_path / "art"
    recipe = {"calibration": {"num_samples": 4, "seq_len": 64}, "lm_head": head}
    quantize(str(src), art, recipe_from_dict(recipe), dtype=torch.float32)

    theirs = AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32).eval()
    scheme = theirs.lm_head.quantization_scheme
    kind = "int" if head == "int8" else "float"
    assert (scheme.weights.type, scheme.weights.num_bits, scheme.weights.strategy) == (
        kind, 8, "channel")
    assert scheme.input_activations is None
    linear = theirs.model.layers[1].mlp.down_proj.quantization_scheme
    assert linear.weights.type == "float" and linear.input_activations is not None
    ours = load(str(art), torch.float32)
    assert ours.model.lm_head.weight_only
    assert _logit_gap(ours, theirs) < 1e-4
