"""A step plan checked once stands in for the per-call checks: same results, and a plan
for another step's geometry is refused."""

from __future__ import annotations

import pytest
import torch

from qserve.kernels.fp8 import FP8_DTYPE
from qserve.kernels.kv_store import store_kv
from qserve.kernels.paged_attention import paged_attention
from qserve.kernels.paged_plan import PagedStepPlan

NB, BS, HKV, G, D = 12, 4, 2, 3, 16


def _step():
    # three sequences: a 1-token decode, a 5-token chunk after 3 cached, a 1-token decode
    qlens, ctx = [1, 5, 1], [6, 3, 9]
    tables = [[3, 0], [5, 1, 7], [2, 9, 11]]
    qsl = torch.tensor([0, 1, 6, 7])
    seq = torch.tensor([c + n for c, n in zip(ctx, qlens)])
    bt = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32)
    slots = torch.cat([torch.tensor([tables[b][p // BS] * BS + p % BS
                                     for p in range(ctx[b], ctx[b] + qlens[b])])
                       for b in range(3)])
    return qsl, seq, bt, slots


def test_plan_gives_the_same_store_and_attention(seed):
    qsl, seq, bt, slots = _step()
    t = int(qsl[-1])
    pools = [torch.randn(NB, BS, HKV, D).to(FP8_DTYPE) for _ in range(2)]
    k, v = torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    q = torch.randn(t, HKV * G, D).bfloat16()
    ks, vs = torch.tensor([0.01]), torch.tensor([0.02])
    plan = PagedStepPlan.build(t, NB, BS, slots, bt, qsl, seq)
    outs = []
    for use_plan in (False, True):
        kp, vp = pools[0].clone(), pools[1].clone()
        extra = {"plan": plan} if use_plan else {}
        store_kv(k, v, kp, vp, slots, ks, vs, **extra)
        out = paged_attention(q, kp, vp, bt, qsl, seq, ks, vs, 0.25, decode_impl="eager",
                              **extra)
        outs.append((kp.view(torch.uint8), vp.view(torch.uint8), out))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_plan_for_other_geometry_is_refused():
    qsl, seq, bt, slots = _step()
    plan = PagedStepPlan.build(7, NB, BS, slots, bt, qsl, seq)
    kp = torch.zeros(NB + 1, BS, HKV, D).to(FP8_DTYPE)
    q = torch.zeros(7, HKV * G, D)
    with pytest.raises(ValueError, match=r"plan was built for 7 tokens over 12 blocks"):
        paged_attention(q, kp, kp.clone(), bt, qsl, seq, torch.tensor([1.0]),
                        torch.tensor([1.0]), 1.0, plan=plan)


def test_plan_checks_slots_once():
    qsl, seq, bt, slots = _step()
    dup = slots.clone()
    dup[1] = dup[0]
    with pytest.raises(ValueError, match="same slot twice"):
        PagedStepPlan.build(7, NB, BS, dup, bt, qsl, seq)
    with pytest.raises(ValueError, match="beyond the pool"):
        PagedStepPlan.build(7, 2, BS, slots, bt, qsl, seq)
