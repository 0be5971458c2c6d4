"""Build a runnable model from an FP8 artifact (the load-time half of quantization).

Each linear with a `weight_scale` becomes an `Fp8Linear` (FP8 weight upcast once to the
compute dtype, static input quantization); every other tensor loads as in `load_model`.
The k/v scales are returned beside the model for the attention backend / KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...quantize.artifact_reader import Artifact
from ...quantize.errors import CheckpointError
from ..layers.fp8_linear import Fp8Linear
from .loader import _listing, _set_parameter
from .registry import get_model_class

QUANT_SUFFIXES = (".weight_scale", ".input_scale")
KV_SUFFIXES = (".k_scale", ".v_scale")


@dataclass
class QuantizedModel:
    model: nn.Module
    kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (k, v) fp32
    quantized_modules: list[str]


def load_quantized_model(artifact: Artifact, dtype: torch.dtype = torch.bfloat16) -> QuantizedModel:
    ckpt = artifact.checkpoint
    config_path = str(ckpt.path / "config.json")
    cls = get_model_class(ckpt.architecture, config_path)
    cfg = cls.config_from_hf(ckpt.config, config_path)
    with torch.device("meta"):
        model = cls(cfg)

    tensors = {}
    for name, t in ckpt.iter_tensors():
        tensors[name] = t
    quantized = sorted({n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale")})
    for mod_name in quantized:
        try:
            module = model.get_submodule(mod_name)
        except AttributeError:
            raise CheckpointError(f"{ckpt.path}: quantized module {mod_name!r} does not exist "
                                  f"in {cls.__name__}.") from None
        if not isinstance(module, nn.Linear):
            raise CheckpointError(f"{ckpt.path}: {mod_name!r} has FP8 scales but is not a linear.")
        w = tensors.pop(f"{mod_name}.weight", None)
        s_in = tensors.pop(f"{mod_name}.input_scale", None)
        s_w = tensors.pop(f"{mod_name}.weight_scale")
        if w is None or s_in is None:
            raise CheckpointError(f"{ckpt.path}: {mod_name!r} needs weight, weight_scale and "
                                  "input_scale (static activations).")
        if w.dtype != torch.float8_e4m3fn or tuple(w.shape) != tuple(module.weight.shape):
            raise CheckpointError(
                f"{ckpt.weight_map[mod_name + '.weight']}: {mod_name}.weight must be "
                f"float8_e4m3fn {list(module.weight.shape)}, got {w.dtype} {list(w.shape)}.")
        bias = tensors.pop(f"{mod_name}.bias", None)
        parent, _, attr = mod_name.rpartition(".")
        setattr(model.get_submodule(parent), attr, Fp8Linear(w, s_w, s_in, bias, dtype))

    kv_names = [n for n in tensors if n.endswith(KV_SUFFIXES)]
    for n in kv_names:
        tensors.pop(n)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters() if p.is_meta}
    unexpected, loaded = [], set()
    for ck_name, t in tensors.items():
        name = model.param_name(ck_name)
        if name is None:
            continue
        if name not in expected:
            unexpected.append(ck_name)
            continue
        if tuple(t.shape) != expected[name]:
            raise CheckpointError(f"{ckpt.weight_map[ck_name]}: tensor {ck_name!r} has shape "
                                  f"{list(t.shape)}, expected {list(expected[name])}.")
        _set_parameter(model, name, t.to(dtype))
        loaded.add(name)
    if unexpected:
        raise CheckpointError(f"{ckpt.path}: unused tensor(s) {_listing(sorted(unexpected))}.")
    missing = sorted(set(expected) - loaded)
    if cfg.tie_word_embeddings and "lm_head.weight" in missing:
        missing.remove("lm_head.weight")
    if missing:
        raise CheckpointError(f"{ckpt.path}: missing tensor(s) {_listing(missing)}.")
    if not isinstance(model.lm_head, Fp8Linear):
        model.tie_weights()
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers(device="cpu")
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise RuntimeError(f"{cls.__name__}: tensors left on the meta device: {leftover}")
    return QuantizedModel(model.eval(), artifact.kv_scales(), quantized)
