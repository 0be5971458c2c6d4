"""CPU linear over a weight packed once into oneDNN's blocked layout.

    packed = pack_linear_weight(w)        # w [out, in] bf16, once at load
    y = onednn_linear(x, packed)          # x [T, in] bf16 -> [T, out] bf16, fp32 accumulation

A plain `x @ w.t()` lets oneDNN reorder the weight into its blocked layout on every call;
packing does it once, which is faster for decode-sized inputs on AMX and AVX512-BF16 CPUs
(`python -m qserve.runtime.benchmark.linear` shows the paths side by side). Results are the
same bf16 values as `F.linear` on the shapes tested (both accumulate in fp32 inside oneDNN);
the order of the sums may differ between the two for some row counts, as it may between row
counts of either.

The packed tensor keeps the weight's shape and dtype but not its element order: read it
only through `onednn_linear`.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """True when this torch build and CPU can pack and run `dtype` linears in oneDNN."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        w = torch.ones(8, 16, dtype=dtype)
        y = onednn_linear(torch.ones(2, 16, dtype=dtype), pack_linear_weight(w))
        return bool((y == 16).all())
    except (AttributeError, RuntimeError):
        return False


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] bf16 on CPU -> the same data in oneDNN's blocked layout."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        raise ValueError(f"packing needs a 2-D bf16 CPU weight, got {weight.dtype} "
                         f"{list(weight.shape)} on {weight.device}.")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def onednn_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] bf16 @ packed[out, in].T (+ bias) -> [T, out] bf16."""
    if x.dim() != 2 or x.shape[1] != packed.shape[1] or x.dtype != packed.dtype:
        raise ValueError(f"onednn_linear: x {x.dtype} {list(x.shape)} does not match the packed "
                         f"weight {packed.dtype} {list(packed.shape)} ([T, in] of the same dtype).")
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
