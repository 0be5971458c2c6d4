"""The `quantization_config` block of config.json, in the compressed-tensors format: what
it says and how the runtime reads it (quantize/compressed_tensors.py writes it).

The format vLLM and SGLang load for FP8 checkpoints: one config group targeting Linear
layers with static FP8 weights (per channel or per tensor) and static per-tensor FP8
input activations, a `kv_cache_scheme` for FP8 K/V with static scales, and an `ignore`
list of modules left unquantized. Tensors that go with it, per quantized linear:
`weight` (float8_e4m3fn), `weight_scale` (fp32, [out, 1] or [1]), `input_scale` (fp32, [1]);
per attention layer: `self_attn.k_scale`, `self_attn.v_scale` (fp32, [1] or [kv_heads]).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import CheckpointError

WEIGHT_STRATEGY = {"channel": "channel", "tensor": "tensor"}  # recipe granularity -> format
KV_STRATEGY = {"layer": "tensor", "head": "attn_head"}


@dataclass(frozen=True)
class QuantScheme:
    """What the runtime needs to know from a quantization_config."""

    weight_strategy: str  # "channel" | "tensor"
    ignore: tuple[str, ...]  # module names kept unquantized
    kv_strategy: str | None  # "tensor" | "attn_head" | None (no FP8 KV scales)


def parse_quantization_config(config: dict, source: str) -> QuantScheme:
    """Check that config.json describes an artifact qserve can run; name what is not."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{source}: no quantization_config; not a quantized artifact.")
    if qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{source}: quant_method {qc.get('quant_method')!r} is not "
                              "supported; qserve runs compressed-tensors FP8 artifacts.")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise CheckpointError(f"{source}: expected one config group, found {len(groups)}.")
    group = next(iter(groups.values()))
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    for name, args in (("weights", w), ("input_activations", a)):
        if args.get("type") != "float" or args.get("num_bits") != 8 or args.get("dynamic"):
            raise CheckpointError(f"{source}: {name} must be static 8-bit float (FP8); "
                                  f"got {args}.")
    if w.get("strategy") not in ("channel", "tensor") or a.get("strategy") != "tensor":
        raise CheckpointError(f"{source}: unsupported strategies (weights "
                              f"{w.get('strategy')!r}, activations {a.get('strategy')!r}).")
    kv = qc.get("kv_cache_scheme")
    kv_strategy = None
    if kv is not None:
        kv_strategy = kv.get("strategy")
        if kv_strategy not in KV_STRATEGY.values():
            raise CheckpointError(f"{source}: kv_cache_scheme strategy {kv_strategy!r} "
                                  "is not supported.")
    return QuantScheme(w["strategy"], tuple(qc.get("ignore") or ()), kv_strategy)
