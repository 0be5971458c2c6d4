"""What this CPU reaches on its own, measured in the benchmark's own process: memory
bandwidth (a large copy) and matmul throughput (torch's GEMM at a square shape, fp32 and,
where the CPU has it natively, bf16), so that a decode step's time can be set against the
floor those two rates put under it: the weights it reads at the copy's rate, and its
linears' multiply-adds at the best GEMM rate. The larger of the two is the floor; a step
far above it loses time somewhere other than to bytes or arithmetic. Also torch's int8
GEMM (`torch._int_mm`, int8 x int8 -> int32), reported beside them and kept out of the
floor: what a W8A8 int8 recipe's kernel (csrc/int8_gemm_cpu.c) can aim at where the CPU
has int8 dot products (VNNI); without them oneDNN's is far below the fp32 rate, and
inexact (its int16 pair sums saturate), so qserve never calls it to compute.

    rates = measure()                    # a few seconds
    floor = rates.floor(weight_bytes, macs_per_row, rows)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

COPY_BYTES = 256 << 20  # large enough to leave every cache level
GEMM_N = 1024  # [N, N] x [N, N]: compute-bound on every CPU class
INT8_N = 512  # torch._int_mm's square: [1024]^2 takes ~1 s where it is slow


@dataclass(frozen=True)
class StepFloor:
    memory_ms: float  # the weights read once, at the copy's rate
    compute_ms: float  # the linears' multiply-adds at the best GEMM rate

    @property
    def ms(self) -> float:
        return max(self.memory_ms, self.compute_ms)


@dataclass(frozen=True)
class MachineRates:
    copy_gb_s: float  # (bytes read + bytes written) per second of a COPY_BYTES copy / 1e9
    gemm_gflop_s: dict[str, float]  # torch dtype name -> GFLOP/s of an [N, N] matmul
    int8_gop_s: float | None = None  # torch._int_mm at [INT8_N]^2, GOP/s (not in the floor)

    def floor(self, weight_bytes: int, macs_per_row: int, rows: int) -> StepFloor:
        """A step of `rows` rows reading `weight_bytes` of weights, `macs_per_row`
        multiply-adds a row in its linears."""
        return StepFloor(weight_bytes / (self.copy_gb_s * 1e9) * 1e3,
                         2 * macs_per_row * rows / (max(self.gemm_gflop_s.values()) * 1e9) * 1e3)

    def describe(self) -> str:
        gemm = ", ".join(f"{k} {v:.0f}" for k, v in self.gemm_gflop_s.items())
        int8 = ("" if self.int8_gop_s is None else
                f"; int8 (torch._int_mm [{INT8_N}]^2) {self.int8_gop_s:.1f} GOP/s")
        return (f"this CPU: copy {self.copy_gb_s:.1f} GB/s (read + write), GEMM [{GEMM_N}]^2 "
                f"GFLOP/s: {gemm}{int8}")


def _best(run, reps: int) -> float:
    """The fastest of `reps` timed calls of run(), in seconds (after one untimed call)."""
    run()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(reps: int = 5) -> MachineRates:
    src = torch.ones(COPY_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = 2 * COPY_BYTES / _best(lambda: dst.copy_(src), reps) / 1e9
    gemm = {}
    dtypes = [torch.float32] + ([torch.bfloat16] if _native_bf16() else [])
    for dtype in dtypes:
        a = torch.randn(GEMM_N, GEMM_N).to(dtype)
        with torch.inference_mode():
            t = _best(lambda m=a: torch.mm(m, m), reps)
        gemm[str(dtype).removeprefix("torch.")] = 2 * GEMM_N ** 3 / t / 1e9
    return MachineRates(copy, gemm, _int8_rate(reps))


def _int8_rate(reps: int) -> float | None:
    """GOP/s of torch._int_mm at [INT8_N]^2, or None where this torch has no CPU int8 GEMM."""
    a = torch.randint(-127, 128, (INT8_N, INT8_N), dtype=torch.int8)
    try:
        with torch.inference_mode():
            t = _best(lambda: torch._int_mm(a, a), max(1, min(reps, 2)))
    except (RuntimeError, AttributeError):
        return None
    return 2 * INT8_N ** 3 / t / 1e9


def _native_bf16() -> bool:
    from ...kernels.cpu_class import cpu_class, cpu_flags

    return cpu_class(cpu_flags()) in ("amx", "avx512-bf16")  # as capped by QSERVE_CPU_CLASS


def macs_per_row(model: nn.Module) -> int:
    """Multiply-adds one row makes in `model`'s linears (every module with in_features and
    out_features: the decoder's linears and the LM head; an MoE model's experts all
    count, so there it is an upper bound)."""
    return sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(getattr(m, "in_features", None), int)
               and isinstance(getattr(m, "out_features", None), int))
