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

    ours = load(str(art), torch.float32)
    ids = torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = theirs(ids[None]).logits[0]
        got = ours.model.compute_logits(
            ours.model(ids, torch.arange(24), AttentionMetadata.single(24), DenseAttention()))
    # Same math in another order: fp32 rounding differs by ~1e-7, and an activation that
    # lands on an FP8 rounding boundary may round the other way, so allow 1e-4.
    assert (got - want).abs().max().item() < 1e-4
