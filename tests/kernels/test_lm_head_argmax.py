"""The LM head's greedy step in C (native_fp8_gemv.fp8_gemv_argmax_bf16,
csrc/fp8_gemv_cpu.c's qserve_fp8_gemv_argmax_bf16): per row the id of the largest output
and that output, without the [rows, vocab] outputs. Against float64 (planted winners and
exact ties, one in the last, partial tile of a vocabulary that is no multiple of 16),
against the documented sums emulated in numpy, and against torch.argmax of the kernel's
own outputs, for int8 and E4M3 weights (weight-only and static), 1 to 8 rows and 1 to 3
threads, on the loaded build, the build QSERVE_CPU_CLASS=avx2 makes and the portable one;
then Fp8Linear.greedy_ids and the model's greedy_tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qserve.kernels import cpu_class, native_build, native_fp8_gemv
from qserve.kernels.fp8 import quantize_fp8
from qserve.kernels.native_fp8_gemv import (fp8_gemv_argmax_bf16, fp8_gemv_bf16,
                                            fp8_gemv_wonly_bf16, pack_fp8_weight,
                                            pack_int8_weight)
from qserve.runtime.layers.fp8_linear import Fp8Linear

pytestmark = pytest.mark.skipif(not native_fp8_gemv.available(), reason="no C compiler")

SCHEMES = ("int8", "e4m3-wonly", "e4m3-static")
ROWS = (1, 2, 3, 7, 8)  # one and two rows decode into registers, three per block, 7+ buffered
# (k, vocabulary): k not a multiple of 32 with one thread; 4099 = 256 tiles + 3 channels,
# enough products for the OpenMP split from 2 threads
SHAPES = ((40, 1007), (128, 4099))


def _documented_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """csrc/fp8_gemv_cpu.c's fp32 sums in numpy: per 32 k, the even and the odd products
    summed apart from 0 in k order, then added to the total. x [M, K], w [N, K] values
    whose products are exact in fp32 -> [M, N] fp32."""
    xs, ws = x.double().numpy(), w.double().numpy()
    total = np.zeros((xs.shape[0], ws.shape[0]), np.float32)
    for b in range(0, xs.shape[1], 32):
        even = np.zeros_like(total)
        odd = np.zeros_like(total)
        for k in range(b, min(b + 32, xs.shape[1])):
            p = np.outer(xs[:, k], ws[:, k]).astype(np.float32)  # exact
            if k % 2 == 0:
                even = np.float32(even + p)
            else:
                odd = np.float32(odd + p)
        total = np.float32(total + np.float32(even + odd))
    return torch.from_numpy(total)


class Head:
    """A random head of one scheme with planted winners: row r's x aligned with a channel
    (`planted[r]`), two pairs of identical channels (an exact tie, which the lower id must
    win), one pair in one tile and one far apart (other threads), and the last channel,
    in the partial last tile, the winner of row 2."""

    def __init__(self, scheme: str, k: int, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.scheme, self.k, self.n = scheme, k, n
        # [8, k]: orthogonal rows of norm sqrt(k), so a channel aligned with one row is far
        # above every other channel in that row
        q, _ = torch.linalg.qr(torch.randn(k, 8, generator=g))
        self.x = (q.t() * k**0.5).bfloat16()
        w = torch.randn(n, k, generator=g)  # [n, k] fp32
        self.planted = [3, n // 2, n - 1, 17, 5, n // 2 - 40, 1, n // 3]  # per row: its winner
        self.ties = {4: (5, 8), 5: (n // 2 - 40, n - 2)}  # row: (lower id, its copy)
        for r, c in enumerate(self.planted):
            w[c] = 3 * self.x[r].float()  # x . w = 3 |x|^2: far above the random channels
        for lo, hi in self.ties.values():
            w[hi] = w[lo]
        if scheme == "int8":
            ws = w.abs().amax(1, keepdim=True) / 127  # [n, 1]
            self.codes = torch.round(w / ws).clamp(-127, 127).to(torch.int8)  # [n, k]
            self.packed = pack_int8_weight(self.codes)
        else:
            ws = w.abs().amax(1, keepdim=True) / 448
            self.codes = quantize_fp8(w, ws)  # [n, k] E4M3
            self.packed = pack_fp8_weight(self.codes)
        self.weight_scale = ws  # [n, 1] fp32
        self.input_scale = (float(self.x.float().abs().max()) / 448
                            if scheme == "e4m3-static" else 0.0)
        # fp32 [1, n]: the input scale times the weight scales (weight-only: the latter)
        self.out_scale = ws.reshape(1, -1) * (self.input_scale or 1.0)

    def inputs(self, m: int) -> torch.Tensor:
        """The values the kernel multiplies: x itself, or its E4M3 codes (static) [m, k]."""
        x = self.x[:m]
        return (quantize_fp8(x, torch.tensor(self.input_scale)).float()
                if self.input_scale else x.float())

    def outputs(self, m: int) -> torch.Tensor:
        """The entry the argmax stands for: the [m, n] bf16 outputs of its linear."""
        if self.input_scale:
            return fp8_gemv_bf16(self.x[:m], self.packed, self.input_scale, self.out_scale)
        return fp8_gemv_wonly_bf16(self.x[:m], self.packed, self.weight_scale)

    def argmax(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_gemv_argmax_bf16(self.x[:m], self.packed, self.out_scale, self.input_scale)

    def emulated(self, m: int) -> torch.Tensor:
        """[m, n] fp32: the documented sums rounded to bf16, times the out scale, rounded
        to bf16 (numpy, independent of the kernel)."""
        sums = _documented_sums(self.inputs(m), self.codes.float()).bfloat16().float()
        return (sums * self.out_scale).bfloat16().float()

    def exact(self, m: int) -> torch.Tensor:
        """[m, n] float64: the linear's outputs, summed over k in one order for every
        channel (a BLAS matmul may order channels' sums differently by their position,
        which can part two identical channels by an ulp and break a planted tie)."""
        xs = self.inputs(m).double().numpy()  # [m, k]
        ws = (self.codes.double() * self.out_scale.double().reshape(-1, 1)).numpy()  # [n, k]
        total = np.zeros((xs.shape[0], ws.shape[0]))
        for k in range(xs.shape[1]):
            total += np.outer(xs[:, k], ws[:, k])
        return torch.from_numpy(total)


def _with_threads(n: int, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="module")
def build_cache(tmp_path_factory):
    """One cache for the builds these tests make, so each compiles once."""
    return tmp_path_factory.mktemp("argmax-builds")


BUILDS = ("loaded", "cpu-class-avx2", "portable")


def _use_build(build: str, cache, monkeypatch) -> None:
    """Load `build`: the usual library; the one a process under QSERVE_CPU_CLASS=avx2
    builds (x86-64-v3 on a bigger CPU, -march=native on an AVX2 one: the AVX2 path
    either way); or the portable one. The caller clears native_fp8_gemv._library after."""
    if build == "loaded":
        return
    if build == "cpu-class-avx2":
        if cpu_class.cpu_class(cpu_class.detected_flags()) == "portable":
            pytest.skip("this CPU has no AVX2 + FMA")
        monkeypatch.setenv(cpu_class.ENV_VAR, "avx2")
        flags = (native_build.flags_for(cpu_class.build_march(), *cpu_class.build_extra_flags()),)
    else:
        flags = native_build.FLAG_SETS[1:]
    monkeypatch.setenv("QSERVE_CACHE", str(cache))
    monkeypatch.setattr(native_build, "FLAG_SETS", flags)
    monkeypatch.setattr(native_build, "_loaded", {})
    native_fp8_gemv._library.cache_clear()


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_argmax_is_the_float64_winner_and_the_argmax_of_the_outputs(
        build, scheme, build_cache, monkeypatch, seed):
    _use_build(build, build_cache, monkeypatch)
    try:
        if build == "cpu-class-avx2":
            assert native_fp8_gemv.path() == "avx2"
        if build == "portable":
            assert native_fp8_gemv.path() == "portable"
        for k, n in SHAPES:
            head = Head(scheme, k, n, seed)
            full = head.outputs(8).float()  # [8, n]: what the argmax stands for
            for m in ROWS:
                for threads in (1, 2, 3):
                    ids, values = _with_threads(threads, lambda: head.argmax(m))
                    assert ids.dtype == torch.int64 and ids.shape == (m,)
                    assert values.dtype == torch.float32 and values.shape == (m,)
                    # torch.argmax of the outputs the other entries write, bit for bit
                    assert torch.equal(ids, full[:m].argmax(-1)), (k, n, m, threads)
                    assert torch.equal(values, full[:m].max(-1).values)
            emulated = head.emulated(8)  # the documented sums, independent of the kernel
            assert torch.equal(ids, emulated.argmax(-1)) and torch.equal(values, emulated.max(-1).values)
            exact = head.exact(8)  # float64
            want = torch.from_numpy(np.argmax(exact.numpy(), axis=1))  # the lowest of ties
            assert ids.tolist() == want.tolist() == [
                head.ties.get(r, (c,))[0] for r, c in enumerate(head.planted)]
            assert ids[2] == n - 1  # the last channel, in the partial last tile
    finally:
        native_fp8_gemv._library.cache_clear()


@pytest.mark.parametrize("build", BUILDS)
def test_random_rows_pick_a_float64_near_maximum(build, build_cache, monkeypatch, seed):
    """Without planted winners the top logits are close: the id is the argmax of the
    rounded outputs, and its exact logit is within the roundings of the exact maximum."""
    _use_build(build, build_cache, monkeypatch)
    try:
        for scheme in SCHEMES:
            g = torch.Generator().manual_seed(seed)
            x = (torch.randn(8, 200, generator=g) * torch.logspace(-2, 1, 200)).bfloat16()
            head = Head(scheme, 200, 3001, seed)
            head.x = x
            if head.input_scale:
                head.input_scale = float(x.float().abs().max()) / 448
                head.out_scale = head.weight_scale.reshape(1, -1) * head.input_scale
            ids, values = _with_threads(2, lambda: head.argmax(8))
            full = head.outputs(8).float()
            assert torch.equal(ids, full.argmax(-1)) and torch.equal(values, full.max(-1).values)
            emulated = head.emulated(8)
            assert torch.equal(ids, emulated.argmax(-1))
            exact = head.exact(8)  # [8, n] float64
            size = head.inputs(8).double().abs() @ (
                head.codes.double() * head.out_scale.double().reshape(-1, 1)).abs().t()
            top = exact.max(-1).values
            # each output within two bf16 roundings and the fp32 sum's error of its exact
            # value: the pick can lose at most twice that to the exact maximum
            err = 2 * (2**-7 * exact.abs().amax(-1) + head.k * 2**-24 * size.amax(-1))
            picked = exact.gather(1, ids.reshape(-1, 1)).squeeze(1)
            assert bool((picked >= top - err).all()), (picked - top, err)
    finally:
        native_fp8_gemv._library.cache_clear()


@pytest.mark.parametrize("build", BUILDS)
def test_nan_outputs_win_as_in_torch_argmax(build, build_cache, monkeypatch, seed):
    """An infinite input makes the channels with a zero weight at its k NaN and the others
    infinite: torch.argmax puts NaN above everything (its first); so does the kernel. An
    all-NaN row (a NaN input) gives id 0."""
    _use_build(build, build_cache, monkeypatch)
    try:
        head = Head("int8", 128, 4099, seed)
        # a zero weight at k = 7 for channels 2103, 2108, ...: the first NaN is 2103, in
        # another thread's channels than the first infinite ones (with 2 or 3 threads)
        head.codes[:, 7] = torch.where(torch.arange(4099) % 5 == 3, 0, 1).to(torch.int8)
        head.codes[:2100, 7] = 1
        head.packed = pack_int8_weight(head.codes)
        head.x[1, 7] = float("inf")
        head.x[4, 9] = float("nan")
        full = head.outputs(8).float()
        assert full[1].isnan().any() and not full[1].isnan().all()
        assert full[4].isnan().all()
        for threads in (1, 2, 3):
            ids, values = _with_threads(threads, lambda: head.argmax(8))
            assert torch.equal(ids, full.argmax(-1))
            assert ids[1] == 2103 and ids[4] == 0
            assert values[1].isnan() and values[4].isnan()
    finally:
        native_fp8_gemv._library.cache_clear()


def test_bad_arguments_are_named():
    head = Head("int8", 40, 33, 0)
    with pytest.raises(ValueError, match="weight-only"):  # int8 codes: no input scale
        fp8_gemv_argmax_bf16(head.x, head.packed, head.out_scale, 0.5)
    with pytest.raises(ValueError, match="bf16 CPU matrix"):
        fp8_gemv_argmax_bf16(head.x.float(), head.packed, head.out_scale)
    with pytest.raises(ValueError, match="need 1 or 33"):
        fp8_gemv_argmax_bf16(head.x, head.packed, torch.ones(2))
    ids, values = fp8_gemv_argmax_bf16(head.x[:0], head.packed, head.out_scale)
    assert ids.shape == (0,) and values.shape == (0,)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fp8_linear_greedy_ids_equal_the_argmax_of_its_forward(scheme, seed):
    head = Head(scheme, 128, 4099, seed)
    input_scale = torch.tensor([head.input_scale]) if head.input_scale else None
    layer = Fp8Linear(head.codes, head.weight_scale, input_scale, None, torch.bfloat16)
    x = head.x[:3]
    assert layer.greedy_ids(x) is None  # not packed: forward runs torch's matmul
    if not native_fp8_gemv.vectorized():
        pytest.skip(f"the C kernel runs only where vectorised ({native_fp8_gemv.path()})")
    assert layer.pack() and layer.c_weight is not None
    want = layer(x).float().argmax(-1)
    assert torch.equal(layer.greedy_ids(x), want)
    assert torch.equal(layer.greedy_ids(x[None]), want[None])  # [1, 3, k] -> [1, 3]
    layer.c_rows = 2  # forward multiplies 3 rows otherwise: no fused argmax either
    assert layer.greedy_ids(x) is None and layer.greedy_ids(x[:2]) is not None
    layer.c_rows = 10**9
    assert layer.greedy_ids(x.float()) is None  # fp32 rows do not run the C kernel
    layer.bias = torch.nn.Parameter(torch.ones(4099).bfloat16(), requires_grad=False)
    assert layer.greedy_ids(x) is None  # a bias is added after the kernel


def test_model_greedy_tokens_fuse_only_an_uncapped_8bit_head(tmp_path, monkeypatch, seed):
    """LlamaForCausalLM.greedy_tokens: the head's fused argmax where it is an 8-bit linear
    that runs the C kernel and the model has no final softcap; else the logits' argmax.
    The same tokens either way."""
    import sys
    from dataclasses import replace
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import write_tiny_llama

    from qserve.runtime.loaded_model import load
    from qserve.runtime.layers.packing import pack_for_cpu

    if not native_fp8_gemv.vectorized():
        pytest.skip(f"the C kernel runs only where vectorised ({native_fp8_gemv.path()})")
    model = load(str(write_tiny_llama(tmp_path / "tiny", vocab_size=1007)), torch.bfloat16).model
    head = Head("int8", model.config.hidden_size, 1007, seed)
    model.lm_head = Fp8Linear(head.codes, head.weight_scale, None, None, torch.bfloat16)
    pack_for_cpu(model)
    calls = []
    real = native_fp8_gemv.fp8_gemv_argmax_bf16
    monkeypatch.setattr(native_fp8_gemv, "fp8_gemv_argmax_bf16",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    hidden = torch.randn(5, model.config.hidden_size).bfloat16()
    want = model.compute_logits(hidden).argmax(-1)
    assert torch.equal(model.greedy_tokens(hidden), want) and calls == [5]
    monkeypatch.setattr(model, "config", replace(model.config, final_logit_softcap=30.0))
    capped = model.compute_logits(hidden).argmax(-1)
    assert torch.equal(model.greedy_tokens(hidden), capped) and calls == [5]
