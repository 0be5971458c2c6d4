"""The CPU fast paths of the FP8 linear: E4M3 rounding without the float8 dtype, packed
weights (kernels/cpu_linear.py: every strategy this CPU can run, oneDNN bf16 where it is
native and the fp32 copy everywhere), and the model packing pass; each against the plain
path or float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qserve.kernels.fp8 import quantize_fp8, quantize_fp8_values
from qserve.kernels.fp8_gemm import fp8_linear_reference, fp8_linear_torch
from qserve.kernels import cpu_linear
from qserve.kernels.cpu_linear import pack_linear_weight, packed_linear
from qserve.runtime.layers.fp8_linear import Fp8Linear
from qserve.runtime.layers.packing import PackedLinear, pack_for_cpu

# the packing strategies this CPU runs: fp32 everywhere, oneDNN where bf16 is native
HERE = [s for s in cpu_linear.STRATEGIES if s == "fp32" or cpu_linear._native_bf16()]


@pytest.fixture(params=HERE)
def strategy(request, monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV_VAR, request.param)
    return request.param

ALL_BF16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (NaN equals NaN), same dtype."""
    return a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("scale", [1.0, 0.0123, 3.7e-3, 17.5, 1e-30, 2.0**-9])
def test_values_path_equals_the_cast_on_every_bf16_value(scale):
    s = torch.tensor([scale], dtype=torch.float32)
    want = quantize_fp8(ALL_BF16, s).to(torch.bfloat16)
    got = quantize_fp8_values(ALL_BF16, s)
    bad = ~((want == got) | (want.isnan() & got.isnan()))
    assert not bad.any(), (ALL_BF16[bad][:5], want[bad][:5], got[bad][:5])


def test_values_path_equals_the_cast_on_fp32_with_per_channel_scales(seed):
    x = torch.randn(64, 96) * torch.logspace(-12, 4, 96)  # every binade incl. subnormals
    x[0, :6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45])
    s = torch.rand(64, 1) * 0.1 + 1e-3  # per row
    assert _same(quantize_fp8_values(x, s), quantize_fp8(x, s).to(torch.float32))


@pytest.mark.parametrize("rows", [1, 3, 16, 300])
def test_packed_linear_matches_float64(rows, seed, strategy):
    w = torch.randn(96, 80).bfloat16()
    x = torch.randn(rows, 80).bfloat16()
    y = packed_linear(x, pack_linear_weight(w))
    ref = x.double() @ w.double().t()
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
    assert pack_linear_weight(w).dtype == (torch.float32 if strategy == "fp32" else torch.bfloat16)
    # fp32 accumulation, one bf16 rounding of the output
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-3)


def test_packed_linear_rejects_mismatched_input(strategy):
    with pytest.raises(ValueError, match=r"does not match the packed weight"):
        packed_linear(torch.randn(2, 7).bfloat16(), pack_linear_weight(torch.randn(4, 8).bfloat16()))


def _fp8_layer(out_f=48, in_f=64, per_channel=True):
    w = torch.randn(out_f, in_f)
    ws = (w.abs().amax(1, keepdim=True) / 448) if per_channel else w.abs().max().reshape(1) / 448
    wq = quantize_fp8(w, ws)
    return Fp8Linear(wq, ws, torch.tensor([0.02]), torch.randn(out_f), torch.bfloat16), wq, ws


@pytest.mark.parametrize("rows", [1, 16, 200])
@pytest.mark.parametrize("per_channel", [True, False])
def test_packed_fp8_linear_matches_unpacked_and_float64(rows, per_channel, seed, strategy):
    layer, wq, ws = _fp8_layer(per_channel=per_channel)
    x = torch.randn(rows, 64).bfloat16()
    plain = layer(x)
    assert layer.pack() and layer.packed and layer.pack()  # idempotent
    packed = layer(x)
    ref = fp8_linear_reference(x, wq, ws, layer.input_scale, layer.bias.float())
    # Three bf16 roundings on the torch path, half an ulp (<= 2**-8 relative) each: the
    # matmul's accumulator, the scaled output, the bias add; measured against the sizes
    # they round (the bias add can cancel), so: |y - ref| <= 3 * 2**-8 (|ref - b| + |b|).
    size = (ref - layer.bias.double()).abs() + layer.bias.double().abs()
    for got in (plain, packed):
        _assert_within(got, ref, 3 * 2**-8 * size)
    # packed and plain sum the same fp32 products in another order: twice that between them
    _assert_within(packed, plain.double(), 6 * 2**-8 * size)


def _assert_within(y, ref, bound):
    err = (y.double() - ref).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound + 1e-6).all()), (worst, float(err.flatten()[worst]),
                                                 float(bound.flatten()[worst]))


def test_fp8_linear_torch_precomputed_scale_is_the_same_arithmetic(seed):
    layer, wq, ws = _fp8_layer()
    x = torch.randn(20, 64).bfloat16()  # over the values-path threshold in total elements
    a = fp8_linear_torch(x, layer.weight, layer.weight_scale, layer.input_scale, layer.bias)
    b = fp8_linear_torch(x, layer.weight, layer.weight_scale, layer.input_scale, layer.bias,
                         out_scale=layer.out_scale)
    assert torch.equal(a, b)


@pytest.mark.parametrize("scale", [1.0, 0.0123, 1e-30])
def test_compiled_quantization_equals_the_cast_on_every_bf16_value(scale, monkeypatch):
    from qserve.kernels import fp8_gemm

    monkeypatch.setenv("QSERVE_REQUIRE_COMPILE", "1")  # a compile failure fails the test
    s = torch.tensor([scale], dtype=torch.float32)
    x = ALL_BF16.reshape(-1, 256)  # 65,536 values, dynamic row count
    assert _same(fp8_gemm._quantize_values_fused(x, s), quantize_fp8(x, s).to(torch.bfloat16))
    acc = torch.randn(256, 96).bfloat16()
    out_scale = torch.rand(1, 96) * 1e-3
    assert torch.equal(fp8_gemm._rescale_fused(acc, out_scale),
                       torch.mul(acc, out_scale).to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 16, 65536 // 64 + 3])
def test_native_compiled_and_eager_paths_give_the_same_layer_output(rows, seed, monkeypatch):
    """bf16 takes the C passes at every size; without them, inductor's fused passes (from
    _COMPILED_PATH_MIN elements) or the eager ops: all bit-identical."""
    from qserve.kernels import fp8_gemm, native_fp8

    monkeypatch.setenv("QSERVE_REQUIRE_COMPILE", "1")
    layer, _, _ = _fp8_layer()
    x = torch.randn(rows, 64).bfloat16()
    args = (layer.weight, layer.weight_scale, layer.input_scale, layer.bias)
    assert native_fp8.available()
    native = fp8_linear_torch(x, *args)
    monkeypatch.setattr(native_fp8, "available", lambda: False)
    torch_path = fp8_linear_torch(x, *args)  # compiled for the largest, eager otherwise
    monkeypatch.setattr(fp8_gemm, "_COMPILED_PATH_MIN", 1 << 62)  # the eager ops only
    assert torch.equal(native, torch_path) and torch.equal(native, fp8_linear_torch(x, *args))


@pytest.mark.parametrize("scale", [1.0, 0.0123, 3.7e-3, 17.5, 1e-30, 2.0**-9])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_quantization_equals_the_cast_on_every_bf16_value(scale, threads):
    from qserve.kernels import native_fp8

    s = torch.tensor([scale], dtype=torch.float32)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)  # 65,536 values: the OpenMP split from 2 threads
    try:
        got = native_fp8.quantize_values_bf16(ALL_BF16, s)
    finally:
        torch.set_num_threads(old)
    want = quantize_fp8(ALL_BF16, s).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # NaN bits included


@pytest.mark.parametrize("per_channel", [True, False])
def test_native_rescale_equals_torch_on_every_bf16_value(per_channel, seed):
    from qserve.kernels import native_fp8

    acc = ALL_BF16.reshape(256, 256)
    scale = torch.rand(1, 256 if per_channel else 1) * 1e-2
    got = native_fp8.rescale_bf16(acc, scale)
    assert _same(got, torch.mul(acc, scale).to(torch.bfloat16))  # NaN payloads may differ
    with pytest.raises(ValueError, match="need 1 or 256"):
        native_fp8.rescale_bf16(acc, torch.ones(3))
    with pytest.raises(ValueError, match="contiguous bf16"):
        native_fp8.quantize_values_bf16(ALL_BF16.float(), scale[:, :1])


def test_pack_for_cpu_packs_every_linear_and_keeps_tied_embedding(seed, strategy):
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 64)
            self.proj = _fp8_layer(64, 64)[0]
            self.mlp = nn.Linear(64, 64).bfloat16()
            self.lm_head = nn.Linear(64, 50, bias=False)
            self.embed.bfloat16()
            self.lm_head.weight = self.embed.weight  # tied

        def forward(self, ids):
            return self.lm_head(self.mlp(self.proj(self.embed(ids))))

    m = Tiny()
    ids = torch.tensor([1, 7, 42])
    before = m(ids).double()
    emb = m.embed.weight.detach().clone()
    assert pack_for_cpu(m) == 3 and pack_for_cpu(m) == 3
    assert isinstance(m.lm_head, PackedLinear) and isinstance(m.mlp, PackedLinear)
    assert m.proj.packed
    assert torch.equal(m.embed.weight, emb)  # the embedding keeps its plain layout
    torch.testing.assert_close(m(ids).double(), before, rtol=2**-6, atol=2e-2)


def test_pack_for_cpu_leaves_fp32_models_alone():
    m = nn.Sequential(nn.Linear(8, 8))
    assert pack_for_cpu(m) == 0 and type(m[0]) is nn.Linear


def test_packed_fp8_linear_refuses_input_off_the_cpu(strategy):
    layer, _, _ = _fp8_layer()
    assert layer.pack()
    with pytest.raises(RuntimeError, match="packed for the CPU and got input on meta"):
        layer(torch.empty(2, 64, dtype=torch.bfloat16, device="meta"))


def test_a_forced_strategy_this_cpu_cannot_run_is_named(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV_VAR, "bf16-please")
    with pytest.raises(ValueError, match="QSERVE_CPU_LINEAR='bf16-please'; choose one of"):
        cpu_linear.strategy()
    monkeypatch.setenv(cpu_linear.ENV_VAR, "onednn-bf16")
    if cpu_linear._native_bf16():
        assert cpu_linear.strategy() == "onednn-bf16"
    else:
        with pytest.raises(ValueError, match="no oneDNN bf16; unset it or choose fp32"):
            cpu_linear.strategy()


def test_auto_strategy_follows_the_cpu(monkeypatch):
    monkeypatch.delenv(cpu_linear.ENV_VAR, raising=False)
    assert cpu_linear.strategy() == ("onednn-bf16" if cpu_linear._native_bf16() else "fp32")
