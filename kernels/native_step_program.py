"""A list of C kernel calls run back to back by one ctypes call (csrc/step_program_cpu.c).

    calls = [Call.named("rms_norm", x=V("v0"), rows=V("t"), stride=576, dim=576, w=w_ptr,
                        eps=1e-5, kind=0, out=V("x"), num_threads=V("threads"))]
    program = StepProgram.build(calls)            # None where a library cannot build
    program.run({"v0": ptr, "t": 1, "x": ptr, "threads": 2})   # StepFailed on a failing call
    print(program.listing())                      # the calls, one per line

Every argument is a literal (int, float, or None for a null pointer) or a `V`: an integer
affine in one of the step's values (`V("t", 576)` is 576 times the token count,
`V("qkv", add=1152)` a pointer 1152 bytes into the qkv scratch). Values are named at build
and passed per run, so a program is built once per model and its calls cost no Python per
step. `KERNELS` says, per kernel name, which C op runs a call and which entry point it
calls; everything else comes from the C sources (c_source.py): the op numbers from
step_program_cpu.c's OP_* enum, the arguments' names, order and kinds (which are C floats)
from the entry point's prototype. `Call.named` puts arguments named as the prototype names
its parameters into its order when the call is made (once per program build).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

from .c_source import CSourceError, Signature, define, enum_constants, library_signatures, read
from .native_build import cached_library

_P = ctypes.c_void_p
_SOURCE = read("step_program_cpu")
OPS: dict[str, int] = enum_constants(_SOURCE, "OP_")  # the C op numbers by name
MAX_ARGS = define(_SOURCE, "MAX_ARGS")


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

    @classmethod
    def named(cls, kernel: str, /, fails: str | None = None, **args: Any) -> "Call":
        """A call with every argument named as the kernel's C prototype names it, put in
        its order; TypeError naming an unknown or a missing parameter."""
        if kernel not in KERNELS:
            raise ValueError(f"no kernel {kernel!r}; the step program runs "
                             f"{', '.join(sorted(KERNELS))}.")
        return cls(kernel, KERNELS[kernel].signature.order(args), fails)

    def __str__(self) -> str:  # the arguments named where they match the prototype
        kernel = KERNELS.get(self.kernel)
        names = kernel.signature.names if kernel is not None else ()
        if len(names) == len(self.args):
            args = [f"{n}={a}" for n, a in zip(names, self.args)]
        else:
            args = [str(a) for a in self.args]
        return f"{self.kernel}({', '.join(args)})"


class StepFailed(RuntimeError):
    def __init__(self, call: Call) -> None:
        super().__init__(f"the native {call.fails} kernel could not allocate its buffers.")
        self.call = call


@dataclass(frozen=True)
class Kernel:
    op: str  # the C OP_* constant whose trampoline calls it (OPS gives its number)
    library: str  # the csrc library that exports it
    symbol: str  # its entry point

    @property
    def kind(self) -> int:
        return OPS[self.op]

    @property
    def signature(self) -> Signature:
        return library_signatures(self.library)[self.symbol]

    @property
    def floats(self) -> frozenset[int]:
        """The argument positions passed as C floats (the op's `farg`)."""
        return frozenset(j for j, p in enumerate(self.signature.params)
                         if p.kind is ctypes.c_float)


KERNELS: dict[str, Kernel] = {
    "fp8_gemv": Kernel("OP_FP8_GEMV", "fp8_gemv_cpu", "qserve_fp8_gemv_bf16"),
    "fp8_gemv_wonly": Kernel("OP_FP8_GEMV_WONLY", "fp8_gemv_cpu", "qserve_fp8_gemv_wonly_bf16"),
    # the same C signature and op, for int8 weight codes (W8A16 int)
    "int8_gemv_wonly": Kernel("OP_FP8_GEMV_WONLY", "fp8_gemv_cpu",
                              "qserve_int8_gemv_wonly_bf16"),
    # the same C signature and op again: W8A8 int8 (int8 inputs per row, int32 sums)
    "int8_gemm": Kernel("OP_FP8_GEMV_WONLY", "int8_gemm_cpu", "qserve_int8_gemm_bf16"),
    "rms_norm": Kernel("OP_RMS_NORM", "rms_norm_cpu", "qserve_rms_norm_bf16"),
    "rotary": Kernel("OP_ROTARY", "rotary_cpu", "qserve_rotary_bf16"),
    "store_kv": Kernel("OP_STORE_KV", "kv_store_cpu", "qserve_store_kv"),
    "attention": Kernel("OP_ATTENTION", "paged_attention_cpu", "qserve_paged_attention_cpu"),
    "add": Kernel("OP_ADD", "elementwise_cpu", "qserve_add_bf16"),
    "add_rows": Kernel("OP_ADD_ROWS", "elementwise_cpu", "qserve_add_rows_bf16"),
    "act_mul": Kernel("OP_ACT_MUL", "elementwise_cpu", "qserve_act_mul_bf16"),
    "round": Kernel("OP_ROUND", "elementwise_cpu", "qserve_round_bf16"),
    "bf16_gemv": Kernel("OP_BF16_GEMV", "bf16_gemv_cpu", "qserve_bf16_gemv"),
    "copy_rows": Kernel("OP_COPY_ROWS", "elementwise_cpu", "qserve_copy_rows_bf16"),
    "deinterleave_rows": Kernel("OP_DEINTERLEAVE_ROWS", "elementwise_cpu",
                                "qserve_deinterleave_rows_bf16"),
    # latent attention's per-head up-projections, heads spread over the threads
    "bf16_gemv_heads": Kernel("OP_BF16_GEMV_HEADS", "bf16_gemv_cpu", "qserve_bf16_gemv_heads"),
}


def check_kernels(kernels: dict[str, Kernel], ops: dict[str, int]) -> None:
    """Every kernel's op is one of `ops` and its entry point is exported by its library's
    source, with at most MAX_ARGS parameters; CSourceError naming the first that is not."""
    for name, kernel in kernels.items():
        if kernel.op not in ops:
            raise CSourceError(f"step kernel {name}: csrc/step_program_cpu.c has no {kernel.op}.")
        if kernel.symbol not in library_signatures(kernel.library):
            raise CSourceError(f"step kernel {name}: csrc/{kernel.library}.c exports no "
                               f"{kernel.symbol}.")
        if len(kernel.signature.params) > MAX_ARGS:
            raise CSourceError(f"step kernel {name}: {kernel.symbol} takes more than "
                               f"MAX_ARGS = {MAX_ARGS} arguments.")
        if "fails" in kernel.signature.names:  # Call.named's own keyword
            raise CSourceError(f"step kernel {name}: {kernel.symbol} has a parameter named "
                               f"'fails'; rename it.")


check_kernels(KERNELS, OPS)


class _Op(ctypes.Structure):  # csrc/step_program_cpu.c's Op
    _fields_ = [("kind", ctypes.c_int32), ("nargs", ctypes.c_int32), ("fn", _P),
                ("var", ctypes.c_int32 * MAX_ARGS), ("mul", ctypes.c_int64 * MAX_ARGS),
                ("add", ctypes.c_int64 * MAX_ARGS), ("farg", ctypes.c_float * MAX_ARGS)]


_runner = cached_library("step_program_cpu")


def _entry(kernel: Kernel) -> int | None:
    lib = cached_library(kernel.library)()
    return None if lib is None else ctypes.cast(getattr(lib, kernel.symbol), _P).value


@functools.cache
def _check_trampoline(runner: ctypes.CDLL, name: str) -> None:
    """The C trampoline of the kernel's op takes as many arguments as its entry point
    (asked once per loaded runner)."""
    kernel = KERNELS[name]
    nargs = runner.qserve_step_op_nargs(kernel.kind)
    if nargs != len(kernel.signature.params):
        raise CSourceError(f"csrc/step_program_cpu.c: {kernel.op} = {kernel.kind} passes "
                           f"{nargs} arguments, {kernel.signature} takes "
                           f"{len(kernel.signature.params)}.")


def _encode(call: Call, kernel: Kernel, fn: int, var_index: dict[str, int]) -> _Op:
    op = _Op(kind=kernel.kind, nargs=len(call.args), fn=fn)
    for j, (arg, param) in enumerate(zip(call.args, kernel.signature.params)):
        op.var[j] = -1
        if param.kind is ctypes.c_float:
            if not isinstance(arg, (int, float)) or isinstance(arg, bool):
                raise TypeError(f"{call}: {param.name} must be a float literal, got {arg!r}.")
            op.farg[j] = float(arg)
        elif isinstance(arg, V):
            op.var[j], op.mul[j], op.add[j] = var_index[arg.name], arg.mul, arg.add
        elif arg is None and param.is_pointer:
            op.add[j] = 0
        elif isinstance(arg, int) and not isinstance(arg, bool):
            op.add[j] = arg
        else:
            raise TypeError(f"{call}: {param.name} must be an int"
                            f"{', None' if param.is_pointer else ''} or V, got {arg!r}.")
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
            if call.kernel not in KERNELS:
                raise ValueError(f"{call}: no kernel {call.kernel!r}.")
            kernel = KERNELS[call.kernel]
            _check_trampoline(runner, call.kernel)
            if len(kernel.signature.params) != len(call.args):
                raise ValueError(f"{call}: {call.kernel} takes "
                                 f"{len(kernel.signature.params)} arguments "
                                 f"({', '.join(kernel.signature.names)}).")
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


__all__ = ["Call", "KERNELS", "Kernel", "MAX_ARGS", "OPS", "StepFailed", "StepProgram", "V",
           "check_kernels"]
