"""The CPU linear for many rows, over a weight prepared once at load.

    packed = pack_linear_weight(w)        # w [out, in] bf16, once at load
    y = packed_linear(x, packed)          # x [T, in] bf16 -> [T, out] bf16, fp32 accumulation

Two strategies, chosen from the CPU (`strategy()`):
- "onednn-bf16" where oneDNN runs bf16 natively (AMX, AVX512-BF16): the weight moves into
  oneDNN's blocked bf16 layout (kernels/onednn_linear.py);
- "fp32" elsewhere (AVX2 + FMA, where bf16 matmuls are emulated and several times slower
  than fp32 ones): the weight is upcast once to fp32 (exact) and the matmul runs in fp32.
Both accumulate in fp32 and round the output once to the input's dtype, so they compute
the same values as a bf16 matmul up to the order of the fp32 sums.

QSERVE_CPU_LINEAR=onednn-bf16|fp32 forces one (tests use it to run both on one CPU).
"""

from __future__ import annotations

import functools
import os

import torch

from . import onednn_linear as onednn

STRATEGIES = ("onednn-bf16", "fp32")
ENV_VAR = "QSERVE_CPU_LINEAR"


@functools.cache
def _native_bf16() -> bool:
    return onednn.packing_available(torch.bfloat16)


def strategy() -> str:
    """The strategy packing uses now: QSERVE_CPU_LINEAR, else oneDNN where bf16 is native,
    else fp32."""
    forced = os.environ.get(ENV_VAR)
    if forced:
        if forced not in STRATEGIES:
            raise ValueError(f"{ENV_VAR}={forced!r}; choose one of {list(STRATEGIES)}.")
        if forced == "onednn-bf16" and not _native_bf16():
            raise ValueError(f"{ENV_VAR}=onednn-bf16, but this CPU or torch build has no "
                             f"oneDNN bf16; unset it or choose fp32.")
        return forced
    return "onednn-bf16" if _native_bf16() else "fp32"


def bulk_matmul_dtype() -> torch.dtype:
    """The dtype large matmuls run in fastest on this CPU: bf16 where its matmuls are native
    (oneDNN bf16), fp32 where they are emulated (AVX2 and below). Calibration computes in
    it (quantize/pipeline.py)."""
    return torch.float32 if strategy() == "fp32" else torch.bfloat16


def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """True when bf16 linears of this dtype can be packed (every CPU has the fp32 strategy)."""
    return dtype == torch.bfloat16


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bf16 on CPU -> the packed form of the current strategy: oneDNN's
    blocked bf16 layout (read it only through packed_linear) or an fp32 copy."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        raise ValueError(f"packing needs a 2-D bf16 CPU weight, got {weight.dtype} "
                         f"{list(weight.shape)} on {weight.device}.")
    if strategy() == "fp32":
        return weight.detach().to(torch.float32).contiguous()  # exact
    return onednn.pack_linear_weight(weight)


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] bf16 @ packed[out, in].T (+ bias) -> [T, out] bf16."""
    if x.dim() != 2 or x.shape[1] != packed.shape[1] or x.dtype != torch.bfloat16:
        raise ValueError(f"packed linear: x {x.dtype} {list(x.shape)} does not match the packed "
                         f"weight {packed.dtype} {list(packed.shape)} ([T, in] bf16).")
    if packed.dtype == torch.float32:
        b = None if bias is None else bias.to(torch.float32)
        return torch.nn.functional.linear(x.to(torch.float32), packed, b).to(x.dtype)
    return onednn.onednn_linear(x, packed, bias)


__all__ = ["ENV_VAR", "STRATEGIES", "pack_linear_weight", "packed_linear", "packing_available",
           "strategy"]
