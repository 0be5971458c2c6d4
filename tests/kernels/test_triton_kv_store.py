"""Triton KV store against store_kv_reference: exact bytes, only the given slots written.

The kernel rounds to E4M3 in exact arithmetic (kernels/triton_numerics.e4m3_code), so
the comparison is byte equality, including every grid point, every midpoint between
neighbours (ties to even) and one fp32 ulp either side of it, saturation, NaN and -0.
Fresh random inputs every run (seed printed).
"""

from __future__ import annotations

import pytest
import torch

from qserve.kernels import dispatch
from qserve.kernels.fp8 import FP8_DTYPE
from qserve.kernels.kv_store import store_kv_reference
from qserve.kernels.triton_kv_store import store_kv_triton

N, BS, HKV, D = 6, 4, 3, 24  # D not a power of two: masked lanes


def _pools(dtype, shape=(N, BS, HKV, D)):
    if dtype in ("fp8", "uint8"):
        k = torch.full(shape, 0x55, dtype=torch.uint8)
        k = k.view(FP8_DTYPE) if dtype == "fp8" else k
    else:
        k = torch.full(shape, -7.0, dtype=dtype)
    return k, k.clone()


def _bytes(pool):
    return pool.view(torch.uint8) if pool.dtype == FP8_DTYPE else pool


@pytest.mark.parametrize("pool, per_head", [
    ("fp8", False), ("fp8", True), ("uint8", False), ("uint8", True),
    (torch.bfloat16, False), (torch.float32, False),  # scales apply to FP8 pools only
])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_bytes(seed, pool, per_head, x_dtype):
    fp8 = pool in ("fp8", "uint8")
    t = 9
    slots = torch.randperm(N * BS)[:t]
    slots[torch.randint(0, t, (2,))] = -1  # skipped tokens
    # K/V as a slice of a fused [T, 3, Hkv, D] qkv tensor: non-contiguous token stride;
    # magnitudes from 1e-4 to 1e3 reach subnormal, normal and saturated FP8 codes
    qkv = torch.randn(t, 3, HKV, D) * torch.logspace(-4, 3, t).view(t, 1, 1, 1)
    qkv[0, 1, 0, :5] = torch.tensor([float("nan"), -0.0, 1e9, -1e9, float("-inf")])
    k, v = qkv[:, 1].to(x_dtype), qkv[:, 2].to(x_dtype)
    n = HKV if per_head else 1
    ks, vs = (torch.rand(n) * 0.02 + 0.005, torch.rand(n) + 0.5) if fp8 else (None, None)
    kp, vp = _pools(pool)
    kr, vr = _pools(pool)
    store_kv_triton(k, v, kp, vp, slots, ks, vs)
    store_kv_reference(k, v, kr, vr, slots, ks, vs)
    for got, want in ((kp, kr), (vp, vr)):
        assert torch.equal(_bytes(got), _bytes(want)) or (  # NaN == NaN for float pools
            not fp8 and torch.equal(got.isnan(), want.isnan())
            and torch.equal(got.nan_to_num(), want.nan_to_num()))
    written = torch.zeros(N * BS, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    untouched = _bytes(kp).reshape(N * BS, -1)[~written]
    assert torch.equal(untouched, _bytes(_pools(pool)[0]).reshape(N * BS, -1)[~written])


def test_every_e4m3_grid_point_midpoint_and_neighbour(seed):
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite()].unique()  # sorted, -448 .. 448
    mid = (grid[1:] + grid[:-1]) / 2  # exact in fp32: ties, rounded to even
    up, down = torch.full_like(mid, 1e9), torch.full_like(mid, -1e9)
    x = torch.cat([grid, mid, torch.nextafter(mid, up), torch.nextafter(mid, down),
                   torch.tensor([449.0, 464.0, 465.0, 1e30, 2.0 ** -10, -(2.0 ** -10)]),
                   torch.randn(500) * torch.logspace(-5, 3, 500)])
    x = torch.cat([x, torch.zeros((-x.numel()) % D)]).view(-1, 1, D)
    shape = (x.shape[0], 1, 1, D)
    kp, vp = _pools("fp8", shape)
    kr, vr = _pools("fp8", shape)
    one = torch.ones(1)
    slots = torch.arange(x.shape[0])
    store_kv_triton(x, -x, kp, vp, slots, one, one)
    store_kv_reference(x, -x, kr, vr, slots, one, one)
    assert torch.equal(_bytes(kp), _bytes(kr)) and torch.equal(_bytes(vp), _bytes(vr))


def test_dispatch_forced_triton(seed, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    kp, vp = _pools("fp8")
    kr, vr = _pools("fp8")
    k, v, s = torch.randn(3, HKV, D), torch.randn(3, HKV, D), torch.tensor([0.01])
    dispatch.store_kv(k, v, kp, vp, torch.tensor([7, -1, 2]), s, s)
    store_kv_reference(k, v, kr, vr, torch.tensor([7, -1, 2]), s, s)
    assert torch.equal(_bytes(kp), _bytes(kr)) and torch.equal(_bytes(vp), _bytes(vr))


def test_slots_checked_once_and_again_after_a_change(seed):
    kp, vp = _pools("fp8")
    kr, vr = _pools("fp8")
    k, v, s = torch.randn(3, HKV, D), torch.randn(3, HKV, D), torch.tensor([0.01])
    slots = torch.tensor([7, -1, 2])
    store_kv_triton(k, v, kp, vp, slots, s, s)
    store_kv_triton(k, v, kp, vp, slots, s, s)  # the next layer: same mapping
    slots[1] = 7  # in place: now a duplicate, must be caught
    with pytest.raises(ValueError, match="same slot twice"):
        store_kv_triton(k, v, kp, vp, slots, s, s)
    slots[1] = 11
    store_kv_triton(k, v, kp, vp, slots, s, s)
    store_kv_reference(k, v, kr, vr, slots, s, s)  # slots 7 and 2 got the same values before
    assert torch.equal(_bytes(kp), _bytes(kr)) and torch.equal(_bytes(vp), _bytes(vr))


@pytest.mark.parametrize("case, match", [
    ("dup", "same slot twice"), ("range", "beyond the pool"), ("neg", "below -1"),
    ("no_scale", "required for an FP8 pool"), ("scale_shape", "per kv head"),
    ("k_shape", "must both be"), ("slot_dtype", "int64"), ("stride", "contiguous last dim"),
])
def test_bad_input(case, match):
    kp, vp = _pools("fp8")
    k = v = torch.randn(2, HKV, D)
    args = dict(k=k, v=v, k_pool=kp, v_pool=vp, slot_mapping=torch.tensor([1, 2]),
                k_scale=torch.tensor([0.1]), v_scale=torch.tensor([0.1]))
    if case == "dup":
        args["slot_mapping"] = torch.tensor([4, 4])
    elif case == "range":
        args["slot_mapping"] = torch.tensor([0, N * BS])
    elif case == "neg":
        args["slot_mapping"] = torch.tensor([0, -2])
    elif case == "no_scale":
        args["k_scale"] = None
    elif case == "scale_shape":
        args["k_scale"] = torch.ones(2)
    elif case == "k_shape":
        args["k"] = torch.randn(2, HKV, D + 1)
    elif case == "slot_dtype":
        args["slot_mapping"] = torch.tensor([1.0, 2.0])
    elif case == "stride":
        args["k"] = torch.randn(D, HKV, 2).permute(2, 1, 0)
    with pytest.raises(ValueError, match=match):
        store_kv_triton(**args)


def test_static_entry_writes_the_same_bytes_and_refuses_a_bad_mapping(seed):
    """store_kv_static (a CUDA graph's store: the mapping read on the device only) writes
    the bytes store_kv_triton writes, padding slots (-1) skipped, from an int32 mapping;
    a mapping of another dtype, shape or stride is refused by name."""
    from qserve.kernels.triton_kv_store import store_kv_static

    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(4, HKV, D, generator=g), torch.randn(4, HKV, D, generator=g)
    scale = torch.tensor([0.05])
    slots = torch.tensor([5, -1, 17, 2])
    want_k, want_v = _pools("fp8")
    store_kv_triton(k, v, want_k, want_v, slots, scale, scale)
    got_k, got_v = _pools("fp8")
    store_kv_static(k, v, got_k, got_v, slots.to(torch.int32), scale, scale)
    assert torch.equal(_bytes(got_k), _bytes(want_k)) and torch.equal(_bytes(got_v), _bytes(want_v))
    for bad in (slots.float(), slots[:3], torch.stack([slots, slots], 1)[:, 0]):
        with pytest.raises(ValueError, match="slot_mapping must be a contiguous int32/int64"):
            store_kv_static(k, v, got_k, got_v, bad, scale, scale)
