"""Writes the `quantization_config` block of config.json for an artifact made with a recipe,
in the compressed-tensors format that runtime/formats/compressed_tensors.py describes and
reads (the format vLLM and SGLang load for FP8 checkpoints; "pack-quantized" for int8
weight-only recipes, as llm-compressor writes W8A16)."""

from __future__ import annotations

from ..runtime.formats.compressed_tensors import KV_STRATEGY, WEIGHT_STRATEGY
from .recipe import Recipe


def _quant_args(strategy: str, observer: str | None, dynamic: bool = False,
                kind: str = "float") -> dict:
    """compressed-tensors QuantizationArgs of symmetric 8-bit values: kind "float" (FP8
    E4M3) or "int" (int8)."""
    return {
        "num_bits": 8, "type": kind, "symmetric": True, "dynamic": dynamic,
        "strategy": strategy, "group_size": None, "block_structure": None,
        "actorder": None, "observer": observer, "observer_kwargs": {},
    }


def build_quantization_config(recipe: Recipe, ignored_modules: list[str],
                              weight_only_modules: list[str] = ()) -> dict:
    """config.json's quantization_config for an artifact made with `recipe`. Weight-only
    linears (W8A16) form a second group that names them: an exact name outranks the
    class name "Linear" in compressed-tensors' and vLLM's matching."""
    if recipe.weights.type == "int8":
        return _int8_config(recipe, ignored_modules)
    weights = _quant_args(WEIGHT_STRATEGY[recipe.weights.granularity], recipe.weights.observer)
    groups = {
        "group_0": {
            "targets": ["Linear"],
            "weights": weights,
            "input_activations": _quant_args("token", None, dynamic=True)
            if recipe.activations.dynamic else _quant_args("tensor", recipe.activations.observer),
            "output_activations": None,
        }
    }
    if weight_only_modules:
        groups["group_1"] = {"targets": sorted(weight_only_modules), "weights": dict(weights),
                             "input_activations": None, "output_activations": None}
    return _config(recipe, "float-quantized", groups, ignored_modules)


def _int8_config(recipe: Recipe, ignored_modules: list[str]) -> dict:
    """int8 weight-only (W8A16 int): one group, every quantized linear, no input
    quantization; weights stored pack-quantized (weight_packed int32, weight_shape)."""
    weights = _quant_args(WEIGHT_STRATEGY[recipe.weights.granularity], recipe.weights.observer,
                        kind="int")
    groups = {"group_0": {"targets": ["Linear"], "weights": weights,
                          "input_activations": None, "output_activations": None}}
    return _config(recipe, "pack-quantized", groups, ignored_modules)


def _config(recipe: Recipe, fmt: str, groups: dict, ignored_modules: list[str]) -> dict:
    cfg = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(ignored_modules),
        "kv_cache_scheme": None,
    }
    if recipe.kv_cache.enabled:
        cfg["kv_cache_scheme"] = _quant_args(KV_STRATEGY[recipe.kv_cache.granularity],
                                           recipe.kv_cache.observer)
    return cfg
