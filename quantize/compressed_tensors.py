"""Writes the `quantization_config` block of config.json for an artifact made with a recipe,
in the compressed-tensors format that runtime/formats/compressed_tensors.py describes and
reads (the format vLLM and SGLang load for FP8 checkpoints)."""

from __future__ import annotations

from ..runtime.formats.compressed_tensors import KV_STRATEGY, WEIGHT_STRATEGY
from .recipe import Recipe


def _fp8_args(strategy: str, observer: str | None, dynamic: bool = False) -> dict:
    return {
        "num_bits": 8, "type": "float", "symmetric": True, "dynamic": dynamic,
        "strategy": strategy, "group_size": None, "block_structure": None,
        "actorder": None, "observer": observer, "observer_kwargs": {},
    }


def build_quantization_config(recipe: Recipe, ignored_modules: list[str],
                              weight_only_modules: list[str] = ()) -> dict:
    """config.json's quantization_config for an artifact made with `recipe`. Weight-only
    linears (W8A16) form a second group that names them: an exact name outranks the
    class name "Linear" in compressed-tensors' and vLLM's matching."""
    weights = _fp8_args(WEIGHT_STRATEGY[recipe.weights.granularity], recipe.weights.observer)
    groups = {
        "group_0": {
            "targets": ["Linear"],
            "weights": weights,
            "input_activations": _fp8_args("token", None, dynamic=True)
            if recipe.activations.dynamic else _fp8_args("tensor", recipe.activations.observer),
            "output_activations": None,
        }
    }
    if weight_only_modules:
        groups["group_1"] = {"targets": sorted(weight_only_modules), "weights": dict(weights),
                             "input_activations": None, "output_activations": None}
    cfg = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(ignored_modules),
        "kv_cache_scheme": None,
    }
    if recipe.kv_cache.enabled:
        cfg["kv_cache_scheme"] = _fp8_args(KV_STRATEGY[recipe.kv_cache.granularity],
                                           recipe.kv_cache.observer)
    return cfg
