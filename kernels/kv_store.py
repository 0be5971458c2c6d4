"""KV store: write the new tokens' K and V into their slots of a paged cache.

A pool is `[num_blocks, block_size, num_kv_heads, head_dim]`; slot `s` is row
`s % block_size` of block `s // block_size`, so a flat `[num_blocks * block_size, Hkv, D]`
view indexes slots directly. FP8 pools (float8_e4m3fn, or uint8 holding its bytes) get
K/V quantized with the static per-layer ([1]) or per-head ([Hkv]) scales through the one
`quantize_fp8`; bf16/fp16/fp32 pools store K/V cast to the pool dtype.

On CPU the torch path is the kernel (one index_put per pool); `store_kv_reference` is the
obvious per-token loop it is tested against.
"""

from __future__ import annotations

import torch

from . import native_kv_store
from .fp8 import FP8_DTYPE, quantize_fp8
from .paged_plan import PagedStepPlan

FLOAT_POOL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def is_fp8_pool(pool: torch.Tensor) -> bool:
    return pool.dtype in (FP8_DTYPE, torch.uint8)


def as_fp8_view(pool: torch.Tensor) -> torch.Tensor:
    """The pool as float8_e4m3fn (a uint8 pool is reinterpreted, not converted)."""
    return pool.view(FP8_DTYPE) if pool.dtype == torch.uint8 else pool


def check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a K/V pool pair; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], "
                             f"got shape {list(pool.shape)}.")
        if not (is_fp8_pool(pool) or pool.dtype in FLOAT_POOL_DTYPES):
            raise ValueError(f"{name} has dtype {pool.dtype}; expected float8_e4m3fn (or uint8 "
                             f"holding FP8 bytes), bfloat16, float16 or float32.")
        if not pool.is_contiguous():
            raise ValueError(f"{name} must be contiguous (a preallocated KVCache pool).")
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool {list(k_pool.shape)} and v_pool {list(v_pool.shape)} differ.")
    if is_fp8_pool(k_pool) != is_fp8_pool(v_pool) or (
            not is_fp8_pool(k_pool) and k_pool.dtype != v_pool.dtype):
        raise ValueError(f"k_pool ({k_pool.dtype}) and v_pool ({v_pool.dtype}) must share a dtype.")
    return tuple(k_pool.shape)  # type: ignore[return-value]


def check_scale(name: str, scale, fp8: bool, num_kv_heads: int) -> torch.Tensor | None:
    """An FP8 pool needs an fp32 scale of [1] (per layer) or [Hkv] (per head); others none.

    Returns the scale as a float32 tensor of shape [1] or [Hkv], or None.
    """
    if not fp8:
        if scale is not None:
            raise ValueError(f"{name} was given for a non-FP8 pool; scales apply to FP8 pools "
                             f"only, pass None.")
        return None
    if scale is None:
        raise ValueError(f"{name} is required for an FP8 pool (the artifact's static KV scale).")
    scale = torch.as_tensor(scale)
    if scale.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {scale.dtype}.")
    scale = scale.reshape(-1)
    if scale.numel() not in (1, num_kv_heads):
        raise ValueError(f"{name} must have 1 (per layer) or {num_kv_heads} (per kv head) "
                         f"elements, got {scale.numel()}.")
    return scale


def check_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
             v_pool: torch.Tensor) -> tuple[int, int, int, int]:
    """New K/V [T, Hkv, D] floating point, matching the pools; returns check_pools'."""
    num_blocks, block_size, hkv, d = check_pools(k_pool, v_pool)
    if k.dim() != 3 or tuple(k.shape[1:]) != (hkv, d) or k.shape != v.shape:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} must both be "
                         f"[num_tokens, {hkv}, {d}] to match the pools.")
    if not (k.is_floating_point() and v.is_floating_point()):
        raise ValueError(f"k/v must be floating point, got {k.dtype}/{v.dtype}.")
    return num_blocks, block_size, hkv, d


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D] fp8 / uint8 / bf16 ...
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset; -1 = skip
    k_scale: torch.Tensor | None = None,  # fp32 [1] or [Hkv] for FP8 pools
    v_scale: torch.Tensor | None = None,
    *,
    plan: PagedStepPlan | None = None,  # the step's checked slots (built here if None)
) -> None:
    """Write k[i], v[i] into slot slot_mapping[i] of the pools (in place). Mutates the pools.

    Slots must be distinct; a slot of -1 skips that token (padding). A `plan` built from
    this step's slot_mapping stands in for it (its slots are already checked).
    """
    num_blocks, block_size, hkv, d = check_kv(k, v, k_pool, v_pool)
    fp8 = is_fp8_pool(k_pool)
    k_scale = check_scale("k_scale", k_scale, fp8, hkv)
    v_scale = check_scale("v_scale", v_scale, fp8, hkv)
    if plan is None:
        plan = PagedStepPlan.build(k.shape[0], num_blocks, block_size, slot_mapping)
    else:
        plan.check_for(k.shape[0], num_blocks, block_size)
    slots = plan.store_slots
    if plan.store_rows is None and native_kv_store.usable(k, v, k_pool, v_pool):
        native_kv_store.store_kv_native(k, v, k_pool, v_pool, slots, k_scale, v_scale)
        return  # bf16 on CPU: one C call, the same bytes
    if plan.store_rows is not None:
        k, v = k[plan.store_rows], v[plan.store_rows]
    if slots.numel() == 0:
        return

    if fp8:
        kq = quantize_fp8(k, k_scale.view(1, -1, 1))  # [T, Hkv, D] float8_e4m3fn
        vq = quantize_fp8(v, v_scale.view(1, -1, 1))
        as_fp8_view(k_pool).view(-1, hkv, d)[slots] = kq
        as_fp8_view(v_pool).view(-1, hkv, d)[slots] = vq
    else:
        k_pool.view(-1, hkv, d)[slots] = k.to(k_pool.dtype)
        v_pool.view(-1, hkv, d)[slots] = v.to(v_pool.dtype)


def store_kv_reference(k, v, k_pool, v_pool, slot_mapping, k_scale=None, v_scale=None) -> None:
    """One token at a time, indexing [block, offset]: what store_kv must do."""
    block_size = k_pool.shape[1]
    fp8 = is_fp8_pool(k_pool)
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, block_size)
        for x, pool, scale in ((k, k_pool, k_scale), (v, v_pool, v_scale)):
            if fp8:
                s = torch.as_tensor(scale, dtype=torch.float32).reshape(-1, 1)  # [1|Hkv, 1]
                as_fp8_view(pool)[blk, off] = quantize_fp8(x[i], s)
            else:
                pool[blk, off] = x[i].to(pool.dtype)
