"""Build a runnable model from an FP8 artifact (the load-time half of quantization).

Each linear with a `weight_scale` becomes an `Fp8Linear` (FP8 weight upcast once to the
compute dtype, static input quantization, or none for the linears the quantization_config
names weight-only); in an int8 (pack-quantized) artifact each one's `weight_packed` is
unpacked to int8 codes and the layer is weight-only (`codes="int8"`); in a W8A8 int8
(int-quantized) artifact each one's `weight` is int8 and the layer quantizes its inputs
per row (`codes="int8"`, dynamic). Every other tensor
loads as in `load_model`.
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
from ..formats.pack_quantized import packed_columns, unpack_int8
from ..layers.fp8_linear import Fp8Linear
from .loader import build_on_meta, fill_parameters, finish_model

KV_SUFFIXES = (".k_scale", ".v_scale")
INT8_SUFFIXES = (".weight_packed", ".weight_shape")  # pack-quantized weights


@dataclass
class QuantizedModel:
    model: nn.Module
    kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (k, v) fp32
    quantized_modules: list[str]


def _install_fp8_linears(model: nn.Module, ckpt: Checkpoint, tensors: dict[str, torch.Tensor],
                         dtype: torch.dtype) -> list[str]:
    """Replace each linear that has a `weight_scale` (or `weight_packed`) in `tensors` by an
    Fp8Linear, popping the tensors it consumes. Returns the module names."""
    quantized = sorted({n.rsplit(".", 1)[0] for n in tensors
                        if n.endswith((".weight_scale", *INT8_SUFFIXES))})
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
        if f"{mod_name}.weight_scale" not in tensors:
            present = [s[1:] for s in INT8_SUFFIXES if mod_name + s in tensors]
            raise CheckpointError(f"{ckpt.path}: {mod_name!r} has {', '.join(present)} but "
                                  "no weight_scale.")
        s_in = tensors.pop(f"{mod_name}.input_scale", None)
        s_w = tensors.pop(f"{mod_name}.weight_scale")
        weight_only = scheme.is_weight_only(mod_name)
        dynamic = scheme.dynamic_inputs and not weight_only
        codes = scheme.codes_of(mod_name)
        read_codes = CODE_READERS[scheme.reader_of(mod_name)]
        w = read_codes(ckpt, tensors, mod_name, tuple(module.weight.shape), s_w)
        if w is None or (s_in is None and not (weight_only or dynamic)):
            raise CheckpointError(f"{ckpt.path}: {mod_name!r} needs weight, weight_scale and "
                                  "input_scale (static activations).")
        if s_in is not None and (weight_only or dynamic):
            raise CheckpointError(f"{ckpt.path}: {mod_name}.input_scale is present but "
                                  f"{mod_name!r} is "
                                  f"{'weight-only' if weight_only else 'dynamic-input'} in "
                                  "config.json.")
        bias = tensors.pop(f"{mod_name}.bias", None)
        parent, _, attr = mod_name.rpartition(".")
        setattr(model.get_submodule(parent), attr,
                Fp8Linear(w, s_w, s_in, bias, dtype, dynamic, codes=codes))
    return quantized


def _e4m3_codes(ckpt: Checkpoint, tensors: dict[str, torch.Tensor], mod_name: str,
                shape: tuple[int, int], scale: torch.Tensor) -> torch.Tensor | None:
    """Pop `mod_name`'s FP8 `weight` and check it against the linear's [out, in] `shape`:
    float8_e4m3fn [out, in], or None when it is missing."""
    if any(f"{mod_name}{s}" in tensors for s in INT8_SUFFIXES):
        raise CheckpointError(f"{ckpt.path}: {mod_name!r} has pack-quantized int8 tensors "
                              "(weight_packed), but config.json's quantization_config "
                              "describes FP8 weights.")
    w = tensors.pop(f"{mod_name}.weight", None)
    if w is not None and (w.dtype != torch.float8_e4m3fn or tuple(w.shape) != shape):
        raise CheckpointError(
            f"{ckpt.weight_map[mod_name + '.weight']}: {mod_name}.weight must be "
            f"float8_e4m3fn {list(shape)}, got {w.dtype} {list(w.shape)}.")
    return w


def _int8_codes(ckpt: Checkpoint, tensors: dict[str, torch.Tensor], mod_name: str,
                shape: tuple[int, int], scale: torch.Tensor) -> torch.Tensor:
    """Pop `mod_name`'s pack-quantized tensors, check them against the linear's [out, in]
    `shape`, and return its int8 codes [out, in]."""
    out, n_in = shape
    where = ckpt.weight_map.get(f"{mod_name}.weight_packed", ckpt.path)
    if f"{mod_name}.weight" in tensors:
        raise CheckpointError(f"{where}: {mod_name}.weight is present, but config.json's "
                              "quantization_config is int8 pack-quantized (weight_packed).")
    packed = tensors.pop(f"{mod_name}.weight_packed", None)
    stored = tensors.pop(f"{mod_name}.weight_shape", None)
    if packed is None or stored is None:
        raise CheckpointError(f"{ckpt.path}: {mod_name!r} needs weight_packed, weight_shape "
                              "and weight_scale (int8 pack-quantized).")
    words = packed_columns(n_in)
    if packed.dtype != torch.int32 or tuple(packed.shape) != (out, words):
        raise CheckpointError(f"{where}: {mod_name}.weight_packed must be int32 [{out}, "
                              f"{words}] (four int8 codes an int32), got {packed.dtype} "
                              f"{list(packed.shape)}.")
    if stored.dtype not in (torch.int32, torch.int64) or stored.tolist() != [out, n_in]:
        raise CheckpointError(f"{where}: {mod_name}.weight_shape must be an int tensor "
                              f"[{out}, {n_in}], got {stored.dtype} {stored.tolist()}.")
    _check_int8_scale(where, mod_name, scale, out)
    return unpack_int8(packed, n_in)  # [out, in] int8


def _check_int8_scale(where, mod_name: str, scale: torch.Tensor, out: int) -> None:
    """An int8 linear's weight_scale: a float tensor of `out` (per channel) or 1 values."""
    if not scale.is_floating_point() or scale.numel() not in (1, out):
        raise CheckpointError(f"{where}: {mod_name}.weight_scale must be a float tensor of "
                              f"{out} (per channel) or 1 (per tensor) values, got "
                              f"{scale.dtype} {list(scale.shape)}.")


def _int8_plain_codes(ckpt: Checkpoint, tensors: dict[str, torch.Tensor], mod_name: str,
                      shape: tuple[int, int], scale: torch.Tensor) -> torch.Tensor | None:
    """Pop `mod_name`'s W8A8 int8 `weight` (int-quantized) and check it: int8 [out, in],
    or None when it is missing."""
    where = ckpt.weight_map.get(f"{mod_name}.weight", ckpt.path)
    if any(f"{mod_name}{s}" in tensors for s in INT8_SUFFIXES):
        raise CheckpointError(f"{where}: {mod_name!r} has pack-quantized tensors "
                              "(weight_packed), but config.json's quantization_config is W8A8 "
                              "int8 (int-quantized: an int8 weight).")
    w = tensors.pop(f"{mod_name}.weight", None)
    if w is not None and (w.dtype != torch.int8 or tuple(w.shape) != shape):
        raise CheckpointError(f"{where}: {mod_name}.weight must be int8 {list(shape)}, got "
                              f"{w.dtype} {list(w.shape)}.")
    _check_int8_scale(where, mod_name, scale, shape[0])
    return w


# QuantScheme.reader_of -> reader of a quantized linear's weight codes
CODE_READERS = {"e4m3": _e4m3_codes, "int8": _int8_codes, "int8-plain": _int8_plain_codes}


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
