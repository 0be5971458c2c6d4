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
    weight_only: tuple[str, ...] = ()  # linears with FP8 weights and unquantized input
    dynamic_inputs: bool = False  # the Linear group's inputs: per-token scales at run time

    def is_weight_only(self, module_name: str) -> bool:
        return module_name in self.weight_only


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
    kv = qc.get("kv_cache_scheme")
    kv_strategy = None
    if kv is not None:
        kv_strategy = kv.get("strategy")
        if kv_strategy not in KV_STRATEGY.values():
            raise CheckpointError(f"{source}: kv_cache_scheme strategy {kv_strategy!r} "
                                  "is not supported.")
    return QuantScheme(w["strategy"], tuple(qc.get("ignore") or ()), kv_strategy, weight_only,
                       dynamic)
