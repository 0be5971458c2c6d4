"""The `quantization_config` block of config.json, in the compressed-tensors format: what
it says and how the runtime reads it (quantize/compressed_tensors.py writes it).

The format vLLM and SGLang load for FP8 checkpoints: one config group targeting Linear
layers with static FP8 weights (per channel or per tensor) and static per-tensor FP8
input activations (or dynamic per-token ones: no input_scale tensors, each input row
scaled at run time), optionally a second group naming linears whose FP8 weights read an
unquantized input (weight-only, W8A16: `input_activations: null`), a `kv_cache_scheme`
for FP8 K/V with static scales, and an `ignore` list of modules left unquantized. Tensors
that go with it, per quantized linear: `weight` (float8_e4m3fn), `weight_scale` (fp32,
[out, 1] or [1]), `input_scale` (fp32, [1]; none for weight-only); per attention layer:
`self_attn.k_scale`, `self_attn.v_scale` (fp32, [1] or [kv_heads]).

Or int8 weight-only (W8A16 int, as llm-compressor writes it; its W8A16 preset groups 128
inputs a scale, which is not read here): format "pack-quantized", one group targeting
Linear with symmetric static 8-bit int weights (per channel or per tensor) and
`input_activations: null`, so every quantized linear is weight-only. Its
tensors, per quantized linear: `weight_packed` (int32 [out, ceil(in / 4)], four codes an
int32: runtime/formats/pack_quantized.py), `weight_shape` (int [2] = out, in),
`weight_scale` (fp32 [out, 1] or [1]); no `weight`, no `input_scale`. The KV cache scheme
is read as above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import CheckpointError
from .pack_quantized import pack_int8, weight_shape

WEIGHT_STRATEGY = {"channel": "channel", "tensor": "tensor"}  # recipe granularity -> format
KV_STRATEGY = {"layer": "tensor", "head": "attn_head"}


@dataclass(frozen=True)
class QuantScheme:
    """What the runtime needs to know from a quantization_config."""

    weight_strategy: str  # "channel" | "tensor"
    ignore: tuple[str, ...]  # module names kept unquantized
    kv_strategy: str | None  # "tensor" | "attn_head" | None (no FP8 KV scales)
    weight_only: tuple[str, ...] = ()  # linears with FP8 weights and unquantized input
    dynamic_inputs: bool = False  # the Linear group's inputs: per-token scales at run time
    # what a weight code is: "e4m3" (FP8 `weight`) or "int8" (pack-quantized
    # `weight_packed`, every quantized linear weight-only)
    weight_codes: str = "e4m3"

    def is_weight_only(self, module_name: str) -> bool:
        return self.weight_codes == "int8" or module_name in self.weight_only


def weight_tensors(module_name: str, codes: torch.Tensor) -> dict[str, torch.Tensor]:
    """The artifact tensors that hold a quantized linear's weight codes [out, in]:
    float8_e4m3fn -> `weight`; int8 -> `weight_packed` + `weight_shape` (pack-quantized)."""
    if codes.dtype == torch.int8:
        return {f"{module_name}.weight_packed": pack_int8(codes),
                f"{module_name}.weight_shape": weight_shape(codes)}
    if codes.dtype == torch.float8_e4m3fn:
        return {f"{module_name}.weight": codes}
    raise ValueError(f"{module_name}: weight codes must be float8_e4m3fn or int8, "
                     f"got {codes.dtype}.")


def _check_fp8(args: dict, what: str, source: str, dynamic_ok: bool = False) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8 or \
            (args.get("dynamic") and not dynamic_ok):
        kind = "static or dynamic 8-bit float (FP8)" if dynamic_ok else "static 8-bit float (FP8)"
        raise CheckpointError(f"{source}: {what} must be {kind}; got {args}.")


def parse_quantization_config(config: dict, source: str) -> QuantScheme:
    """Check that config.json describes an artifact qserve can run; name what is not."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{source}: no quantization_config; not a quantized artifact.")
    if qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{source}: quant_method {qc.get('quant_method')!r} is not "
                              "supported; qserve runs compressed-tensors FP8 artifacts.")
    groups = list((qc.get("config_groups") or {}).values())
    if qc.get("format") == "pack-quantized" or any(
            (g.get("weights") or {}).get("type") == "int" for g in groups):
        return _parse_int8_weight_only(qc, groups, source)
    static = [g for g in groups if g.get("input_activations") is not None]
    named = [g for g in groups if g.get("input_activations") is None]
    if len(static) != 1 or (static[0].get("targets") or []) != ["Linear"] or len(named) > 1:
        raise CheckpointError(
            f"{source}: expected one config group targeting Linear with static FP8 input "
            f"activations, and at most one weight-only group naming its modules; found "
            f"{len(groups)} group(s).")
    w, a = static[0].get("weights") or {}, static[0].get("input_activations") or {}
    _check_fp8(w, "weights", source)
    _check_fp8(a, "input_activations", source, dynamic_ok=True)
    dynamic = bool(a.get("dynamic"))
    if w.get("strategy") not in ("channel", "tensor") or \
            a.get("strategy") != ("token" if dynamic else "tensor"):
        raise CheckpointError(f"{source}: unsupported strategies (weights "
                              f"{w.get('strategy')!r}, activations {a.get('strategy')!r}).")
    weight_only: tuple[str, ...] = ()
    if named:
        targets = named[0].get("targets") or []
        w1 = named[0].get("weights") or {}
        _check_fp8(w1, "weight-only weights", source)
        if w1.get("strategy") != w.get("strategy"):
            raise CheckpointError(f"{source}: the weight-only group's weight strategy "
                                  f"{w1.get('strategy')!r} differs from {w.get('strategy')!r}.")
        if not targets or any(t == "Linear" or t.startswith("re:") for t in targets):
            raise CheckpointError(f"{source}: the weight-only group must name its modules "
                                  f"(no class names or patterns); got {targets}.")
        weight_only = tuple(targets)
    return QuantScheme(w["strategy"], tuple(qc.get("ignore") or ()), _kv_strategy(qc, source),
                       weight_only, dynamic)


def _kv_strategy(qc: dict, source: str) -> str | None:
    kv = qc.get("kv_cache_scheme")
    if kv is None:
        return None
    kv_strategy = kv.get("strategy")
    if kv_strategy not in KV_STRATEGY.values():
        raise CheckpointError(f"{source}: kv_cache_scheme strategy {kv_strategy!r} "
                              "is not supported.")
    return kv_strategy


def _parse_int8_weight_only(qc: dict, groups: list[dict], source: str) -> QuantScheme:
    """An int8 weight-only (W8A16 int, pack-quantized) config; name what is off."""
    if len(groups) != 1 or (groups[0].get("targets") or []) != ["Linear"] or \
            groups[0].get("input_activations") is not None:
        raise CheckpointError(
            f"{source}: an int8 weight config must have one config group targeting Linear "
            f"with input_activations null (weight-only W8A16); found {len(groups)} group(s).")
    w = groups[0].get("weights") or {}
    if w.get("type") != "int" or w.get("num_bits") != 8 or w.get("dynamic") or \
            w.get("symmetric") is not True:
        raise CheckpointError(f"{source}: int weights must be static symmetric 8-bit "
                              f"(W8A16); got {w}.")
    if w.get("strategy") not in ("channel", "tensor") or w.get("group_size") is not None:
        raise CheckpointError(f"{source}: int8 weights must be per channel or per tensor "
                              f"(no groups); got strategy {w.get('strategy')!r}, group_size "
                              f"{w.get('group_size')!r}.")
    if "pack-quantized" not in (qc.get("format"), groups[0].get("format")):
        raise CheckpointError(f"{source}: int8 weights are read in the pack-quantized format "
                              f"(weight_packed tensors); got format {qc.get('format')!r}.")
    return QuantScheme(w["strategy"], tuple(qc.get("ignore") or ()), _kv_strategy(qc, source),
                       weight_codes="int8")
