"""RMS normalisation of bf16 rows in C on CPU (csrc/rms_norm_cpu.c).

    out = rms_norm_bf16(x, weight, eps, kind)   # bf16 [..., dim]; kind: NORM_KINDS key

"llama": weight * bf16(x * r); "gemma": bf16(x * r * (1 + weight)), r = rsqrt(mean(x^2) +
eps) in fp32: runtime/layers/norm.py's arithmetic and roundings in one call (a one-row norm
is ~8 torch ops, each with its dispatch cost, and a decode step has 60 norms). The sum of
squares runs in another fp32 order than torch's, so a result may differ from the torch ops
by a bf16 step where r's last bit moves. `available()` says whether the library is built.
"""

from __future__ import annotations

import torch

from .native_build import cached_library
from .native_call import keyword_calls

NORM_KINDS = {"llama": 0, "gemma": 1}  # the C `kind`

# the loaded library with its functions' signatures set, or None where it cannot build
_library = cached_library("rms_norm_cpu")


def available() -> bool:
    """True when the C library is built and loaded (builds it on first call)."""
    return _library() is not None


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rms_norm_bf16 takes these: bf16 CPU rows with unit stride, a bf16 weight."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.device.type == "cpu" and x.dim() >= 1 and x.stride(-1) == 1
            and weight.is_contiguous() and weight.shape == x.shape[-1:] and available())


@keyword_calls("rms_norm_cpu")
def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float, kind: str) -> torch.Tensor:
    if kind not in NORM_KINDS:
        raise ValueError(f"norm kind {kind!r} unknown; choose one of {sorted(NORM_KINDS)}.")
    if not usable(x, weight):
        raise ValueError(f"rms_norm_bf16 takes bf16 CPU rows with unit stride and a bf16 "
                         f"weight of their width; got x {x.dtype} {list(x.shape)}, weight "
                         f"{weight.dtype} {list(weight.shape)}.")
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)  # a view where the leading dims allow (else one copy)
    out = torch.empty(rows.shape, dtype=torch.bfloat16)
    _library().qserve_rms_norm_bf16(x=rows.data_ptr(), rows=rows.shape[0],
                                    stride=rows.stride(0), dim=dim, w=weight.data_ptr(),
                                    eps=float(eps), kind=NORM_KINDS[kind], out=out.data_ptr(),
                                    num_threads=torch.get_num_threads())
    return out.view(x.shape)


__all__ = ["NORM_KINDS", "available", "rms_norm_bf16", "usable"]
