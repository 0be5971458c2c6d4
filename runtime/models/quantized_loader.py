"""Build a runnable model from an FP8 artifact (the load-time half of quantization).

Each linear with a `weight_scale` becomes an `Fp8Linear` (FP8 weight upcast once to the
compute dtype, static input quantization, or none for the linears the quantization_config
names weight-only); every other tensor loads as in `load_model`.
The k/v scales are returned beside the model for the attention backend / KV cache.

`load_part` fills one part of a meta-device model (e.g. one decoder block) so that a
caller can walk an artifact block by block with bounded memory (the quantize verifier).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..formats.artifact_reader import Artifact
from ..formats.checkpoint import Checkpoint
from ..formats.compressed_tensors import parse_quantization_config
from ..formats.errors import CheckpointError
from ..layers.fp8_linear import Fp8Linear
from .loader import build_on_meta, fill_parameters, finish_model

KV_SUFFIXES = (".k_scale", ".v_scale")


@dataclass
class QuantizedModel:
    model: nn.Module
    kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (k, v) fp32
    quantized_modules: list[str]


def _install_fp8_linears(model: nn.Module, ckpt: Checkpoint, tensors: dict[str, torch.Tensor],
                         dtype: torch.dtype) -> list[str]:
    """Replace each linear that has a `weight_scale` in `tensors` by an Fp8Linear, popping
    the tensors it consumes. Returns the module names."""
    quantized = sorted({n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale")})
    scheme = parse_quantization_config(ckpt.config, str(ckpt.path / "config.json")) \
        if quantized else None
    for mod_name in quantized:
        try:
            module = model.get_submodule(mod_name)
        except AttributeError:
            raise CheckpointError(f"{ckpt.path}: quantized module {mod_name!r} does not exist "
                                  f"in {type(model).__name__}.") from None
        if not isinstance(module, nn.Linear):
            raise CheckpointError(f"{ckpt.path}: {mod_name!r} has FP8 scales but is not a linear.")
        w = tensors.pop(f"{mod_name}.weight", None)
        s_in = tensors.pop(f"{mod_name}.input_scale", None)
        s_w = tensors.pop(f"{mod_name}.weight_scale")
        weight_only = scheme.is_weight_only(mod_name)
        dynamic = scheme.dynamic_inputs and not weight_only
        if w is None or (s_in is None and not (weight_only or dynamic)):
            raise CheckpointError(f"{ckpt.path}: {mod_name!r} needs weight, weight_scale and "
                                  "input_scale (static activations).")
        if s_in is not None and (weight_only or dynamic):
            raise CheckpointError(f"{ckpt.path}: {mod_name!r} is "
                                  f"{'weight-only' if weight_only else 'dynamic-input'} in "
                                  "config.json but has an input_scale.")
        if w.dtype != torch.float8_e4m3fn or tuple(w.shape) != tuple(module.weight.shape):
            raise CheckpointError(
                f"{ckpt.weight_map[mod_name + '.weight']}: {mod_name}.weight must be "
                f"float8_e4m3fn {list(module.weight.shape)}, got {w.dtype} {list(w.shape)}.")
        bias = tensors.pop(f"{mod_name}.bias", None)
        parent, _, attr = mod_name.rpartition(".")
        setattr(model.get_submodule(parent), attr, Fp8Linear(w, s_w, s_in, bias, dtype, dynamic))
    return quantized


def load_part(model: nn.Module, ckpt: Checkpoint, tensors: dict[str, torch.Tensor],
              dtype: torch.dtype, scope: Callable[[str], bool] | None = None) -> list[str]:
    """Load checkpoint `tensors` (name -> tensor; consumed) into `model` (built on meta);
    every meta parameter inside `scope` (our names; None: the whole model) must be filled
    by them. Returns the names of the modules that became Fp8Linear."""
    quantized = _install_fp8_linears(model, ckpt, tensors, dtype)
    for name in [n for n in tensors if n.endswith(KV_SUFFIXES)]:
        del tensors[name]  # read by the attention backend, not the model
    fill_parameters(model, ckpt, tensors.items(), dtype, scope)
    return quantized


def load_quantized_model(artifact: Artifact, dtype: torch.dtype = torch.bfloat16) -> QuantizedModel:
    ckpt = artifact.checkpoint
    model = build_on_meta(ckpt)
    quantized = load_part(model, ckpt, dict(ckpt.iter_tensors()), dtype)
    if not isinstance(model.lm_head, Fp8Linear):
        model.tie_weights()
    finish_model(model)
    return QuantizedModel(model, artifact.kv_scales(), quantized)
