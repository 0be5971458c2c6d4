"""Fuse the projections that read the same input into one linear, once, before serving.

    n = fuse_projections(model)   # number of fused groups

q/k/v of every SelfAttention and gate/up of every GatedMLP read the same activations, so
one matmul against the stacked weights replaces three (two), and an FP8 group quantizes
its input once. Exact: the quantizer gives a group one static input scale (see
quantize/calibrator.py SHARED_INPUT_GROUPS, as vLLM expects for its fused layers); a
group whose input scales differ, or whose members are of different kinds, is left
separate. Each output column is the same dot product as before; only the matmul library's
blocking may change the order of its fp32 sums. The fused module replaces the
separate ones (no second copy of the weights); the modules keep their HF names for
loading, so fusion runs after loading. Idempotent.
"""

from __future__ import annotations

import torch
from torch import nn

from .fp8_linear import Fp8Linear
from .mlp import GatedMLP
from .self_attention import SelfAttention


def fuse_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One linear computing cat([p(x) for p in parts], -1), or None when not exact."""
    if all(type(p) is nn.Linear for p in parts):
        if len({(p.weight.dtype, p.weight.device) for p in parts}) != 1 or \
                len({p.bias is None for p in parts}) != 1:
            return None
        fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts),
                          bias=parts[0].bias is not None, device="meta")
        fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]),
                                    requires_grad=False)
        if parts[0].bias is not None:
            fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]),
                                      requires_grad=False)
        return fused
    if all(isinstance(p, Fp8Linear) and not p.packed for p in parts):
        s_in = parts[0].input_scale  # [1] fp32, or None (weight-only or dynamic)
        same_input = all(p.input_scale is None for p in parts) if s_in is None else \
            all(p.input_scale is not None and torch.equal(p.input_scale, s_in) for p in parts)
        same_input = same_input and len({p.dynamic_input for p in parts}) == 1
        if not same_input or len({p.bias is None for p in parts}) != 1:
            return None
        # per-tensor weight scales become per-channel rows: the same numbers, repeated
        w_scale = torch.cat([p.weight_scale.expand(p.out_features, 1) for p in parts])
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        # E4M3 values in the compute dtype, or int8 codes (W8A8 int8)
        weight = torch.cat([p.weight.detach() for p in parts])
        if len({p.codes for p in parts}) != 1 or len({p.compute_dtype for p in parts}) != 1:
            return None
        return Fp8Linear(weight, w_scale, s_in, bias, parts[0].compute_dtype,
                         parts[0].dynamic_input, parts[0].codes)
    return None


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up in every layer of `model` where it is exact."""
    count = 0
    for module in model.modules():
        if isinstance(module, SelfAttention) and module.qkv_proj is None:
            fused = fuse_linears([module.q_proj, module.k_proj, module.v_proj])
            if fused is not None:
                module.qkv_proj = fused
                del module.q_proj, module.k_proj, module.v_proj
                count += 1
        elif isinstance(module, GatedMLP) and module.gate_up_proj is None:
            fused = fuse_linears([module.gate_proj, module.up_proj])
            if fused is not None:
                module.gate_up_proj = fused
                del module.gate_proj, module.up_proj
                count += 1
    return count
