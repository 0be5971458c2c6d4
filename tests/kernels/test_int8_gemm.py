"""The W8A8 int8 linear: the C kernel (csrc/int8_gemm_cpu.c) against the torch reference
(kernels/int8_gemm.py) bit for bit, the reference against a float64 oracle, and the
kernel's layout, rows, threads and refusals. CI runs this file again as an AVX2 machine
(QSERVE_CPU_CLASS=avx2), which takes the AVX2 path."""

import pytest
import torch

from qserve.kernels import cpu_class, native_int8_gemm
from qserve.kernels.int8_gemm import int8_linear_torch, int_matmul, quantize_rows_int8

needs_c = pytest.mark.skipif(not native_int8_gemm.available(), reason="no C compiler")


def _case(m, k, n, per_channel=True):
    x = (torch.randn(m, k) * torch.rand(m, 1) * 4).to(torch.bfloat16)  # rows of other scales
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    ws = torch.rand(n if per_channel else 1) * 0.02 + 1e-3
    return x, w, ws


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_quantize_rows_rounds_half_to_even_and_keeps_zero_rows():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0], [0, 0, 0, 0, 0]])
    q, s = quantize_rows_int8(x)
    assert q.dtype == torch.int8 and s.shape == (2, 1)
    assert s[0, 0] == 1.0 and s[1, 0] == 0
    assert q.tolist() == [[127, 0, 2, -2, -127], [0, 0, 0, 0, 0]]


def test_reference_is_the_float64_product_of_its_codes(seed):
    """Independent oracle: the same codes multiplied and scaled in float64 (exact sums),
    rounded once at the end, against the reference's int32 sums and fp32 scaling."""
    x, w, ws = _case(9, 300, 70)
    y = int8_linear_torch(x, w, ws)  # [9, 70] bf16
    q, s = quantize_rows_int8(x)
    acc = q.double() @ w.double().t()
    assert torch.equal(int_matmul(q, w).double(), acc)  # integer sums, exactly
    want = acc * (s.double() * ws.double().reshape(1, -1))
    # fp32 conversion of the sum and of the scale product: a few fp32 ulps, then bf16
    assert torch.allclose(y.double(), want, rtol=2 ** -8, atol=0)
    # and near the unquantized product: the per-row int8 step bounds the error
    exact = x.double() @ (w.double() * ws.double().reshape(-1, 1)).t()
    bound = (s.double() / 2) * (w.double().abs() * ws.double().reshape(-1, 1)).sum(1)  # [9, 70]
    assert ((want - exact).abs() <= bound + 1e-9).all()


@needs_c
@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (1, 896, 1152), (3, 70, 33), (5, 260, 72),
                                   (7, 576, 200), (9, 520, 64), (11, 96, 128), (16, 256, 130),
                                   (64, 300, 64), (70, 20, 8), (130, 128, 96)])
@pytest.mark.parametrize("threads", [1, 2])
def test_c_kernel_equals_the_reference_bit_for_bit(m, k, n, threads, seed):
    x, w, ws = _case(m, k, n, per_channel=(m + n) % 2 == 0)
    packed = native_int8_gemm.pack_int8_w8a8_weight(w)
    with torch.inference_mode():
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = native_int8_gemm.int8_gemm_bf16(x, packed, ws)
        finally:
            torch.set_num_threads(old)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert _same_bits(got, int8_linear_torch(x, w, ws))


@needs_c
def test_rows_get_the_same_bits_alone_and_in_any_batch(seed):
    x, w, ws = _case(40, 384, 192)
    packed = native_int8_gemm.pack_int8_w8a8_weight(w)
    batch = native_int8_gemm.int8_gemm_bf16(x, packed, ws)
    for i in (0, 7, 39):
        assert _same_bits(native_int8_gemm.int8_gemm_bf16(x[i:i + 1], packed, ws), batch[i:i + 1])
    strided = torch.zeros(40, 500, dtype=torch.bfloat16)[:, :384]
    strided.copy_(x)
    assert _same_bits(native_int8_gemm.int8_gemm_bf16(strided, packed, ws), batch)


@needs_c
def test_zero_and_non_finite_rows(seed):
    x, w, ws = _case(3, 128, 64)
    x[0] = 0
    x[1, 5] = float("inf")
    y = native_int8_gemm.int8_gemm_bf16(x, native_int8_gemm.pack_int8_w8a8_weight(w), ws)
    assert (y[0] == 0).all() and y[1].isnan().all() and y[2].isfinite().all()
    ref = int8_linear_torch(x, w, ws)
    assert (ref[0] == 0).all() and ref[1].isnan().all() and _same_bits(ref[2], y[2])


def test_pack_layout_and_refusals():
    w = torch.arange(-60, 60, dtype=torch.int8).reshape(2, 60)  # [2, 60]
    p = native_int8_gemm.pack_int8_w8a8_weight(w)
    assert p.data.dtype == torch.uint8 and p.data.numel() == 64 * 60
    # byte (band 0, quad s, channel c, j) = w[c, 4 s + j] + 128; padded channels hold 128
    view = p.data.view(15, 64, 4)
    assert torch.equal(view[:, :2].permute(1, 0, 2).reshape(2, 60).to(torch.int16) - 128,
                       w.to(torch.int16))
    assert (view[:, 2:] == 128).all()
    with pytest.raises(native_int8_gemm.Int8RangeError, match="-128"):
        native_int8_gemm.pack_int8_w8a8_weight(torch.full((2, 4), -128, dtype=torch.int8))
    with pytest.raises(ValueError, match="int8 matrix"):
        native_int8_gemm.pack_int8_w8a8_weight(torch.zeros(2, 4))


@needs_c
def test_bad_calls_are_named():
    p = native_int8_gemm.pack_int8_w8a8_weight(torch.ones(8, 16, dtype=torch.int8))
    with pytest.raises(ValueError, match="weight expects 16"):
        native_int8_gemm.int8_gemm_bf16(torch.ones(2, 12, dtype=torch.bfloat16), p,
                                        torch.ones(8))
    with pytest.raises(ValueError, match="weight_scale has 3"):
        native_int8_gemm.int8_gemm_bf16(torch.ones(2, 16, dtype=torch.bfloat16), p,
                                        torch.ones(3))


@needs_c
def test_the_path_is_the_cpu_class_s():
    """The build takes the vector path this CPU class (or QSERVE_CPU_CLASS) allows."""
    flags = cpu_class.cpu_flags()
    want = "avx512-vnni" if {"avx512_vnni", "avx512bw"} <= flags else \
        "avx2" if "avx2" in flags else "portable"
    assert native_int8_gemm.path() == want


@needs_c
@pytest.mark.parametrize("m", [1, 5, 16, 70])
def test_argmax_is_torch_s_argmax_of_the_outputs(m, seed):
    """Greedy tokens without the logits: the id and value torch.argmax / max find in what
    the forward entry writes, ties to the lowest id (outputs forced equal by repeating
    channels), a NaN row to its first NaN."""
    x, w, ws = _case(m, 96, 300)
    w[150] = w[20]  # equal channels: equal outputs, the lower id wins a tie for the max
    ws[150] = ws[20]
    x[0, 3] = float("nan") if m > 1 else x[0, 3]
    packed = native_int8_gemm.pack_int8_w8a8_weight(w)
    y = native_int8_gemm.int8_gemm_bf16(x, packed, ws)
    ids, values = native_int8_gemm.int8_gemm_argmax_bf16(x, packed, ws)
    assert torch.equal(ids, y.argmax(-1))
    finite = ~y.isnan().any(-1)
    assert torch.equal(values[finite], y.float().max(-1).values[finite])
