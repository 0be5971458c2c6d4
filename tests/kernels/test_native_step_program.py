"""The step program runner (csrc/step_program_cpu.c): its trampolines pass each kernel the
arguments its ctypes signature declares, affine arguments resolve per run, a range of calls
runs alone, and malformed calls or failing kernels give clear errors. The decode path that
runs on it is proven against the module path in tests/runtime/test_native_decoder.py."""

from __future__ import annotations

import ctypes

import pytest
import torch

from qserve.kernels import native_step_program as sp
from qserve.kernels.native_step_program import Call, StepFailed, StepProgram, V

pytestmark = pytest.mark.skipif(sp._runner() is None, reason="no C compiler")


@pytest.mark.parametrize("name", sorted(sp.KERNELS))
def test_each_trampoline_matches_the_kernels_ctypes_signature(name):
    kernel = sp.KERNELS[name]
    lib = kernel.library()
    if lib is None:
        pytest.skip(f"{name}'s library does not build here")
    argtypes = getattr(lib, kernel.symbol).argtypes
    assert sp._runner().qserve_step_op_nargs(kernel.kind) == len(argtypes)
    floats = {j for j, t in enumerate(argtypes) if t is ctypes.c_float}
    assert floats == set(kernel.floats)


def test_affine_arguments_resolve_per_run_and_ranges_run_alone():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g).bfloat16()
    y = torch.randn(4, 8, generator=g).bfloat16()
    rows = torch.randn(8, generator=g).bfloat16()
    # x[1:] += y[1:], then every row of x += rows (the second call over "t" rows)
    program = StepProgram.build([
        Call("add", (V("x", add=8 * 2), V("y", add=8 * 2), V("t", 8, add=-8))),
        Call("add_rows", (V("x"), rows.data_ptr(), V("t"), 8)),
    ])
    values = {"x": x.data_ptr(), "y": y.data_ptr(), "t": 4}
    want = x.clone()
    want[1:] = (want[1:].float() + y[1:].float()).bfloat16()
    program.run(values, 0, 1)  # the first call only
    assert torch.equal(x, want)
    want = (want.float() + rows.float()).bfloat16()
    program.run(values, 1)
    assert torch.equal(x, want)
    assert program.listing().splitlines()[0] == "add(x + 16, y + 16, t * 8 + -8)"


def test_copy_rows_moves_strided_rows_exactly():
    """The RoPE parts of latent attention's queries: columns 5..8 of each 9-wide row
    gathered into contiguous rows, then placed at columns 2..5 of 7-wide rows."""
    g = torch.Generator().manual_seed(1)
    src = torch.randn(6, 9, generator=g).bfloat16()
    mid = torch.zeros(6, 4, dtype=torch.bfloat16)
    dst = torch.full((6, 7), 3.0, dtype=torch.bfloat16)
    program = StepProgram.build([
        Call("copy_rows", (V("src", add=5 * 2), V("t"), 9, 4, V("mid"), 4)),
        Call("copy_rows", (V("mid"), V("t"), 4, 4, V("dst", add=2 * 2), 7)),
    ])
    program.run({"src": src.data_ptr(), "mid": mid.data_ptr(), "dst": dst.data_ptr(), "t": 5})
    assert torch.equal(mid[:5], src[:5, 5:]) and not mid[5].any()  # t = 5 rows only
    want = torch.full((6, 7), 3.0, dtype=torch.bfloat16)
    want[:5, 2:6] = src[:5, 5:]
    assert torch.equal(dst, want)


def test_deinterleave_rows_splits_each_rows_pairs_exactly():
    """DeepSeek's RoPE parts: columns 3..10 of each 11-wide row, their interleaved pairs
    split into [evens | odds] (the halves layout) in contiguous rows."""
    g = torch.Generator().manual_seed(2)
    src = torch.randn(5, 11, generator=g).bfloat16()
    dst = torch.full((5, 8), 7.0, dtype=torch.bfloat16)
    program = StepProgram.build([
        Call("deinterleave_rows", (V("src", add=3 * 2), V("t"), 11, 8, V("dst"), 8)),
    ])
    program.run({"src": src.data_ptr(), "dst": dst.data_ptr(), "t": 4})
    part = src[:4, 3:]
    assert torch.equal(dst[:4], torch.cat((part[:, 0::2], part[:, 1::2]), dim=1))
    assert torch.equal(dst[4], torch.full((8,), 7.0, dtype=torch.bfloat16))  # t = 4 rows


def test_a_failing_kernel_stops_the_program_with_its_name():
    # an input row of 2^50 values: the FP8 GEMV cannot allocate its quantized copy and
    # returns a failure before reading anything; the add after it must not run
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    program = StepProgram.build([
        Call("fp8_gemv", (V("x"), 1, 1 << 50, 1 << 50, 1.0, 0, 16, 0, 1, 0, 16, 1),
             fails="linear"),
        Call("add", (V("x"), V("x"), 16)),
    ])
    with pytest.raises(StepFailed, match="native linear kernel"):
        program.run({"x": x.data_ptr()})
    assert torch.equal(x, torch.ones(2, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("call, error", [
    (Call("add", (V("x"), V("x"))), "add takes 3 arguments"),
    (Call("rms_norm", (0, 1, 8, 8, 0, V("eps"), 0, 0, 1)), "must be a float literal"),
    (Call("add", (V("x"), V("x"), "8")), "must be an int, None or V"),
])
def test_malformed_calls_are_refused_at_build(call, error):
    with pytest.raises((TypeError, ValueError), match=error):
        StepProgram.build([call])
