"""The C FP8 linear for a few rows (kernels/native_fp8_gemv.py): against float64, against
the torch path it replaces, row and thread independence, the exact E4M3 decode of every
byte, the portable build, and Fp8Linear's routing."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from qserve.kernels import native_build, native_fp8_gemv
from qserve.kernels.fp8 import FP8_DTYPE, quantize_fp8
from qserve.kernels.fp8_gemm import fp8_linear_reference, fp8_linear_torch
from qserve.kernels.native_fp8_gemv import MAX_ROWS, pack_fp8_weight
from qserve.kernels.native_fp8_gemv import fp8_gemv_bf16 as _gemv
from qserve.kernels.native_fp8_gemv import fp8_gemv_dynamic_bf16
from qserve.runtime.layers.fp8_linear import Fp8Linear

pytestmark = pytest.mark.skipif(not native_fp8_gemv.available(), reason="no C compiler")


def _case(rows, k, n, per_channel=True):
    x = (torch.randn(rows, k) * torch.logspace(-3, 1, k)).bfloat16()  # many binades
    w = torch.randn(n, k)
    ws = w.abs().amax(1, keepdim=True) / 448 if per_channel else w.abs().max().reshape(1) / 448
    wq = quantize_fp8(w, ws)  # [n, k] E4M3, subnormals included
    s_in = torch.tensor([float(x.float().abs().max()) / 448])
    out_scale = s_in.reshape(1, 1) * ws.reshape(1, -1).float()  # [1, n|1]
    return x, wq, ws, s_in, out_scale


def fp8_gemv_bf16(x, wq, input_scale, out_scale):
    """The kernel on an [out, in] E4M3 matrix (packed here, as Fp8Linear packs it)."""
    return _gemv(x, pack_fp8_weight(wq), input_scale, out_scale)


def _order_step(other, xq, wq, ws):
    """How far two paths that round at the same points but sum in different fp32 orders may
    differ, per output: one bf16 step either way of a rounding tie (2^-7 relative) plus the
    final scale-and-round on each side (2^-8), plus what the two fp32 sums can differ by
    where they cancel (each within k * 2^-24 of the running sum of |products| of the exact
    sum). `xq` [rows, k] is the input as the kernel multiplies it, `wq` [n, k] E4M3 with
    scales `ws` [n, 1] or [1]."""
    k = xq.shape[-1]
    size = xq.double().abs() @ (wq.double() * ws.double().reshape(-1, 1)).abs().t()
    return (other.double().abs() * (2**-7 + 2**-8) + 2 * k * 2**-24 * size + 1e-30) * (1 + 2**-7)


def _with_threads(n, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16])
@pytest.mark.parametrize("k,n", [(64, 48), (576, 37), (40, 13), (17, 9), (96, 208)])
@pytest.mark.parametrize("per_channel", [True, False])
def test_matches_float64_and_the_torch_path(rows, k, n, per_channel, seed):
    x, wq, ws, s_in, out_scale = _case(rows, k, n, per_channel)
    got = fp8_gemv_bf16(x, wq, s_in, out_scale)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    ref = fp8_linear_reference(x, wq, ws, s_in)  # float64, exact products and sums
    # the fp32 sum (k roundings of at most 2^-24 of the running sum of |products|), then
    # two bf16 roundings (half an ulp, 2^-8 relative, each)
    q = quantize_fp8(x, s_in).double() * s_in.double()
    size = (q.abs() @ (wq.double() * ws.double().reshape(-1, 1)).abs().t())
    bound = 2 * 2**-8 * ref.abs() * (1 + 2**-8) + k * 2**-24 * size
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    # the torch path rounds at the same points and sums in another fp32 order
    torch_path = fp8_linear_torch(x, wq.bfloat16(), ws, s_in, out_scale=out_scale)
    step = _order_step(torch_path, q, wq, ws)
    assert bool(((got.double() - torch_path.double()).abs() <= step).all())


def test_rows_threads_and_strides_do_not_change_a_row(seed):
    x, wq, _, s_in, out_scale = _case(MAX_ROWS, 576, 160)
    whole = fp8_gemv_bf16(x, wq, s_in, out_scale)
    one_by_one = torch.cat([fp8_gemv_bf16(x[i:i + 1], wq, s_in, out_scale)
                            for i in range(MAX_ROWS)])
    assert torch.equal(whole, one_by_one)
    for m in (2, 3, 4, 5, 6, 7):  # up to 6 rows decode into registers per 3 rows, 7 via a buffer
        assert torch.equal(fp8_gemv_bf16(x[1:1 + m], wq, s_in, out_scale),
                           one_by_one[1:1 + m])
    big = torch.randn(4, 2048).bfloat16()
    wbig = quantize_fp8(torch.randn(1024, 2048), torch.tensor([0.01]))
    outs = [_with_threads(t, lambda: fp8_gemv_bf16(big, wbig, 0.05, torch.tensor([1e-3])))
            for t in (1, 2, 3)]  # 8M products: the OpenMP split from 2 threads
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # 13 tiles of 16 channels (the last band holds one): 3 threads start mid-band
    wodd = quantize_fp8(torch.randn(200, 2048), torch.tensor([0.01]))
    outs = [_with_threads(t, lambda: fp8_gemv_bf16(big, wodd, 0.05, torch.tensor([1e-3])))
            for t in (1, 3)]
    assert torch.equal(outs[0], outs[1])
    wide = torch.zeros(MAX_ROWS, 700).bfloat16()
    wide[:, :576] = x  # rows with a stride of 700
    assert torch.equal(fp8_gemv_bf16(wide[:, :576], wq, s_in, out_scale), whole)


@pytest.mark.parametrize("rows,k,n", [(1, 576, 37), (5, 96, 208), (16, 40, 13)])
def test_dynamic_input_scale_equals_the_static_entry_with_it(rows, k, n, seed):
    """input scale max(amax, 1e-12) / 448 over all rows in fp32, weight scale times it."""
    x, wq, ws, _, _ = _case(rows, k, n)
    x[rows - 1, k // 2] = -3.0 * float(x.float().abs().max())  # the amax is a negative value
    s_in = x.float().abs().max() / 448  # fp32, as the kernel computes it
    want = fp8_gemv_bf16(x, wq, float(s_in), ws.reshape(-1).float() * s_in)
    got = fp8_gemv_dynamic_bf16(x, pack_fp8_weight(wq), ws)
    assert torch.equal(got, want)
    zeros = fp8_gemv_dynamic_bf16(torch.zeros(2, k).bfloat16(), pack_fp8_weight(wq), ws)
    assert torch.equal(zeros, torch.zeros(2, n).bfloat16())  # the 1e-12 floor: no 0 / 0
    with pytest.raises(ValueError, match=f"weight_scale has 2 elements; need 1 or {n}"):
        fp8_gemv_dynamic_bf16(x, pack_fp8_weight(wq), torch.ones(2))
    with pytest.raises(ValueError, match="bf16 CPU matrix"):
        fp8_gemv_dynamic_bf16(x.float(), pack_fp8_weight(wq), ws)


def test_every_e4m3_byte_decodes_exactly():
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    n = codes.numel()  # 254 finite codes, subnormals and both zeros included
    w = torch.zeros(n, 32, dtype=torch.uint8)
    w[torch.arange(n), torch.arange(n) % 32] = codes  # one weight per output channel
    x = torch.ones(1, 32).bfloat16()  # E4M3(1 / 1) = 1: each output is its weight
    got = fp8_gemv_bf16(x, w.view(FP8_DTYPE), 1.0, torch.ones(1))
    want = w.view(FP8_DTYPE).float().sum(1).bfloat16()  # torch's decode, exact in bf16
    assert torch.equal(got[0], want)


def test_no_rows_give_an_empty_result():
    x, wq, _, s_in, out_scale = _case(1, 64, 16)
    assert fp8_gemv_bf16(x[:0], wq, s_in, out_scale).shape == (0, 16)


def test_nan_input_gives_nan_rows_only():
    x, wq, _, s_in, out_scale = _case(3, 64, 16)
    x[1, 5] = float("nan")
    got = fp8_gemv_bf16(x, wq, s_in, out_scale)
    assert got[1].isnan().all() and not got[[0, 2]].isnan().any()


def test_bad_arguments_are_named():
    w = torch.zeros(8, 16, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="bf16 CPU matrix"):
        fp8_gemv_bf16(torch.zeros(2, 16), w, 1.0, torch.ones(1))
    with pytest.raises(ValueError, match="input has 12 features, weight expects 16"):
        fp8_gemv_bf16(torch.zeros(2, 12).bfloat16(), w, 1.0, torch.ones(1))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemv_bf16(torch.zeros(2, 16).bfloat16(), w.bfloat16(), 1.0, torch.ones(1))
    with pytest.raises(ValueError, match="need 1 or 8"):
        fp8_gemv_bf16(torch.zeros(2, 16).bfloat16(), w, 1.0, torch.ones(3))
    with pytest.raises(ValueError, match="PackedFp8Weight"):
        _gemv(torch.zeros(2, 16).bfloat16(), w, 1.0, torch.ones(1))


@pytest.mark.parametrize("layout", [native_fp8_gemv.LAYOUT_TILE, native_fp8_gemv.LAYOUT_PAIRS])
def test_packing_moves_every_byte_once(layout):
    w = torch.randint(0, 256, (40, 70), dtype=torch.uint8)  # padded to 48 x 96
    if layout == native_fp8_gemv.LAYOUT_PAIRS:  # that layout refuses NaN bytes (below)
        w[(w & 0x7F) == 0x7F] -= 1
    packed = pack_fp8_weight(w.view(FP8_DTYPE), layout)
    assert packed.data.numel() == 48 * 96 and (packed.out_features, packed.in_features) == (40, 70)
    assert packed.layout == layout
    padded = torch.zeros(48, 96, dtype=torch.uint8)
    padded[:40, :70] = w
    assert torch.equal(packed.data.sort().values, padded.flatten().sort().values)


def test_pairs_packing_refuses_nan_bytes_and_a_layout_mismatch_is_named():
    w = torch.zeros(16, 32, dtype=torch.uint8)
    w[3, 5] = 0xFF
    with pytest.raises(ValueError, match="NaN bytes"):
        pack_fp8_weight(w.view(FP8_DTYPE), native_fp8_gemv.LAYOUT_PAIRS)
    other = 1 - native_fp8_gemv._library().qserve_fp8_gemv_layout()
    packed = pack_fp8_weight(torch.zeros(16, 32, dtype=FP8_DTYPE), other)
    with pytest.raises(ValueError, match="packed for another build"):
        _gemv(torch.zeros(1, 32).bfloat16(), packed, 1.0, torch.ones(1))


def test_portable_build_gives_the_same_bits(tmp_path, monkeypatch, seed):
    """Without AMX the kernel decodes through a table and sums in the same order."""
    x, wq, _, s_in, out_scale = _case(MAX_ROWS, 600, 70)
    fast = fp8_gemv_bf16(x, wq, s_in, out_scale)
    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "FLAG_SETS", native_build.FLAG_SETS[1:])
    monkeypatch.setattr(native_build, "_loaded", {})
    native_fp8_gemv._library.cache_clear()
    try:
        portable = fp8_gemv_bf16(x, wq, s_in, out_scale)
    finally:
        native_fp8_gemv._library.cache_clear()  # the next caller loads the usual build
    assert list((tmp_path / "native").glob("fp8_gemv_cpu-*.so"))
    assert torch.equal(portable, fast)


AVX2_FLAGS = native_build.flags_for("x86-64-v3")
ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, MAX_ROWS)  # register-decoded, 3-row blocks and their rests


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 only")
def test_avx2_build_gives_the_same_bits(tmp_path, monkeypatch, seed):
    """The AVX2 + FMA path (LAYOUT_PAIRS tiles), built for x86-64-v3 whatever this CPU has
    beyond it, so AVX-512 and AMX machines test it too."""
    x, wq, _, s_in, out_scale = _case(MAX_ROWS, 600, 70)
    fast = fp8_gemv_bf16(x, wq, s_in, out_scale)
    monkeypatch.setenv("QSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "FLAG_SETS", (AVX2_FLAGS,))
    monkeypatch.setattr(native_build, "_loaded", {})
    native_fp8_gemv._library.cache_clear()
    try:
        assert native_fp8_gemv.path() == "avx2"
        assert native_fp8_gemv._library().qserve_fp8_gemv_layout() == native_fp8_gemv.LAYOUT_PAIRS
        rows = [fp8_gemv_bf16(x[:m], wq, s_in, out_scale) for m in ROW_COUNTS]
    finally:
        native_fp8_gemv._library.cache_clear()
    for m, got in zip(ROW_COUNTS, rows):
        assert torch.equal(got, fast[:m])


@pytest.mark.parametrize("build", ["loaded", "avx2", "portable"])
def test_many_rows_equal_each_row_alone_on_every_build(tmp_path, monkeypatch, seed, build):
    """Every build takes any number of rows (prefill steps) and gives every row the sums it
    gets alone: the AVX2 path in chunks of 48 rows, blocks of 3 and the rows left over; the
    tile paths (AMX, AVX512-BF16, the portable table) in passes of MAX_ROWS. So a prompt's
    results do not depend on the batch it is prefilled in; and every build gives the same
    bits. The AVX2 build is built for x86-64-v3 on any x86, the portable one anywhere."""
    if build == "avx2" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    x, wq, ws, s_in, out_scale = _case(101, 600, 70)  # 2 chunks of 48 + 5 rows: 3 + 2
    reference = fp8_gemv_bf16(x[:1], wq, s_in, out_scale)  # the loaded build, one row
    if build != "loaded":
        monkeypatch.setenv("QSERVE_CACHE", str(tmp_path))
        monkeypatch.setattr(native_build, "FLAG_SETS", (AVX2_FLAGS,) if build == "avx2"
                            else native_build.FLAG_SETS[1:])
        monkeypatch.setattr(native_build, "_loaded", {})
        native_fp8_gemv._library.cache_clear()
    try:
        if build == "avx2":
            assert native_fp8_gemv.pass_rows() > 101
        if build == "portable":
            assert native_fp8_gemv.path() == "portable"
            assert native_fp8_gemv.pass_rows() == MAX_ROWS
        whole = fp8_gemv_bf16(x, wq, s_in, out_scale)
        alone = torch.cat([fp8_gemv_bf16(x[i:i + 1], wq, s_in, out_scale) for i in range(101)])
        parts = torch.cat([fp8_gemv_bf16(x[i:i + 7], wq, s_in, out_scale)
                           for i in range(0, 101, 7)])
        two = _with_threads(2, lambda: fp8_gemv_bf16(x, wq, s_in, out_scale))
    finally:
        native_fp8_gemv._library.cache_clear()
    assert torch.equal(whole, alone) and torch.equal(whole, parts) and torch.equal(whole, two)
    assert torch.equal(whole[:1], reference)
    ref = fp8_linear_torch(x, wq.bfloat16(), ws, s_in, out_scale=out_scale)
    q = quantize_fp8(x, s_in).double() * s_in.double()
    assert bool(((whole.double() - ref.double()).abs() <= _order_step(ref, q, wq, ws)).all())


def _layer(out_f=48, in_f=64):
    w = torch.randn(out_f, in_f)
    ws = w.abs().amax(1, keepdim=True) / 448
    return Fp8Linear(quantize_fp8(w, ws), ws, torch.tensor([0.02]), torch.randn(out_f),
                     torch.bfloat16)


def test_fp8_linear_runs_small_batches_on_the_fp8_bytes(monkeypatch, seed):
    layer = _layer()
    assert layer.pack() and layer.c_weight is not None and "fp8 bytes" in repr(layer)
    calls = []
    real = native_fp8_gemv.fp8_gemv_bf16
    monkeypatch.setattr(native_fp8_gemv, "fp8_gemv_bf16",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    small = torch.randn(2, MAX_ROWS, 64).bfloat16()[:1]  # [1, MAX_ROWS, 64]
    big = torch.randn(MAX_ROWS + 1, 64).bfloat16()
    y_small, y_big = layer(small), layer(big)
    # a fresh layer takes the kernel up to one pass over the weights (any rows on AVX2);
    # packing for a batch-invariant engine (runtime/layers/packing.py) lifts the bound
    many = native_fp8_gemv.pass_rows() > MAX_ROWS
    assert calls == [MAX_ROWS] + ([MAX_ROWS + 1] if many else [])
    layer.c_rows = 10**9
    assert torch.equal(layer(big), y_big if many else real(big, layer.c_weight, layer.input_scale,
                                                            layer.out_scale) + layer.bias)
    assert calls[-1] == MAX_ROWS + 1
    want = real(small[0], layer.c_weight, layer.input_scale, layer.out_scale) + layer.bias
    assert torch.equal(y_small[0], want) and y_big.shape == (MAX_ROWS + 1, 48)


def test_fp8_linear_without_fp8_bytes_keeps_one_copy():
    layer = _layer()
    assert layer.pack(keep_fp8=False) and layer.c_weight is None
    assert layer(torch.randn(1, 64).bfloat16()).shape == (1, 48)


def _documented_order(x, w):
    """csrc/fp8_gemv_cpu.c's sum order in numpy fp32: per 32 k, even and odd products
    summed apart from 0, then added to the total. x [M, K], w [N, K] E4M3 values."""
    p = (x.double()[:, None, :] * w.double()[None, :, :]).numpy().astype(np.float32)
    total = np.zeros(p.shape[:2], np.float32)
    for b in range(0, p.shape[2], 32):
        even = np.zeros_like(total)
        odd = np.zeros_like(total)
        for k in range(b, min(b + 32, p.shape[2]), 2):
            even = np.float32(even + p[..., k])
            if k + 1 < p.shape[2]:
                odd = np.float32(odd + p[..., k + 1])
        total = np.float32(total + np.float32(even + odd))
    return torch.from_numpy(total)


def test_sum_order_is_the_documented_one():
    """Sums where rounding shows the order: a = 448 * 448 (fp32 ulp 2^-6) plus products of
    half an ulp (t = 2^-7, lost to round-half-even next to a, kept on their own) minus a.
    Each case tells the documented order from another plausible one (one running sum,
    a tree of pairs, the block total added before the odd sum)."""
    a, t, na = (448.0, 448.0), (2**-4, 2**-3), (448.0, -448.0)
    cases = [  # {k: (x, w)}
        {0: a, 1: t, 4: na},  # odd t apart from the even a and -a: t (one sum: 0)
        {0: a, 1: t, 2: t, 3: t, 4: na},  # the even t lost, both odd kept: 2t
        {1: a, 2: t, 5: na},  # the even t apart: t
        {0: a, 2: t, 4: na, 6: t},  # even chain in k order: t (a tree of pairs: 0)
        {0: a, 32: t, 33: na},  # next block: a + (t + -a) = 0 ((a + -a) + t = t)
    ]
    x = torch.zeros(len(cases), 64)
    w = torch.zeros(len(cases), 64)
    for i, case in enumerate(cases):
        for k, (xv, wv) in case.items():
            x[i, k], w[i, k] = xv, wv
    got = torch.stack([fp8_gemv_bf16(x[i:i + 1].bfloat16(), w[i:i + 1].to(FP8_DTYPE), 1.0,
                                     torch.ones(1))[0, 0] for i in range(len(cases))])
    want = _documented_order(x, w).diagonal().bfloat16()
    assert torch.equal(got, want), (got, want)
    assert torch.equal(want.float() / 2**-7, torch.tensor([1.0, 2.0, 1.0, 1.0, 0.0]))
    running = []  # one fp32 sum in k order loses every t of the first three cases
    for case in cases:
        s = np.float32(0)
        for k in sorted(case):
            s = np.float32(s + np.float32(case[k][0] * case[k][1]))
        running.append(float(s) / 2**-7)
    assert running[:3] == [0.0, 0.0, 0.0]


def test_random_sums_follow_the_documented_order(seed):
    vals = torch.tensor([448.0, -448.0, 240.0, 2**-9, -2**-9, 0.875, 3.0, -1.5, 2**-4, 2**-3, 0.0])
    g = torch.Generator().manual_seed(seed)
    x = vals[torch.randint(0, len(vals), (MAX_ROWS, 96), generator=g)]
    w = vals[torch.randint(0, len(vals), (40, 96), generator=g)]
    got = fp8_gemv_bf16(x.bfloat16(), w.to(FP8_DTYPE), 1.0, torch.ones(1))
    assert torch.equal(got, _documented_order(x, w).bfloat16())


def _wonly_want(x, wq, ws):
    """Weight-only FP8 as csrc/fp8_gemv_cpu.c documents it: the bf16 input unquantized,
    fp32 sums in the documented order rounded to bf16, times the weight scale in fp32,
    rounded to bf16 (numpy emulation, independent of the kernel)."""
    sums = _documented_order(x.float(), wq.float()).bfloat16().float()
    return (sums * ws.reshape(1, -1).float()).bfloat16()


def _build_cases():
    """(name, FLAG_SETS) of the builds to compare on this machine: the loaded one, the
    portable one and, on x86, the AVX2 one (so AVX-512 and AMX machines test it too)."""
    cases = [("loaded", None), ("portable", native_build.FLAG_SETS[1:])]
    if platform.machine() in ("x86_64", "AMD64"):
        cases.append(("avx2", (AVX2_FLAGS,)))
    return cases


def _use_build(flags, tmp_path, monkeypatch) -> None:
    """Load the build of `flags` (None: the usual one) into a fresh cache for this test;
    the caller clears native_fp8_gemv._library after, so later tests load the usual one."""
    if flags is not None:
        monkeypatch.setenv("QSERVE_CACHE", str(tmp_path))
        monkeypatch.setattr(native_build, "FLAG_SETS", flags)
        monkeypatch.setattr(native_build, "_loaded", {})
        native_fp8_gemv._library.cache_clear()


@pytest.mark.parametrize("build", [c[0] for c in _build_cases()])
def test_weight_only_input_is_not_quantized_and_sums_in_the_documented_order(
        build, tmp_path, monkeypatch, seed):
    flags = dict(_build_cases())[build]
    x, wq, ws, _, _ = _case(MAX_ROWS, 600, 70)
    big = x.clone()
    big[3] = big[3] * 2.0**100  # far beyond E4M3's range: a power-of-two scaling must adapt
    _use_build(flags, tmp_path, monkeypatch)
    try:
        got = native_fp8_gemv.fp8_gemv_wonly_bf16(x, pack_fp8_weight(wq), ws)
        got_big = native_fp8_gemv.fp8_gemv_wonly_bf16(big, pack_fp8_weight(wq), ws)
        alone = torch.cat([native_fp8_gemv.fp8_gemv_wonly_bf16(x[i:i + 1], pack_fp8_weight(wq), ws)
                           for i in range(MAX_ROWS)])
    finally:
        if flags is not None:
            native_fp8_gemv._library.cache_clear()
    assert torch.equal(got, _wonly_want(x, wq, ws))
    assert torch.equal(alone, got)  # a row's result does not depend on the rows beside it
    assert bool(torch.isfinite(got_big).all())
    assert torch.equal(got_big, _wonly_want(big, wq, ws))
    # and it is the W8A16 product: unlike the static entry, x is not rounded to E4M3
    ref = x.double() @ (wq.double() * ws.double().reshape(-1, 1)).t()
    assert float((got.double() - ref).abs().max()) < 0.02 * float(ref.abs().max())
    s_in = float(x.float().abs().max()) / 448
    w8a8 = fp8_gemv_bf16(x, wq, s_in, ws.reshape(1, -1).float() * s_in)
    assert not torch.equal(w8a8, got)


def test_weight_only_fp8_linear_takes_the_wonly_kernel_and_fuses_with_its_kind(monkeypatch, seed):
    w = torch.randn(48, 64)
    ws = w.abs().amax(1, keepdim=True) / 448
    wq = quantize_fp8(w, ws)
    layer = Fp8Linear(wq, ws, None, None, torch.bfloat16)
    assert layer.weight_only and "W8A16" in repr(layer)
    x = torch.randn(3, 64).bfloat16()
    unpacked = layer(x)  # the torch path: x unquantized
    assert torch.equal(unpacked, fp8_linear_torch(x, wq.bfloat16(), ws, None))
    assert layer.pack() and layer.c_weight is not None
    calls = []
    real = native_fp8_gemv.fp8_gemv_wonly_bf16
    monkeypatch.setattr(native_fp8_gemv, "fp8_gemv_wonly_bf16",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    packed = layer(x)
    assert calls == [3] and torch.equal(packed, _wonly_want(x, wq, ws))
    step = _order_step(unpacked, x, wq, ws)
    assert bool(((packed.double() - unpacked.double()).abs() <= step).all())

    from qserve.runtime.layers.fusion import fuse_linears

    other = Fp8Linear(wq[:16], ws[:16], None, None, torch.bfloat16)
    fused = fuse_linears([Fp8Linear(wq, ws, None, None, torch.bfloat16), other])
    assert fused is not None and fused.weight_only
    assert torch.equal(fused(x), torch.cat([unpacked, other(x)], -1))
    static = Fp8Linear(wq[:16], ws[:16], torch.tensor([0.02]), None, torch.bfloat16)
    assert fuse_linears([Fp8Linear(wq, ws, None, None, torch.bfloat16), static]) is None


# -- int8 weights (W8A16 int): the same kernel, layout and sum order -------------------------

def _int8_case(rows, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-3, 1, k)).bfloat16()
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w[0, :8] = torch.tensor([127, -127, 1, -1, 0, 64, -64, 100], dtype=torch.int8)
    ws = torch.rand(n, 1, generator=g) * 0.01 + 1e-4
    return x, w, ws


@pytest.mark.parametrize("build", [c[0] for c in _build_cases()])
def test_int8_weight_only_sums_in_the_documented_order_on_every_build(
        build, tmp_path, monkeypatch, seed):
    """Int8 codes, decoded by the byte tables (sign and magnitude) or the AVX2 shifts (two's
    complement), give exactly the documented W8A16 sums on every build, whatever the rows;
    so every build gives the same bits."""
    flags = dict(_build_cases())[build]
    x, w, ws = _int8_case(MAX_ROWS, 600, 70, seed)
    big = x.clone()
    big[3] = big[3] * 2.0**100
    _use_build(flags, tmp_path, monkeypatch)
    try:
        packed = native_fp8_gemv.pack_int8_weight(w)
        assert packed.codes == "int8"
        got = native_fp8_gemv.fp8_gemv_wonly_bf16(x, packed, ws)
        got_big = native_fp8_gemv.fp8_gemv_wonly_bf16(big, packed, ws)
        rows = [native_fp8_gemv.fp8_gemv_wonly_bf16(x[:m], packed, ws) for m in ROW_COUNTS]
        tensor_scale = native_fp8_gemv.fp8_gemv_wonly_bf16(x, packed, ws[:1, 0])
        two = _with_threads(2, lambda: native_fp8_gemv.fp8_gemv_wonly_bf16(x, packed, ws))
    finally:
        if flags is not None:
            native_fp8_gemv._library.cache_clear()
    assert torch.equal(got, _wonly_want(x, w, ws))
    assert torch.equal(got_big, _wonly_want(big, w, ws))
    assert torch.equal(tensor_scale, _wonly_want(x, w, ws[:1].expand(70, 1)))
    assert torch.equal(two, got)
    for m, part in zip(ROW_COUNTS, rows):
        assert torch.equal(part, got[:m])
    ref = x.double() @ (w.double() * ws.double()).t()  # float64 oracle
    assert bool(((got.double() - ref).abs() <= _order_step(ref, x, w, ws)).all())


@pytest.mark.parametrize("layout", [native_fp8_gemv.LAYOUT_TILE, native_fp8_gemv.LAYOUT_PAIRS])
def test_int8_packing_encodes_each_weight_once_and_refuses_minus_128(layout):
    w = torch.randint(-127, 128, (40, 70), dtype=torch.int8)
    packed = native_fp8_gemv.pack_int8_weight(w, layout)
    assert (packed.out_features, packed.in_features, packed.layout) == (40, 70, layout)
    if layout == native_fp8_gemv.LAYOUT_PAIRS:  # two's complement
        want = w.view(torch.uint8)
    else:  # sign and magnitude
        want = w.abs().to(torch.uint8) | ((w < 0).to(torch.uint8) << 7)
    padded = torch.zeros(48, 96, dtype=torch.uint8)
    padded[:40, :70] = want
    assert torch.equal(packed.data.sort().values, padded.flatten().sort().values)
    w[1, 2] = -128
    with pytest.raises(ValueError, match="-128"):
        native_fp8_gemv.pack_int8_weight(w, layout)
    with pytest.raises(ValueError, match="int8 matrix"):
        native_fp8_gemv.pack_int8_weight(w.float(), layout)


def test_int8_weights_refuse_the_input_quantizing_entries():
    packed = native_fp8_gemv.pack_int8_weight(torch.ones(16, 32, dtype=torch.int8))
    x = torch.ones(1, 32).bfloat16()
    with pytest.raises(ValueError, match="weight-only"):
        native_fp8_gemv.fp8_gemv_bf16(x, packed, 1.0, torch.ones(1))
    with pytest.raises(ValueError, match="weight-only"):
        fp8_gemv_dynamic_bf16(x, packed, torch.ones(1))


def test_int8_linear_runs_the_int8_kernel_and_fuses_with_its_kind(monkeypatch, seed):
    x, w, ws = _int8_case(3, 64, 48, seed)
    layer = Fp8Linear(w, ws, None, None, torch.bfloat16)
    assert layer.codes == "int8" and layer.weight_only and "int8 W8A16" in repr(layer)
    unpacked = layer(x)  # the torch path: the int8 values upcast (exact)
    assert torch.equal(unpacked, fp8_linear_torch(x, w.bfloat16(), ws, None))
    if not native_fp8_gemv.vectorized():
        pytest.skip(f"the C kernel runs only where vectorised (this build: {native_fp8_gemv.path()})")
    assert layer.pack() and layer.c_weight is not None and layer.c_weight.codes == "int8"
    packed = layer(x)
    assert torch.equal(packed, _wonly_want(x, w, ws))
    assert bool(((packed.double() - unpacked.double()).abs()
                 <= _order_step(unpacked, x, w, ws)).all())
    from qserve.runtime.layers.fusion import fuse_linears

    other = Fp8Linear(w[:16], ws[:16], None, None, torch.bfloat16)
    fused = fuse_linears([Fp8Linear(w, ws, None, None, torch.bfloat16), other])
    assert fused is not None and fused.codes == "int8"
    assert torch.equal(fused(x), torch.cat([unpacked, other(x)], -1))
    e4m3 = Fp8Linear(quantize_fp8(w.float(), ws * 127 / 448), ws, None, None, torch.bfloat16)
    assert fuse_linears([Fp8Linear(w, ws, None, None, torch.bfloat16), e4m3]) is None
    with pytest.raises(ValueError, match="weight-only"):
        Fp8Linear(w, ws, torch.tensor([0.1]), None, torch.bfloat16)


def test_int8_linear_with_minus_128_keeps_the_matmul(seed):
    """Codes of the full int8 range (-128, as other writers may round) have no byte in the
    C kernel's tables: the layer packs for the matmul only, and still computes them."""
    x, w, ws = _int8_case(3, 64, 48, seed)
    w[5, 7] = -128
    layer = Fp8Linear(w, ws, None, None, torch.bfloat16)
    unpacked = layer(x)
    assert torch.equal(unpacked, fp8_linear_torch(x, w.bfloat16(), ws, None))
    assert layer.pack() and layer.c_weight is None
    step = _order_step(unpacked, x, w, ws)
    assert bool(((layer(x).double() - unpacked.double()).abs() <= step).all())
