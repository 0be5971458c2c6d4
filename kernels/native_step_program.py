"""A list of C kernel calls run back to back by one ctypes call (csrc/step_program_cpu.c).

    calls = [Call("rms_norm", (V("v0"), V("t"), 576, 576, w_ptr, 1e-5, 0, V("x"),
                               V("threads")))]
    program = StepProgram.build(calls)            # None where a library cannot build
    program.run({"v0": ptr, "t": 1, "x": ptr, "threads": 2})   # StepFailed on a failing call
    print(program.listing())                      # the calls, one per line

Every argument is a literal (int, float, or None for a null pointer) or a `V`: an integer
affine in one of the step's values (`V("t", 576)` is 576 times the token count,
`V("qkv", add=1152)` a pointer 1152 bytes into the qkv scratch). Values are named at build
and passed per run, so a program is built once per model and its calls cost no Python per
step. `KERNELS` says, per kernel name, which C entry point a call runs and which of its
arguments are floats; the C side restates each signature in a trampoline.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from . import (native_attention, native_bf16_gemv, native_elementwise, native_fp8_gemv,
               native_kv_store, native_norm, native_rotary)
from .native_build import cached_library

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
MAX_ARGS = 24  # csrc/step_program_cpu.c


@dataclass(frozen=True)
class V:
    """An integer argument: the step's value `name` times `mul` plus `add`."""
    name: str
    mul: int = 1
    add: int = 0

    def __str__(self) -> str:
        text = self.name if self.mul == 1 else f"{self.name} * {self.mul}"
        return text if not self.add else f"{text} + {self.add}"


@dataclass(frozen=True)
class Call:
    kernel: str  # a KERNELS key
    args: tuple  # int | float | None | V, in the C function's order
    fails: str | None = None  # for kernels that return a status: what failed, for the error

    def __str__(self) -> str:
        return f"{self.kernel}({', '.join(str(a) for a in self.args)})"


class StepFailed(RuntimeError):
    def __init__(self, call: Call) -> None:
        super().__init__(f"the native {call.fails} kernel could not allocate its buffers.")
        self.call = call


@dataclass(frozen=True)
class Kernel:
    kind: int  # the C OP_* value
    library: object  # () -> ctypes.CDLL | None
    symbol: str
    floats: frozenset[int] = frozenset()  # argument positions passed as C float


KERNELS: dict[str, Kernel] = {
    "fp8_gemv": Kernel(0, native_fp8_gemv._library, "qserve_fp8_gemv_bf16", frozenset({4})),
    "fp8_gemv_wonly": Kernel(1, native_fp8_gemv._library, "qserve_fp8_gemv_wonly_bf16"),
    # the same C signature and op kind, for int8 weight codes (W8A16 int)
    "int8_gemv_wonly": Kernel(1, native_fp8_gemv._library, "qserve_int8_gemv_wonly_bf16"),
    "rms_norm": Kernel(2, native_norm._library, "qserve_rms_norm_bf16", frozenset({5})),
    "rotary": Kernel(3, native_rotary._library, "qserve_rotary_bf16"),
    "store_kv": Kernel(4, native_kv_store._library, "qserve_store_kv"),
    "attention": Kernel(5, native_attention._library, "qserve_paged_attention_cpu",
                        frozenset({17})),
    "add": Kernel(6, native_elementwise._library, "qserve_add_bf16"),
    "add_rows": Kernel(7, native_elementwise._library, "qserve_add_rows_bf16"),
    "act_mul": Kernel(8, native_elementwise._library, "qserve_act_mul_bf16"),
    "round": Kernel(9, native_elementwise._library, "qserve_round_bf16"),
    "bf16_gemv": Kernel(10, native_bf16_gemv._library, "qserve_bf16_gemv"),
    "copy_rows": Kernel(11, native_elementwise._library, "qserve_copy_rows_bf16"),
    "deinterleave_rows": Kernel(12, native_elementwise._library,
                                "qserve_deinterleave_rows_bf16"),
    # latent attention's per-head up-projections, heads spread over the threads
    "bf16_gemv_heads": Kernel(13, native_bf16_gemv._library, "qserve_bf16_gemv_heads"),
}


class _Op(ctypes.Structure):  # csrc/step_program_cpu.c's Op
    _fields_ = [("kind", ctypes.c_int32), ("nargs", ctypes.c_int32), ("fn", _P),
                ("var", ctypes.c_int32 * MAX_ARGS), ("mul", ctypes.c_int64 * MAX_ARGS),
                ("add", ctypes.c_int64 * MAX_ARGS), ("farg", ctypes.c_float * MAX_ARGS)]


_runner = cached_library("step_program_cpu", {
    "qserve_run_step": ([_P, _I64, _I64, _P], ctypes.c_int64),
    "qserve_step_op_nargs": ([ctypes.c_int32], ctypes.c_int32),
})


def _entry(kernel: Kernel) -> int | None:
    lib = kernel.library()
    return None if lib is None else ctypes.cast(getattr(lib, kernel.symbol), _P).value


def _encode(call: Call, kernel: Kernel, fn: int, var_index: dict[str, int]) -> _Op:
    op = _Op(kind=kernel.kind, nargs=len(call.args), fn=fn)
    for j, arg in enumerate(call.args):
        op.var[j] = -1
        if j in kernel.floats:
            if not isinstance(arg, (int, float)):
                raise TypeError(f"{call}: argument {j} must be a float literal, got {arg!r}.")
            op.farg[j] = float(arg)
        elif isinstance(arg, V):
            op.var[j], op.mul[j], op.add[j] = var_index[arg.name], arg.mul, arg.add
        elif arg is None:
            op.add[j] = 0
        elif isinstance(arg, int) and not isinstance(arg, bool):
            op.add[j] = arg
        else:
            raise TypeError(f"{call}: argument {j} must be an int, None or V, got {arg!r}.")
    return op


class StepProgram:
    def __init__(self, calls: list[Call], ops, var_names: tuple[str, ...]) -> None:
        self.calls = calls
        self._ops = ops  # ctypes array of _Op, one per call
        self.var_names = var_names
        self._vars = (ctypes.c_int64 * max(len(var_names), 1))()
        self._index = {name: i for i, name in enumerate(var_names)}

    @classmethod
    def build(cls, calls: list[Call]) -> "StepProgram | None":
        """The calls encoded for the C runner; None where the runner or a kernel's library
        cannot build. TypeError/ValueError for a malformed call."""
        runner = _runner()
        if runner is None:
            return None
        names = sorted({a.name for c in calls for a in c.args if isinstance(a, V)})
        index = {name: i for i, name in enumerate(names)}
        ops = (_Op * max(len(calls), 1))()
        for i, call in enumerate(calls):
            kernel = KERNELS[call.kernel]
            if runner.qserve_step_op_nargs(kernel.kind) != len(call.args):
                raise ValueError(f"{call}: {call.kernel} takes "
                                 f"{runner.qserve_step_op_nargs(kernel.kind)} arguments.")
            fn = _entry(kernel)
            if fn is None:
                return None
            ops[i] = _encode(call, kernel, fn, index)
        return cls(list(calls), ops, tuple(names))

    def run(self, values: dict[str, int], begin: int = 0, end: int | None = None) -> None:
        """Runs calls[begin:end] with the step's values (every name the calls use); raises
        StepFailed for a kernel that returns a failure (the calls after it are not run)."""
        for name, i in self._index.items():
            self._vars[i] = values[name]
        end = len(self.calls) if end is None else end
        failed = _runner().qserve_run_step(ctypes.addressof(self._ops), begin, end, self._vars)
        if failed >= 0:
            raise StepFailed(self.calls[failed])

    def listing(self) -> str:
        return "\n".join(str(c) for c in self.calls) + "\n"


__all__ = ["Call", "KERNELS", "StepFailed", "StepProgram", "V"]
