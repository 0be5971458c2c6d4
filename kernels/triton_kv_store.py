"""KV store as a Triton kernel: quantize new K/V with the static scales, write their slots.

Same contract as kernels/kv_store.store_kv (slot s is row s % block_size of block
s // block_size; -1 skips a token), and tested against its store_kv_reference byte for
byte. One program per (token, kv head) copies a [D] row for K and one for V.

FP8 pools: the kernel computes x / scale in fp32 (IEEE division, as torch), then
`e4m3_code` saturates and rounds to the E4M3 grid in exact integer/fp32 arithmetic and
the kernel stores the code through the pool's uint8 view. It never casts fp32 -> fp8
with `.to()`, which the Triton interpreter gets wrong for some values (see
kernels/triton_numerics.py), so the CPU test holds the kernel to exact bytes instead of
a tolerance. Float pools: the kernel is a copy; the wrapper casts K/V to the pool dtype
first (one torch cast, a no-op for the usual bf16 K/V into a bf16 pool).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_store import check_kv, check_scale, is_fp8_pool
from .triton_numerics import check_kernel_device, e4m3_code


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, stride_kt, stride_kh, stride_vt, stride_vh,  # [T, Hkv, D], last stride 1
    kp_ptr, vp_ptr,  # pools [num_blocks * block_size, Hkv, D] contiguous (uint8 if FP8)
    slot_ptr,  # [T] int64
    ks_ptr, vs_ptr,  # [Hkv] fp32 (FP8 only)
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    d = tl.arange(0, BLOCK_D)
    mask = (d < D) & (slot >= 0)
    dst = slot.to(tl.int64) * (HKV * D) + h * D + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if FP8:
        k_code = e4m3_code(tl.math.div_rn(k.to(tl.float32), tl.load(ks_ptr + h)))
        v_code = e4m3_code(tl.math.div_rn(v.to(tl.float32), tl.load(vs_ptr + h)))
        tl.store(kp_ptr + dst, k_code, mask=mask)
        tl.store(vp_ptr + dst, v_code, mask=mask)
    else:
        tl.store(kp_ptr + dst, k, mask=mask)
        tl.store(vp_ptr + dst, v, mask=mask)


def _check_slots(slots: torch.Tensor, num_tokens: int, num_slots: int) -> None:
    if slots.dtype not in (torch.int64, torch.int32) or slots.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be int64 of shape [{num_tokens}], got "
                         f"{slots.dtype} {list(slots.shape)}.")
    if num_tokens == 0:
        return
    if bool((slots < -1).any()):
        raise ValueError("slot_mapping holds values below -1; use -1 to skip a token.")
    if int(slots.max()) >= num_slots:
        raise ValueError(f"slot_mapping holds slot {int(slots.max())}, beyond the pool's "
                         f"{num_slots} slots.")
    used = slots[slots >= 0]
    if torch.unique(used).numel() != used.numel():
        raise ValueError("slot_mapping writes the same slot twice; each token needs its own slot.")


_last_slots: list = []  # [(host copy of the mapping, *key), device slots]


def _slots_on_device(slot_mapping, num_tokens, num_slots, device) -> torch.Tensor:
    """Checked on the host (the engine builds the mapping there: no device syncs) and
    copied to the device once per mapping: every layer of an engine step passes an equal
    mapping, so the last one is kept and reused while the contents match."""
    host = slot_mapping.cpu()
    key = (num_tokens, num_slots, device, host.dtype)
    if _last_slots and _last_slots[0][1:] == key and torch.equal(host, _last_slots[0][0]):
        return _last_slots[1]
    _check_slots(host, num_tokens, num_slots)
    slots = host.to(device=device, dtype=torch.int64, copy=True)  # not aliasing the caller's
    _last_slots[:] = [(host.clone(), *key), slots]
    return slots


def store_kv_triton(
    k: torch.Tensor,  # [T, Hkv, D] float (any strides with stride(-1) == 1)
    v: torch.Tensor,  # [T, Hkv, D]
    k_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D] fp8 / uint8 / bf16 / fp16 / fp32
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64 (int32 accepted); -1 = skip
    k_scale: torch.Tensor | None = None,  # fp32 [1] or [Hkv] for FP8 pools
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k[i], v[i] into slot slot_mapping[i] of the pools, in place (mutates the pools)."""
    num_blocks, block_size, _, _ = check_kv(k, v, k_pool, v_pool)
    device = check_kernel_device("store_kv", k, v, k_pool, v_pool)
    slots = _slots_on_device(slot_mapping, k.shape[0], num_blocks * block_size, device)
    _store_checked(k, v, k_pool, v_pool, slots, k_scale, v_scale, device)


def _store_checked(k, v, k_pool, v_pool, slots, k_scale, v_scale, device) -> None:
    """The part of both entry points after their slot checks: check the scales and k/v's
    strides, bring the scales to [Hkv] on the device (FP8 pools) or k/v to the pool dtype
    (float pools), launch."""
    hkv = k_pool.shape[2]
    fp8 = is_fp8_pool(k_pool)
    k_scale = check_scale("k_scale", k_scale, fp8, hkv)
    v_scale = check_scale("v_scale", v_scale, fp8, hkv)
    if k.shape[0] == 0:
        return
    if fp8:
        ks = k_scale.to(device).expand(hkv).contiguous()  # [Hkv] fp32
        vs = v_scale.to(device).expand(hkv).contiguous()
    else:
        k, v = k.to(k_pool.dtype), v.to(v_pool.dtype)
        ks = vs = None
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"k/v need a contiguous last dim (strides {k.stride()}/{v.stride()}); "
                         f"pass .contiguous().")
    launch_store_kv(k, v, k_pool, v_pool, slots, ks, vs)


def launch_store_kv(k, v, k_pool, v_pool, slots, k_scale, v_scale) -> None:
    """The launch alone, on inputs store_kv_triton has checked (benchmarks time this):
    slots int64 on the device; for FP8 pools k/v scales fp32 [Hkv], for float pools None
    and k/v already in the pool dtype."""
    hkv, d = k_pool.shape[2], k_pool.shape[3]
    fp8 = is_fp8_pool(k_pool)
    kp, vp = (k_pool.view(torch.uint8), v_pool.view(torch.uint8)) if fp8 else (k_pool, v_pool)
    ks, vs = (k_scale, v_scale) if fp8 else (kp, vp)  # unused without FP8
    _store_kv_kernel[(k.shape[0], hkv)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), kp, vp, slots, ks, vs,
        HKV=hkv, D=d, BLOCK_D=triton.next_power_of_2(d), FP8=fp8)


def store_kv_static(
    k: torch.Tensor,  # [T, Hkv, D] float, stride(-1) == 1
    v: torch.Tensor,  # [T, Hkv, D]
    k_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D] fp8 / uint8 / bf16 / fp16 / fp32
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32/int64 on the pools' device; -1 = skip
    k_scale: torch.Tensor | None = None,  # fp32 [1] or [Hkv] for FP8 pools
    v_scale: torch.Tensor | None = None,
) -> None:
    """store_kv_triton without reading the slot mapping on the host: for a step whose
    mapping lives in a fixed device buffer (a CUDA graph's inputs, runtime/step_buffers.py)
    and was checked when the host built it. Shapes and scales are checked as there."""
    check_kv(k, v, k_pool, v_pool)
    device = check_kernel_device("store_kv", k, v, k_pool, v_pool, slot_mapping)
    if slot_mapping.dtype not in (torch.int32, torch.int64) \
            or slot_mapping.shape != (k.shape[0],) or slot_mapping.stride(0) != 1:
        raise ValueError(f"slot_mapping must be a contiguous int32/int64 [{k.shape[0]}], got "
                         f"{slot_mapping.dtype} {list(slot_mapping.shape)}.")
    _store_checked(k, v, k_pool, v_pool, slot_mapping, k_scale, v_scale, device)
