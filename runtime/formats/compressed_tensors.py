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

Or W8A8 int8 (as llm-compressor writes it): format "int-quantized", the Linear group with
symmetric static 8-bit int weights (per channel or per tensor) and dynamic symmetric 8-bit
int input activations per token (`strategy: token`); per quantized linear `weight` (int8
[out, in]) and `weight_scale`; no `input_scale`. Linears named weight-only beside it are
int8 pack-quantized, in a group of their own.

Beside the Linear group, any number of groups may name modules (exact names) that are
weight-only, each with FP8 or int8 weights: an LM head with its own format (a recipe's
`lm_head: int8 | fp8`) is one. Where the groups' formats differ the config's format is
"mixed-precision" and each group says its own (`format`), as compressed-tensors writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .errors import CheckpointError
from .pack_quantized import pack_int8, weight_shape

WEIGHT_STRATEGY = {"channel": "channel", "tensor": "tensor"}  # recipe granularity -> format
INT8_W8A8_FORMAT = "int-quantized"  # W8A8 int8: `weight` int8 tensors
KV_STRATEGY = {"layer": "tensor", "head": "attn_head"}


@dataclass(frozen=True)
class QuantScheme:
    """What the runtime needs to know from a quantization_config."""

    weight_strategy: str  # "channel" | "tensor"
    ignore: tuple[str, ...]  # module names kept unquantized
    kv_strategy: str | None  # "tensor" | "attn_head" | None (no FP8 KV scales)
    weight_only: tuple[str, ...] = ()  # linears with FP8 weights and unquantized input
    dynamic_inputs: bool = False  # the Linear group's inputs: per-token scales at run time
    # what a weight code of the Linear group is: "e4m3" (FP8 `weight`) or "int8"
    # (pack-quantized `weight_packed`, every quantized linear weight-only)
    weight_codes: str = "e4m3"
    # (module, codes) for named modules whose codes differ from weight_codes (an LM head
    # with its own format)
    codes: tuple[tuple[str, str], ...] = ()

    def is_weight_only(self, module_name: str) -> bool:
        return (self.weight_codes == "int8" and not self.dynamic_inputs) \
            or module_name in self.weight_only

    def reader_of(self, module_name: str) -> str:
        """How a quantized linear's weight codes are stored: "e4m3" (FP8 `weight`), "int8"
        (pack-quantized `weight_packed`) or "int8-plain" (W8A8 int8's int8 `weight`)."""
        codes = self.codes_of(module_name)
        if codes == "int8" and not self.is_weight_only(module_name):
            return "int8-plain"
        return codes

    def codes_of(self, module_name: str) -> str:
        """What a weight code of quantized linear `module_name` is: "e4m3" or "int8"."""
        return dict(self.codes).get(module_name, self.weight_codes)


def weight_tensors(module_name: str, codes: torch.Tensor,
                   int8_packed: bool = True) -> dict[str, torch.Tensor]:
    """The artifact tensors that hold a quantized linear's weight codes [out, in]:
    float8_e4m3fn -> `weight`; int8 -> `weight_packed` + `weight_shape` (pack-quantized),
    or `weight` itself where int8_packed is False (W8A8 int8, "int-quantized")."""
    if codes.dtype == torch.int8 and not int8_packed:
        return {f"{module_name}.weight": codes}
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
    main = [g for g in groups if (g.get("targets") or []) == ["Linear"]]
    named = [g for g in groups if (g.get("targets") or []) != ["Linear"]]
    if len(main) != 1:
        raise CheckpointError(
            f"{source}: expected one config group targeting Linear (and groups naming "
            f"weight-only modules); found {len(groups)} group(s), {len(main)} targeting Linear.")
    if (main[0].get("weights") or {}).get("type") == "int" and \
            main[0].get("input_activations") is not None:
        scheme = _parse_int8_w8a8(qc, main[0], source)
    elif (main[0].get("weights") or {}).get("type") == "int":
        scheme = _parse_int8_weight_only(qc, main[0], source)
    else:
        scheme = _parse_fp8(qc, main[0], source)
    weight_only, codes = [], []
    for g in named:  # each a weight-only group naming its modules
        targets = g.get("targets") or []
        if not targets or any(t == "Linear" or t.startswith("re:") for t in targets):
            raise CheckpointError(f"{source}: a group other than Linear's must name its "
                                  f"modules (no class names or patterns); got {targets}.")
        if g.get("input_activations") is not None:
            raise CheckpointError(f"{source}: the group naming {targets} quantizes its inputs; "
                                  "only the Linear group may (the others are weight-only).")
        w = g.get("weights") or {}
        if w.get("type") == "int":
            _check_int8(qc, g, w, source)
            kind = "int8"
        else:
            _check_fp8(w, f"the weights of {targets}", source)
            if w.get("strategy") not in ("channel", "tensor"):
                raise CheckpointError(f"{source}: the weights of {targets} must be per channel "
                                      f"or per tensor; got {w.get('strategy')!r}.")
            kind = "e4m3"
        weight_only += targets
        codes += [(t, kind) for t in targets if kind != scheme.weight_codes]
    return replace(scheme, weight_only=tuple(weight_only), codes=tuple(codes))


def _parse_fp8(qc: dict, group: dict, source: str) -> QuantScheme:
    """The Linear group of an FP8 config: static FP8 weights, static or dynamic FP8 inputs."""
    w, a = group.get("weights") or {}, group.get("input_activations")
    if a is None:
        raise CheckpointError(f"{source}: the Linear group must have static or dynamic FP8 "
                              "input activations (weight-only FP8 linears are named in a "
                              "group of their own).")
    _check_fp8(w, "weights", source)
    _check_fp8(a, "input_activations", source, dynamic_ok=True)
    dynamic = bool(a.get("dynamic"))
    if w.get("strategy") not in ("channel", "tensor") or \
            a.get("strategy") != ("token" if dynamic else "tensor"):
        raise CheckpointError(f"{source}: unsupported strategies (weights "
                              f"{w.get('strategy')!r}, activations {a.get('strategy')!r}).")
    return QuantScheme(w["strategy"], tuple(qc.get("ignore") or ()), _kv_strategy(qc, source),
                       dynamic_inputs=dynamic)


def _kv_strategy(qc: dict, source: str) -> str | None:
    kv = qc.get("kv_cache_scheme")
    if kv is None:
        return None
    kv_strategy = kv.get("strategy")
    if kv_strategy not in KV_STRATEGY.values():
        raise CheckpointError(f"{source}: kv_cache_scheme strategy {kv_strategy!r} "
                              "is not supported.")
    return kv_strategy


def _parse_int8_weight_only(qc: dict, group: dict, source: str) -> QuantScheme:
    """The Linear group of an int8 weight-only (W8A16 int, pack-quantized) config."""
    if group.get("input_activations") is not None:
        raise CheckpointError(
            f"{source}: an int8 Linear group must have input_activations null (weight-only "
            "W8A16).")
    w = group.get("weights") or {}
    _check_int8(qc, group, w, source)
    return QuantScheme(w["strategy"], tuple(qc.get("ignore") or ()), _kv_strategy(qc, source),
                       weight_codes="int8")


def _parse_int8_w8a8(qc: dict, group: dict, source: str) -> QuantScheme:
    """The Linear group of a W8A8 int8 (int-quantized) config: static symmetric int8
    weights, dynamic symmetric int8 inputs per token."""
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    if a.get("type") != "int" or a.get("num_bits") != 8 or a.get("dynamic") is not True \
            or a.get("strategy") != "token" or a.get("symmetric") is not True:
        raise CheckpointError(f"{source}: int8 inputs must be dynamic symmetric 8-bit per "
                              f"token (W8A8 int8); got {a}.")
    _check_int8(qc, group, w, source, INT8_W8A8_FORMAT)
    return QuantScheme(w["strategy"], tuple(qc.get("ignore") or ()), _kv_strategy(qc, source),
                       dynamic_inputs=True, weight_codes="int8")


def _check_int8(qc: dict, group: dict, w: dict, source: str,
                fmt: str = "pack-quantized") -> None:
    """A group's int weights: static symmetric 8-bit, per channel or tensor, pack-quantized."""
    if w.get("type") != "int" or w.get("num_bits") != 8 or w.get("dynamic") or \
            w.get("symmetric") is not True:
        raise CheckpointError(f"{source}: int weights must be static symmetric 8-bit; "
                              f"got {w}.")
    if w.get("strategy") not in ("channel", "tensor") or w.get("group_size") is not None:
        raise CheckpointError(f"{source}: int8 weights must be per channel or per tensor "
                              f"(no groups); got strategy {w.get('strategy')!r}, group_size "
                              f"{w.get('group_size')!r}.")
    if fmt not in (qc.get("format"), group.get("format")):
        tensors = "weight_packed" if fmt == "pack-quantized" else "int8 weight"
        raise CheckpointError(f"{source}: these int8 weights are read in the {fmt} format "
                              f"({tensors} tensors); got format "
                              f"{group.get('format') or qc.get('format')!r}.")
