"""The C bf16 linear for a few rows (kernels/native_bf16_gemv.py): against float64, its
documented sum order, row and thread independence, the portable build's bits, and
PackedLinear's routing where the packed form is an fp32 copy."""

from __future__ import annotations

import platform
import sys

import numpy as np
import pytest
import torch
from torch import nn

from qserve.kernels import cpu_linear, native_bf16_gemv, native_build
from qserve.kernels.native_bf16_gemv import MAX_ROWS, bf16_gemv, pack_bf16_weight
from qserve.runtime.layers.packing import PackedLinear

pytestmark = pytest.mark.skipif(not native_bf16_gemv.available(), reason="no C compiler")


def _documented_order(x, w, bias=None):
    """Even-k and odd-k products summed apart from 0 in k order (fp32), then added."""
    p = (x.double()[:, None, :] * w.double()[None, :, :]).numpy().astype(np.float32)
    even = np.zeros(p.shape[:2], np.float32)
    odd = np.zeros(p.shape[:2], np.float32)
    for k in range(p.shape[2]):
        if k % 2 == 0:
            even = np.float32(even + p[..., k])
        else:
            odd = np.float32(odd + p[..., k])
    total = np.float32(even + odd)
    if bias is not None:
        total = np.float32(total + bias.float().numpy()[None, :])
    return torch.from_numpy(total).bfloat16()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("k,n", [(64, 48), (577, 37), (9, 16), (96, 200)])
def test_bits_follow_the_documented_order(rows, k, n, seed):
    x = (torch.randn(rows, k) * torch.logspace(-3, 1, k)).bfloat16()
    w = torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    assert torch.equal(bf16_gemv(x, pack_bf16_weight(w)), _documented_order(x, w))
    assert torch.equal(bf16_gemv(x, pack_bf16_weight(w), bias), _documented_order(x, w, bias))
    ref = x.double() @ w.double().t()  # fp32 sums of exact products, one bf16 rounding
    bound = ref.abs() * 2**-8 + k * 2**-24 * (x.double().abs() @ w.double().abs().t())
    assert bool(((bf16_gemv(x, pack_bf16_weight(w)).double() - ref).abs() <= bound).all())


def test_rows_and_threads_do_not_change_a_row(seed):
    x = torch.randn(MAX_ROWS, 576).bfloat16()
    w = pack_bf16_weight(torch.randn(1000, 576).bfloat16())
    whole = bf16_gemv(x, w)
    assert torch.equal(whole, torch.cat([bf16_gemv(x[i:i + 1], w) for i in range(MAX_ROWS)]))
    old = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(bf16_gemv(x, w))
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(outs[0], o) for o in outs)


def test_portable_build_gives_the_same_bits(tmp_path, monkeypatch, seed):
    x = torch.randn(5, 200).bfloat16()
    w = torch.randn(70, 200).bfloat16()
    fast = bf16_gemv(x, pack_bf16_weight(w))
    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "FLAG_SETS", native_build.FLAG_SETS[1:])
    monkeypatch.setattr(native_build, "_loaded", {})
    native_bf16_gemv._library.cache_clear()
    try:
        assert not native_bf16_gemv.vectorized()
        portable = bf16_gemv(x, pack_bf16_weight(w))
    finally:
        native_bf16_gemv._library.cache_clear()
    assert torch.equal(portable, fast)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 only")
def test_avx2_build_gives_the_same_bits(tmp_path, monkeypatch, seed):
    """Built for x86-64-v3, so AVX-512 machines test the AVX2 path too."""
    x = torch.randn(5, 200).bfloat16()
    w = torch.randn(70, 200).bfloat16()
    want = _documented_order(x, w)
    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "FLAG_SETS", (native_build.flags_for("x86-64-v3"),))
    monkeypatch.setattr(native_build, "_loaded", {})
    native_bf16_gemv._library.cache_clear()
    try:
        assert native_bf16_gemv.vectorized()
        got = bf16_gemv(x, pack_bf16_weight(w))
    finally:
        native_bf16_gemv._library.cache_clear()
    assert torch.equal(got, want)


def test_the_c_entry_takes_any_rows_in_chunks_with_the_same_bits():
    """The C function (the LM head and bf16 layers of a batch-invariant engine's steps,
    latent attention's per-head up-projections) runs more than MAX_ROWS rows MAX_ROWS at a
    time: each row equals its one-row result, strided input and output rows included, and
    the Python entry takes them too."""
    g = torch.Generator().manual_seed(4)
    rows, k, n = 2 * MAX_ROWS + 3, 40, 24
    x = torch.randn(rows, k + 8, generator=g).bfloat16()  # rows 48 apart, 40 read
    w = pack_bf16_weight(torch.randn(n, k, generator=g).bfloat16())
    out = torch.zeros(rows, n + 5, dtype=torch.bfloat16)  # rows 29 apart, 24 written
    rc = native_bf16_gemv._library().qserve_bf16_gemv(
        x.data_ptr(), rows, k, k + 8, w.data.data_ptr(), n, None, out.data_ptr(), n + 5, 2)
    assert rc == 0
    want = torch.cat([bf16_gemv(x[i:i + 1, :k], w) for i in range(rows)])
    assert torch.equal(out[:, :n], want) and not out[:, n:].any()
    assert torch.equal(bf16_gemv(x[:, :k], w), want)


@pytest.mark.parametrize("rows,threads", [(1, 1), (3, 2), (2 * MAX_ROWS + 1, 2)])
def test_the_heads_entry_gives_each_heads_bits(rows, threads):
    """Latent attention's up-projections as the step program lays them out: head h reads
    columns [h * 12, h * 12 + 9) of 7 * 12-wide rows and writes [h * 10, h * 10 + 6) of
    7 * 10-wide rows; the heads spread over the threads. Each head's output is its own
    one-head call's, and nothing outside it is written."""
    g = torch.Generator().manual_seed(6)
    heads, k, n, x_head, out_head = 7, 9, 6, 12, 10
    x = torch.randn(rows, heads * x_head, generator=g).bfloat16()
    ws = [pack_bf16_weight(torch.randn(n, k, generator=g).bfloat16()) for _ in range(heads)]
    at = torch.tensor([w.data.data_ptr() for w in ws], dtype=torch.int64)
    out = torch.full((rows, heads * out_head), 5.0, dtype=torch.bfloat16)
    rc = native_bf16_gemv._library().qserve_bf16_gemv_heads(
        x.data_ptr(), rows, k, heads * x_head, x_head, at.data_ptr(), n, out.data_ptr(),
        heads * out_head, out_head, heads, threads)
    assert rc == 0
    want = torch.full_like(out, 5.0)
    for h in range(heads):
        xs = x[:, h * x_head:h * x_head + k]
        want[:, h * out_head:h * out_head + n] = torch.cat(
            [bf16_gemv(xs[i:i + 1].contiguous(), ws[h]) for i in range(rows)])
    assert torch.equal(out, want)


def test_bad_arguments_are_named():
    w = pack_bf16_weight(torch.zeros(8, 16).bfloat16())
    with pytest.raises(ValueError, match="bf16 CPU matrix"):
        bf16_gemv(torch.zeros(2, 16), w)
    with pytest.raises(ValueError, match="input has 12 features, weight expects 16"):
        bf16_gemv(torch.zeros(2, 12).bfloat16(), w)
    with pytest.raises(ValueError, match="bias has 3 elements; need 8"):
        bf16_gemv(torch.zeros(1, 16).bfloat16(), w, torch.zeros(3))
    with pytest.raises(ValueError, match="bf16 matrix"):
        pack_bf16_weight(torch.zeros(8, 16))


def test_packed_linear_takes_the_kernel_for_few_rows_on_the_fp32_strategy(monkeypatch, seed):
    monkeypatch.setenv(cpu_linear.ENV_VAR, "fp32")
    lin = nn.Linear(96, 40).bfloat16().requires_grad_(False)
    packed = PackedLinear(lin)
    assert packed.weight.dtype == torch.float32
    assert (packed.rows is not None) == native_bf16_gemv.vectorized()
    few, many = torch.randn(3, 96).bfloat16(), torch.randn(MAX_ROWS + 5, 96).bfloat16()
    if packed.rows is not None:
        assert torch.equal(packed(few), _documented_order(few, lin.weight, lin.bias))
    for x in (few, many):  # either path: the bf16 matmul's values up to the sum order
        ref = x.double() @ lin.weight.double().t() + lin.bias.double()
        torch.testing.assert_close(packed(x).double(), ref, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("strategy", cpu_linear.STRATEGIES)
def test_a_batch_invariant_packed_linear_gives_each_row_its_bits_alone(monkeypatch, seed,
                                                                        strategy):
    """What a batch-invariant engine does with the LM head (runtime/layers/packing.py):
    keep the bf16 rows copy whatever the packed form (rebuilt exactly from oneDNN's layout
    where the head was packed before without it) and run every row count on it."""
    monkeypatch.setenv(cpu_linear.ENV_VAR, strategy)
    try:
        cpu_linear.strategy()
    except ValueError:
        pytest.skip(f"no {strategy} on this CPU")
    if not native_bf16_gemv.vectorized():
        pytest.skip("the C bf16 linear is not vectorised here")
    lin = nn.Linear(96, 40).bfloat16().requires_grad_(False)
    packed = PackedLinear(lin)
    assert packed.keep_rows()
    assert torch.equal(packed.rows.data, pack_bf16_weight(lin.weight).data)
    packed.c_rows = sys.maxsize
    many = torch.randn(2 * MAX_ROWS + 5, 96).bfloat16()
    whole = packed(many)
    assert torch.equal(whole, torch.cat([packed(many[i:i + 1]) for i in range(len(many))]))
    assert torch.equal(whole, _documented_order(many, lin.weight, lin.bias))
