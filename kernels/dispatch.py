"""The one place that picks a kernel implementation: Triton on CUDA, torch elsewhere.

    from qserve.kernels import dispatch
    dispatch.store_kv(k, v, k_pool, v_pool, slot_mapping, k_scale, v_scale)
    out = dispatch.paged_attention(q, k_pool, v_pool, block_tables, ...)

`KERNELS` maps an operation to its implementations by backend name, as "module:function"
paths imported on first use (so importing this module never imports Triton, and a test
can set TRITON_INTERPRET=1 before the first Triton kernel is imported).

Which backend runs: the `backend` argument if given, else the QSERVE_KERNELS environment
variable ("torch", "triton" or "auto"), else "auto": Triton when the tensors live on a
CUDA device, torch otherwise. Forcing "triton" on CPU tensors runs the kernels under the
Triton interpreter and needs TRITON_INTERPRET=1 (the kernels say so if it is missing).
"""

from __future__ import annotations

import importlib
import os
from typing import Callable

import torch

KERNELS: dict[str, dict[str, str]] = {
    "paged_attention": {
        "torch": "qserve.kernels.paged_attention:paged_attention",
        "triton": "qserve.kernels.triton_paged_attention:paged_attention_triton",
    },
    "store_kv": {
        "torch": "qserve.kernels.kv_store:store_kv",
        "triton": "qserve.kernels.triton_kv_store:store_kv_triton",
    },
    # steps replayed from fixed device buffers (runtime/decode_graphs.py): the same
    # kernels, with no host read of the step's metadata; Triton only
    "store_kv_static": {
        "triton": "qserve.kernels.triton_kv_store:store_kv_static",
    },
    "decode_attention_static": {
        "triton": "qserve.kernels.triton_paged_attention:decode_attention_static",
    },
    "fp8_linear": {
        "torch": "qserve.kernels.fp8_gemm:fp8_linear_torch",
        "triton": "qserve.kernels.triton_fp8_gemm:fp8_linear_triton",
        # an FP8 GEMM only: torch._scaled_mm (runtime/execution_backend.py picks it on
        # CUDA devices with FP8 tensor cores)
        "scaled_mm": "qserve.kernels.fp8_gemm:fp8_linear_scaled_mm",
    },
}
BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "QSERVE_KERNELS"
_resolved: dict[tuple[str, str], Callable] = {}


def backend_for(device: torch.device, backend: str | None = None) -> str:
    """The backend name that runs on `device`: argument > QSERVE_KERNELS > auto."""
    choice = backend or os.environ.get(ENV_VAR, "auto") or "auto"
    if choice not in BACKENDS:
        source = "backend argument" if backend else f"{ENV_VAR}"
        raise ValueError(f"{source} is {choice!r}; choose one of {list(BACKENDS)}.")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return choice


def kernel(op: str, device: torch.device, backend: str | None = None) -> Callable:
    """The implementation of `op` for tensors on `device`."""
    if op not in KERNELS:
        raise ValueError(f"unknown kernel {op!r}; known: {sorted(KERNELS)}.")
    # an implementation only some ops have (e.g. fp8_linear's "scaled_mm"), named outright
    name = backend if backend in KERNELS[op] else backend_for(device, backend)
    if name not in KERNELS[op]:
        raise ValueError(f"{op} has no {name!r} implementation; it has "
                         f"{sorted(KERNELS[op])}.")
    key = (op, name)
    if key not in _resolved:
        module, func = KERNELS[op][name].split(":")
        _resolved[key] = getattr(importlib.import_module(module), func)
    return _resolved[key]


def paged_attention(q, k_pool, v_pool, block_tables, query_start_loc, seq_lens, k_scale,
                    v_scale, scale, sliding_window=None, logit_softcap=None, *,
                    out=None, decode_impl: str | None = None, num_splits: int | None = None,
                    plan=None, backend: str | None = None) -> torch.Tensor:
    """kernels/paged_attention.paged_attention's contract on the chosen backend.

    decode_impl and plan (a kernels/paged_plan.PagedStepPlan) apply to the torch path,
    num_splits to the Triton path (which caches its own layout per step); each is ignored
    by the other (they tune how, not what, is computed).
    """
    name = backend_for(q.device, backend)
    fn = kernel("paged_attention", q.device, name)
    extra = ({"decode_impl": decode_impl, "plan": plan} if name == "torch"
             else {"num_splits": num_splits})
    return fn(q, k_pool, v_pool, block_tables, query_start_loc, seq_lens, k_scale, v_scale,
              scale, sliding_window, logit_softcap, out=out, **extra)


def store_kv(k, v, k_pool, v_pool, slot_mapping, k_scale=None, v_scale=None, *,
             plan=None, backend: str | None = None) -> None:
    """kernels/kv_store.store_kv's contract on the chosen backend (mutates the pools);
    plan (torch path only) is the step's checked PagedStepPlan."""
    name = backend_for(k_pool.device, backend)
    extra = {"plan": plan} if name == "torch" else {}
    kernel("store_kv", k_pool.device, name)(k, v, k_pool, v_pool, slot_mapping, k_scale,
                                            v_scale, **extra)


def fp8_linear(x, weight, weight_scale, input_scale, bias=None, *,
               backend: str | None = None) -> torch.Tensor:
    """kernels/fp8_gemm.fp8_linear_torch's contract on the chosen backend ("scaled_mm":
    torch._scaled_mm, kernels/fp8_gemm.fp8_linear_scaled_mm).

    The Triton and scaled_mm paths take the weight as float8_e4m3fn; the torch path also
    accepts the E4M3 values held in the compute dtype (how the CPU runtime keeps them).
    """
    return kernel("fp8_linear", x.device, backend)(x, weight, weight_scale, input_scale, bias)
