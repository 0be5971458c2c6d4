"""Writes the `quantization_config` block of config.json for an artifact made with a recipe,
in the compressed-tensors format that runtime/formats/compressed_tensors.py describes and
reads (the format vLLM and SGLang load for FP8 checkpoints; "pack-quantized" for int8
weight-only recipes, as llm-compressor writes W8A16; "int-quantized" for W8A8 int8 with
dynamic per-token inputs, as llm-compressor writes W8A8 int8; "mixed-precision" when
groups differ in format)."""

from __future__ import annotations

from ..runtime.formats.compressed_tensors import INT8_W8A8_FORMAT, KV_STRATEGY, WEIGHT_STRATEGY
from .recipe import QUANTIZED_HEADS, Recipe


def _quant_args(strategy: str, observer: str | None, dynamic: bool = False,
                kind: str = "float") -> dict:
    """compressed-tensors QuantizationArgs of symmetric 8-bit values: kind "float" (FP8
    E4M3) or "int" (int8)."""
    return {
        "num_bits": 8, "type": kind, "symmetric": True, "dynamic": dynamic,
        "strategy": strategy, "group_size": None, "block_structure": None,
        "actorder": None, "observer": observer, "observer_kwargs": {},
    }


# recipe weight type -> (compressed-tensors QuantizationArgs type, the format its tensors take)
_CODES = {"fp8": ("float", "float-quantized"), "int8": ("int", "pack-quantized")}


def build_quantization_config(recipe: Recipe, ignored_modules: list[str],
                              weight_only_modules: list[str] = ()) -> dict:
    """config.json's quantization_config for an artifact made with `recipe`. Weight-only
    FP8 linears (W8A16) form a second group that names them: an exact name outranks the
    class name "Linear" in compressed-tensors' and vLLM's matching. An LM head with its
    own format (recipe `lm_head: int8 | fp8`) is a group of its own; groups of different
    formats make a "mixed-precision" config whose groups each say their format."""
    own_head = recipe.lm_head in QUANTIZED_HEADS and "lm_head" not in ignored_modules
    weight_only = sorted(set(weight_only_modules) - ({"lm_head"} if own_head else set()))
    kind, fmt = _CODES[recipe.weights.type]
    weights = _quant_args(WEIGHT_STRATEGY[recipe.weights.granularity], recipe.weights.observer,
                          kind=kind)
    if recipe.weights.type == "int8" and recipe.activations.dynamic:  # W8A8 int8
        inputs, fmt = _quant_args("token", None, dynamic=True, kind="int"), INT8_W8A8_FORMAT
    elif recipe.weights.type == "int8":  # every quantized linear weight-only
        inputs = None
    elif recipe.activations.dynamic:
        inputs = _quant_args("token", None, dynamic=True)
    else:
        inputs = _quant_args("tensor", recipe.activations.observer)
    groups = {"group_0": _group(["Linear"], weights, inputs, fmt)}
    if weight_only and recipe.weights.type == "fp8":
        groups["group_1"] = _group(weight_only, dict(weights), None, fmt)
    elif weight_only and recipe.activations.dynamic:  # int8 W8A16 beside W8A8 int8
        groups["group_1"] = _group(weight_only, dict(weights), None, _CODES["int8"][1])
    if own_head:
        head_kind, head_fmt = _CODES[recipe.lm_head]
        groups["lm_head"] = _group(["lm_head"], _quant_args(
            "channel", recipe.weights.observer, kind=head_kind), None, head_fmt)
    formats = {g["format"] for g in groups.values()}
    if len(formats) == 1:  # one format: said once, as every reader expects
        for g in groups.values():
            del g["format"]
    return _config(recipe, formats.pop() if len(formats) == 1 else "mixed-precision", groups,
                   ignored_modules)


def _group(targets: list[str], weights: dict, inputs: dict | None, fmt: str) -> dict:
    return {"targets": list(targets), "weights": weights, "input_activations": inputs,
            "output_activations": None, "format": fmt}


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
