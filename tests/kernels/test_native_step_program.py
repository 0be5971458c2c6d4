"""The step program runner (csrc/step_program_cpu.c): its op numbers are its OP_* enum's,
each trampoline passes its kernel the arguments the kernel's C prototype declares, named
calls are put into the prototype's order, affine arguments resolve per run, a range of
calls runs alone, and malformed calls or failing kernels give clear errors. The decode
path that runs on it is proven against the module path in
tests/runtime/test_native_decoder.py."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from qserve.kernels import c_source
from qserve.kernels import native_step_program as sp
from qserve.kernels.c_source import CSourceError, c_kind, enum_constants, read
from qserve.kernels.native_step_program import Call, StepFailed, StepProgram, V

pytestmark = pytest.mark.skipif(sp._runner() is None, reason="no C compiler")
SOURCE = read("step_program_cpu")


def trampolines(text: str) -> dict[str, tuple[str, list[str], bool]]:
    """csrc/step_program_cpu.c's switch: OP_* name -> (the function type it casts the
    entry point to, the argument expressions it passes, whether it keeps the status)."""
    body = text[text.index("switch (op->kind)"):]
    out = {}
    for case in body.split("break;")[:-1]:
        call = re.search(r"(rc = )?\(\((\w+)\)op->fn\)\(([^;]*)\);", case, re.S)
        for op in re.findall(r"case (OP_\w+):", case):
            out[op] = (call.group(2), [a.strip() for a in call.group(3).split(",")],
                       bool(call.group(1)))
    return out


def function_types(text: str) -> dict[str, tuple[object, list]]:
    """The source's `typedef RET (*NAME)(TYPES);`: NAME -> (return kind, parameter kinds)."""
    return {name: (c_kind(ret), [c_kind(t) for t in " ".join(params.split()).split(",")])
            for ret, name, params in re.findall(r"typedef (\w+) \(\*(\w+)\)\(([^)]*)\);",
                                                text)}


def nargs_table(text: str) -> list[int]:
    """qserve_step_op_nargs's table, indexed by op number."""
    table = re.search(r"nargs\[\] = \{([^}]*)\}", text).group(1)
    return [int(n) for n in table.split(",")]


def check_op_table(text: str) -> None:
    """Every step kernel's op, numbered as `text`'s enum numbers it, has a trampoline that
    casts its entry point to its C prototype's types and passes each argument as its kind
    (P(j) a pointer, a[j] an int64, (int)a[j] an int, f[j] a float, j its position), and
    an entry of the nargs table with its argument count. AssertionError naming the op."""
    ops, cases, types = enum_constants(text, "OP_"), trampolines(text), function_types(text)
    nargs = nargs_table(text)
    spelled = {ctypes.c_void_p: "P({j})", ctypes.c_int64: "a[{j}]", ctypes.c_int: "(int)a[{j}]",
               ctypes.c_float: "f[{j}]"}
    for name, kernel in sp.KERNELS.items():
        signature = kernel.signature
        fn_type, args, keeps_status = cases[kernel.op]
        assert types[fn_type] == (signature.restype, signature.argtypes), (
            f"{kernel.op}: {fn_type} is not {signature}'s type")
        assert args == [spelled[k].format(j=j) for j, k in enumerate(signature.argtypes)], (
            f"{kernel.op}: the trampoline passes ({', '.join(args)}) to {signature}")
        assert keeps_status == (signature.restype is not None), kernel.op
        assert nargs[ops[kernel.op]] == len(signature.params), (
            f"{kernel.op} = {ops[kernel.op]}: the nargs table says {nargs[ops[kernel.op]]}, "
            f"{signature.name} takes {len(signature.params)}")


def test_each_trampoline_passes_its_kernels_prototype():
    check_op_table(SOURCE)


@pytest.mark.parametrize("name", sorted(sp.KERNELS))
def test_the_loaded_runner_agrees_with_each_prototype(name):
    kernel = sp.KERNELS[name]
    assert kernel.kind == enum_constants(SOURCE, "OP_")[kernel.op]
    assert sp._runner().qserve_step_op_nargs(kernel.kind) == len(kernel.signature.params)
    assert kernel.floats == {j for j, p in enumerate(kernel.signature.params)
                             if p.kind is ctypes.c_float}


def test_a_renumbered_op_changes_the_op_table_and_fails_the_check():
    """OP_ADD and OP_ADD_ROWS renumbered in a copy of the source: the op numbers read from
    it follow, and the nargs table (indexed by number) no longer matches."""
    renumbered = SOURCE.replace("OP_ADD = 6,", "OP_ADD = 7,").replace("OP_ADD_ROWS = 7,",
                                                                      "OP_ADD_ROWS = 6,")
    ops = enum_constants(renumbered, "OP_")
    assert (ops["OP_ADD"], ops["OP_ADD_ROWS"]) == (7, 6)
    assert (sp.OPS["OP_ADD"], sp.OPS["OP_ADD_ROWS"]) == (6, 7)  # this build's
    with pytest.raises(AssertionError, match="OP_ADD = 7: the nargs table says 4"):
        check_op_table(renumbered)
    without = dict(sp.OPS)
    del without["OP_ROUND"]
    with pytest.raises(CSourceError, match="round: csrc/step_program_cpu.c has no OP_ROUND"):
        sp.check_kernels(sp.KERNELS, without)


def test_a_trampoline_with_swapped_arguments_fails_the_check():
    swapped = SOURCE.replace("((add_rows_fn)op->fn)(P(0), P(1), a[2], a[3]);",
                             "((add_rows_fn)op->fn)(P(0), P(1), a[3], a[2]);")
    assert swapped != SOURCE
    with pytest.raises(AssertionError, match="OP_ADD_ROWS: the trampoline passes"):
        check_op_table(swapped)


def test_named_calls_follow_the_prototypes_order(monkeypatch):
    """rms_norm's `rows` and `stride` (both int64_t) swapped in a copy of its source: the
    same named call puts the two values in the swapped places."""
    args = dict(x=V("x"), rows=V("t"), stride=576, dim=576, w=0, eps=1e-5, kind=0,
                out=V("y"), num_threads=V("threads"))
    here = Call.named("rms_norm", **args)
    assert here.args == (V("x"), V("t"), 576, 576, 0, 1e-5, 0, V("y"), V("threads"))
    text = read("rms_norm_cpu").replace("int64_t rows, int64_t stride,",
                                        "int64_t stride, int64_t rows,")
    assert text != read("rms_norm_cpu")
    changed = c_source.signatures(text)
    monkeypatch.setattr(sp, "library_signatures", lambda library: changed)
    assert Call.named("rms_norm", **args).args == (V("x"), 576, V("t"), 576, 0, 1e-5, 0,
                                                   V("y"), V("threads"))


@pytest.mark.parametrize("args, error", [
    (dict(x=V("x"), y=V("y"), count=8), r"qserve_add_bf16 has no parameter 'count'"),
    (dict(x=V("x"), y=V("y")), r"qserve_add_bf16: missing 'n'"),
])
def test_a_named_call_with_a_wrong_name_is_refused(args, error):
    with pytest.raises(TypeError, match=error):
        Call.named("add", **args)


def test_affine_arguments_resolve_per_run_and_ranges_run_alone():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g).bfloat16()
    y = torch.randn(4, 8, generator=g).bfloat16()
    rows = torch.randn(8, generator=g).bfloat16()
    # x[1:] += y[1:], then every row of x += rows (the second call over "t" rows)
    program = StepProgram.build([
        Call.named("add", x=V("x", add=8 * 2), y=V("y", add=8 * 2), n=V("t", 8, add=-8)),
        Call.named("add_rows", x=V("x"), b=rows.data_ptr(), rows=V("t"), n=8),
    ])
    values = {"x": x.data_ptr(), "y": y.data_ptr(), "t": 4}
    want = x.clone()
    want[1:] = (want[1:].float() + y[1:].float()).bfloat16()
    program.run(values, 0, 1)  # the first call only
    assert torch.equal(x, want)
    want = (want.float() + rows.float()).bfloat16()
    program.run(values, 1)
    assert torch.equal(x, want)
    assert program.listing().splitlines()[0] == "add(x=x + 16, y=y + 16, n=t * 8 + -8)"


def test_copy_rows_moves_strided_rows_exactly():
    """The RoPE parts of latent attention's queries: columns 5..8 of each 9-wide row
    gathered into contiguous rows, then placed at columns 2..5 of 7-wide rows."""
    g = torch.Generator().manual_seed(1)
    src = torch.randn(6, 9, generator=g).bfloat16()
    mid = torch.zeros(6, 4, dtype=torch.bfloat16)
    dst = torch.full((6, 7), 3.0, dtype=torch.bfloat16)
    program = StepProgram.build([
        Call.named("copy_rows", src=V("src", add=5 * 2), rows=V("t"), src_stride=9, width=4,
                   dst=V("mid"), dst_stride=4),
        Call.named("copy_rows", src=V("mid"), rows=V("t"), src_stride=4, width=4,
                   dst=V("dst", add=2 * 2), dst_stride=7),
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
        Call.named("deinterleave_rows", src=V("src", add=3 * 2), rows=V("t"), src_stride=11,
                   width=8, dst=V("dst"), dst_stride=8),
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
        Call.named("fp8_gemv", fails="linear", x=V("x"), m=1, k=1 << 50, x_stride=1 << 50,
                   input_scale=1.0, packed=0, n=16, scale=0, scale_len=1, out=0, out_stride=16,
                   num_threads=1),
        Call.named("add", x=V("x"), y=V("x"), n=16),
    ])
    with pytest.raises(StepFailed, match="native linear kernel"):
        program.run({"x": x.data_ptr()})
    assert torch.equal(x, torch.ones(2, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("call, error", [
    (Call("add", (V("x"), V("x"))), r"add takes 3 arguments \(x, y, n\)"),
    (Call("rms_norm", (0, 1, 8, 8, 0, V("eps"), 0, 0, 1)), "eps must be a float literal"),
    (Call("add", (V("x"), V("x"), "8")), "n must be an int or V"),
    (Call("add", (V("x"), 1.5, 8)), "y must be an int, None or V, got 1.5"),
    (Call("add", (V("x"), V("x"), None)), "n must be an int or V, got None"),
    (Call("gemv", (V("x"),)), "no kernel 'gemv'"),
])
def test_malformed_calls_are_refused_at_build(call, error):
    with pytest.raises((TypeError, ValueError), match=error):
        StepProgram.build([call])
