"""The paged KV store in C on CPU for bf16 K/V (csrc/kv_store_cpu.c).

    store_kv_native(k, v, k_pool, v_pool, slots, k_scale, v_scale)   # mutates the pools

k, v: bf16 [T, Hkv, D] (heads contiguous in each token); pools: contiguous FP8 (E4M3 or
uint8 bytes) or bf16 [num_blocks, block_size, Hkv, D]; slots: [T] int64, distinct, in
range (a checked step plan's store_slots); scales fp32 [1] or [Hkv] (FP8 pools).
kernels/kv_store.py's torch path bit for bit (tested), in one call instead of ~10 ops.
"""

from __future__ import annotations

import torch

from .fp8 import FP8_DTYPE
from .native_build import cached_library
from .native_call import keyword_calls

POOL_KINDS = {FP8_DTYPE: 0, torch.uint8: 0, torch.bfloat16: 1}  # the C `kind`

# the loaded library with its functions' signatures set, or None where it cannot build
_library = cached_library("kv_store_cpu")


def available() -> bool:
    """True when the C library is built and loaded (builds it on first call)."""
    return _library() is not None


def usable(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    def rows(x):  # [T, Hkv, D] bf16 CPU, heads contiguous within a token
        return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 3
                and x.stride(2) == 1 and x.stride(1) == x.shape[2])

    return (rows(k) and rows(v) and k_pool.dtype in POOL_KINDS and v_pool.dtype == k_pool.dtype
            and k_pool.is_contiguous() and v_pool.is_contiguous()
            and k_pool.device.type == "cpu" and _library() is not None)


@keyword_calls("kv_store_cpu")
def store_kv_native(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, slots: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> None:
    if not usable(k, v, k_pool, v_pool):
        raise ValueError(f"store_kv_native takes bf16 CPU k/v [T, Hkv, D] and contiguous "
                         f"{sorted(map(str, POOL_KINDS))} pools; got k {k.dtype}, pool "
                         f"{k_pool.dtype}.")
    t, hkv, d = k.shape
    kind = POOL_KINDS[k_pool.dtype]
    slots = slots.to(torch.int64).contiguous()
    if kind == 0:
        ks, vs = (s.to(torch.float32).contiguous().reshape(-1) for s in (k_scale, v_scale))
        scale_len = ks.numel()
        ks_ptr, vs_ptr = ks.data_ptr(), vs.data_ptr()
    else:
        scale_len, ks_ptr, vs_ptr = 1, None, None
    _library().qserve_store_kv(k=k.data_ptr(), k_stride=k.stride(0), v=v.data_ptr(),
                               v_stride=v.stride(0), tokens=t, hkv=hkv, d=d,
                               slots=slots.data_ptr(), kind=kind, k_scale=ks_ptr,
                               v_scale=vs_ptr, scale_len=scale_len, k_pool=k_pool.data_ptr(),
                               v_pool=v_pool.data_ptr())


__all__ = ["POOL_KINDS", "available", "store_kv_native", "usable"]
