"""Benchmark: what one call of a C kernel costs by the ways a model could reach it.

    python -m qserve.runtime.benchmark.dispatch [--calls 20000] [--threads 2]

The C decode path (runtime/models/native_decoder.py) reaches its kernels through one
ctypes call per step that runs a step program (kernels/native_step_program.py: the calls
as data, every pointer and size resolved in C); the alternative is the model's own modules calling
the same kernels registered as torch operators (typed schemas, visible to the profiler and
torch.compile). A decode step makes ~11 kernel calls per layer, so the per-call cost of
each route, times the calls of a step, is what choosing between them costs. Each route
here calls the same FP8 linear on a 1 x 32 x 16 problem (its own work is well under a
microsecond), so the times are the route's overhead:

    step program       one ctypes call runs a program of 100 of these calls (per call)
    ctypes             the C function with its arguments already as Python ints / floats
    python wrapper     a Python function that reads the tensors' pointers and shapes, then ctypes
    torch.library      an operator defined with a schema (torch.library.Library, CPU impl)
    custom_op          torch.library.custom_op (schema inferred, with its Python-side checks)

Prints microseconds per call (median of 5 runs) and the extra milliseconds per decode step
of a model with `--layers` layers at `--calls-per-layer` kernel calls each.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Callable

import torch


def _time(fn: Callable[[], None], calls: int, runs: int = 5) -> float:
    """Median seconds per call of `fn` over `runs` runs of `calls` calls."""
    for _ in range(min(calls, 200)):
        fn()
    per_run = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        per_run.append((time.perf_counter() - t) / calls)
    return statistics.median(per_run)


def _kernel():
    from ...kernels import native_fp8_gemv

    lib = native_fp8_gemv._library()
    if lib is None:
        raise SystemExit("the C FP8 linear did not build here (see `qserve env`).")
    return lib.qserve_fp8_gemv_bf16


@functools.cache
def _operators() -> tuple[Callable, Callable, object]:
    """The Python wrapper, the same as a torch.library operator and as a custom_op
    (registered once per process), and the library object that must stay alive."""
    gemv = _kernel()

    def call(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, out: torch.Tensor,
             input_scale: float, threads: int) -> None:
        gemv(x.data_ptr(), x.shape[0], x.shape[1], x.shape[1], input_scale, w.data_ptr(),
             out.shape[1], s.data_ptr(), s.numel(), out.data_ptr(), out.shape[1], threads)

    lib = torch.library.Library("qserve_dispatch_bench", "DEF")
    lib.define("gemv(Tensor x, Tensor w, Tensor s, Tensor(a!) out, float input_scale, "
               "int threads) -> ()")
    lib.impl("gemv", call, "CPU")
    custom = torch.library.custom_op("qserve_dispatch_bench::gemv_custom",
                                     mutates_args=("out",))(call)
    return call, custom, lib


PROGRAM_CALLS = 100  # calls in the step program route's program


def routes(threads: int) -> dict[str, tuple[Callable[[], None], int]]:
    """Each route as a no-argument call of the same tiny FP8 linear, and how many linears
    one call of it runs."""
    from ...kernels.native_step_program import Call, StepProgram, V

    gemv = _kernel()
    call, custom, _ = _operators()
    defined = torch.ops.qserve_dispatch_bench.gemv.default
    k, n = 32, 16
    w = torch.randint(0, 0x7E, (n * k,), dtype=torch.uint8)  # E4M3 bytes, no NaN
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    scale = torch.ones(n)
    out = torch.empty(1, n, dtype=torch.bfloat16)
    args = (x.data_ptr(), 1, k, k, 0.05, w.data_ptr(), n, scale.data_ptr(), n,
            out.data_ptr(), n, threads)
    program = StepProgram.build(
        [Call("fp8_gemv", (V("x"), V("t"), k, k, 0.05, w.data_ptr(), n, scale.data_ptr(), n,
                           V("out"), n, V("threads")))] * PROGRAM_CALLS)
    values = {"x": x.data_ptr(), "t": 1, "out": out.data_ptr(), "threads": threads}
    return {
        "step program": (lambda: program.run(values), PROGRAM_CALLS),
        "ctypes": (lambda: gemv(*args), 1),
        "python wrapper": (lambda: call(x, w, scale, out, 0.05, threads), 1),
        "torch.library": (lambda: defined(x, w, scale, out, 0.05, threads), 1),
        "custom_op": (lambda: custom(x, w, scale, out, 0.05, threads), 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30, help="layers of the model (SmolLM2: 30)")
    ap.add_argument("--calls-per-layer", type=int, default=11)
    args = ap.parse_args(argv)
    if args.calls < 1 or args.threads < 1:
        ap.error("--calls and --threads must be at least 1.")
    torch.set_num_threads(args.threads)
    table = routes(args.threads)
    base = None
    print(f"{args.threads} thread(s); us per call, median of 5 x {args.calls} calls")
    for name, (fn, linears) in table.items():
        per_call = _time(fn, max(args.calls // linears, 1)) / linears
        base = per_call if base is None else base
        extra_ms = (per_call - base) * args.layers * args.calls_per_layer * 1e3
        print(f"  {name:15s} {per_call * 1e6:7.1f} us   +{extra_ms:5.2f} ms per decode step "
              f"({args.layers} layers x {args.calls_per_layer} calls) against the step "
              "program")


if __name__ == "__main__":
    main()
