"""store_kv writes exactly the given slots, with the one FP8 quantization, and nothing else."""

from __future__ import annotations

import pytest
import torch

from qserve.kernels.fp8 import FP8_DTYPE, quantize_fp8
from qserve.kernels.kv_store import store_kv, store_kv_reference

N, BS, HKV, D = 6, 4, 3, 8


def _pools(dtype):
    """Pools filled with a sentinel, so any write outside the given slots shows."""
    if dtype == "fp8":
        k = torch.full((N, BS, HKV, D), 0x55, dtype=torch.uint8).view(FP8_DTYPE)
    else:
        k = torch.full((N, BS, HKV, D), -7.0, dtype=dtype)
    return k, k.clone()


def _bytes(pool):
    return pool.view(torch.uint8) if pool.dtype == FP8_DTYPE else pool


@pytest.mark.parametrize("dtype", ["fp8", torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_head", [False, True])
def test_store_matches_reference_and_touches_only_given_slots(dtype, per_head):
    if dtype != "fp8" and per_head:
        pytest.skip("scales apply to FP8 pools only")
    slots = torch.tensor([5, -1, 0, 23, 12, 13, -1, 7])  # ragged, across blocks, with skips
    k = torch.randn(slots.numel(), HKV, D) * 3
    v = torch.randn(slots.numel(), HKV, D) * 3
    ks = vs = None
    if dtype == "fp8":
        n = HKV if per_head else 1
        ks, vs = torch.rand(n) * 0.02 + 0.005, torch.rand(n) * 0.02 + 0.005
    kp, vp = _pools(dtype)
    kr, vr = _pools(dtype)
    store_kv(k, v, kp, vp, slots, ks, vs)
    store_kv_reference(k, v, kr, vr, slots, ks, vs)
    assert torch.equal(_bytes(kp), _bytes(kr)) and torch.equal(_bytes(vp), _bytes(vr))

    written = torch.zeros(N * BS, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    untouched_k = _bytes(kp).view(N * BS, HKV, D)[~written]
    assert torch.equal(untouched_k, _bytes(_pools(dtype)[0]).view(N * BS, HKV, D)[~written])
    flat_v = vp.view(N * BS, HKV, D)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        if dtype == "fp8":
            want = quantize_fp8(v[i], vs.view(-1, 1))
            assert torch.equal(flat_v[s].view(torch.uint8), want.view(torch.uint8))
        else:
            assert torch.equal(flat_v[s], v[i].to(dtype))


def test_uint8_pool_is_fp8_bytes():
    kp8, vp8 = _pools("fp8")
    ku, vu = kp8.view(torch.uint8).clone(), vp8.view(torch.uint8).clone()
    k, v, s = torch.randn(2, HKV, D), torch.randn(2, HKV, D), torch.tensor([0.01])
    store_kv(k, v, kp8, vp8, torch.tensor([3, 9]), s, s)
    store_kv(k, v, ku, vu, torch.tensor([3, 9]), s, s)
    assert torch.equal(ku, kp8.view(torch.uint8)) and torch.equal(vu, vp8.view(torch.uint8))


def test_saturates_instead_of_nan():
    kp, vp = _pools("fp8")
    k = torch.full((1, HKV, D), 1e6)
    store_kv(k, -k, kp, vp, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([1.0]))
    assert kp[0, 0].float().eq(448).all() and vp[0, 0].float().eq(-448).all()


@pytest.mark.parametrize("case, match", [
    ("dup", "same slot twice"),
    ("range", "beyond the pool"),
    ("neg", "below -1"),
    ("no_scale", "required for an FP8 pool"),
    ("scale_bf16", "non-FP8 pool"),
    ("scale_shape", "per kv head"),
    ("scale_dtype", "float32"),
    ("k_shape", "must both be"),
    ("slot_dtype", "int64"),
    ("pool_dtype", "dtype"),
])
def test_bad_input(case, match):
    kp, vp = _pools("fp8")
    k = v = torch.randn(2, HKV, D)
    slots, s = torch.tensor([1, 2]), torch.tensor([0.1])
    args = dict(k=k, v=v, k_pool=kp, v_pool=vp, slot_mapping=slots, k_scale=s, v_scale=s)
    if case == "dup":
        args["slot_mapping"] = torch.tensor([4, 4])
    elif case == "range":
        args["slot_mapping"] = torch.tensor([0, N * BS])
    elif case == "neg":
        args["slot_mapping"] = torch.tensor([0, -2])
    elif case == "no_scale":
        args["k_scale"] = None
    elif case == "scale_bf16":
        args["k_pool"], args["v_pool"] = _pools(torch.bfloat16)
    elif case == "scale_shape":
        args["k_scale"] = torch.ones(2)
    elif case == "scale_dtype":
        args["k_scale"] = torch.ones(1, dtype=torch.float64)
    elif case == "k_shape":
        args["k"] = torch.randn(2, HKV, D + 1)
    elif case == "slot_dtype":
        args["slot_mapping"] = torch.tensor([1.0, 2.0])
    elif case == "pool_dtype":
        args["k_pool"] = args["v_pool"] = torch.zeros(N, BS, HKV, D, dtype=torch.int16)
    with pytest.raises(ValueError, match=match):
        store_kv(**args)


@pytest.mark.parametrize("pool_dtype", ["fp8", torch.uint8, torch.bfloat16])
@pytest.mark.parametrize("per_head", [False, True])
def test_c_store_of_bf16_rows_is_the_torch_store(pool_dtype, per_head, monkeypatch):
    """bf16 K/V on CPU take the C store (kernels/native_kv_store.py): the same bytes for
    every bf16 value (NaNs keep their sign, -0, subnormals, saturation), strided rows,
    per-layer and per-head scales."""
    from qserve.kernels import native_kv_store

    if not native_kv_store.usable(torch.zeros(1, 1, 2).bfloat16(), torch.zeros(1, 1, 2).bfloat16(),
                                  torch.zeros(1, 1, 1, 2).bfloat16(),
                                  torch.zeros(1, 1, 1, 2).bfloat16()):
        pytest.skip("no C compiler")
    if pool_dtype == torch.bfloat16 and per_head:
        pytest.skip("scales apply to FP8 pools only")
    hkv, d, t = 4, 16, 1024  # 2 x 65,536 values: every bf16 bit pattern once in K and V
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    kv = torch.stack([every.view(t, hkv * d), every.flip(0).view(t, hkv * d)], 1)
    k, v = kv[:, 0].view(t, hkv, d), kv[:, 1].view(t, hkv, d)  # token stride 2 * hkv * d
    slots = torch.randperm(t * 2)[:t]  # distinct, scattered over 2t slots
    ks = vs = None
    if pool_dtype != torch.bfloat16:
        n = hkv if per_head else 1
        ks, vs = torch.rand(n) * 0.02 + 0.005, torch.rand(n) * 5 + 0.5
    make = (lambda: torch.full((t * 2 // 16, 16, hkv, d), 0x55, dtype=torch.uint8)) \
        if pool_dtype != torch.bfloat16 else (lambda: torch.full((t * 2 // 16, 16, hkv, d), -7.0,
                                                                 dtype=torch.bfloat16))
    kp, vp, kr, vr = (make() for _ in range(4))
    if pool_dtype == "fp8":
        kp, vp = kp.view(FP8_DTYPE), vp.view(FP8_DTYPE)
    calls = []
    real = native_kv_store.store_kv_native
    monkeypatch.setattr(native_kv_store, "store_kv_native",
                        lambda *a: calls.append(1) or real(*a))
    store_kv(k, v, kp, vp, slots, ks, vs)
    store_kv_reference(k, v, kr, vr, slots, ks, vs)
    assert calls == [1]
    as_bytes = (lambda p: p.view(torch.uint8)) if pool_dtype != torch.bfloat16 else \
        (lambda p: p.view(torch.int16))
    assert torch.equal(as_bytes(kp), as_bytes(kr)) and torch.equal(as_bytes(vp), as_bytes(vr))
