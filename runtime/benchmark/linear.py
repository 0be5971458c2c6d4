"""Benchmark: the CPU linears of one decode step at SmolLM2-135M shapes, side by side.

    python -m qserve.runtime.benchmark.linear [--threads 2] [--rows 1,2,4,8,16,64,256] [--reps 5]

Per row count (a decode step; from 64 rows, a prompt step): the 120 FP8 linears of 30
layers (fused q/k/v 576->960, o 576->576, gate/up 576->3072, down 1536->576; distinct
weights, so they stream from memory as in a step) through the C FP8 linear (where the
build takes that many rows; W8A8 static, and weight-only W8A16 with E4M3 and with int8
codes), the same 120 as fp32 matmuls of upcast weights and as bf16
matmuls, and the 49152 x 576 bf16 LM head through the C bf16 linear (16 rows a pass),
fp32 and bf16 matmuls. Variants are interleaved round by round so a noisy shared machine
hits all alike; the median over rounds is printed in ms. `qserve env` names the paths
this CPU takes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ...kernels import native_bf16_gemv, native_fp8_gemv
from ...kernels.fp8 import quantize_fp8

LAYERS = 30
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) per layer
VOCAB, HIDDEN = 49152, 576


def _layers():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(LAYERS):
        for k, n in SHAPES:
            w = torch.randn(n, k, generator=g)
            wq = quantize_fp8(w, w.abs().amax(1, keepdim=True) / 448)
            wi = (w / (w.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8)
            out.append((k, native_fp8_gemv.pack_fp8_weight(wq), wq.float(), wq.bfloat16(),
                        torch.full((1, n), 1e-3), native_fp8_gemv.pack_int8_weight(wi)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,64,256")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"FP8 linear path {native_fp8_gemv.path()}, bf16 linear vectorised "
          f"{native_bf16_gemv.vectorized()}, {args.threads} thread(s); median ms of "
          f"{args.reps} rounds")
    layers = _layers()
    head = torch.randn(VOCAB, HIDDEN).bfloat16()
    head_rows, head32 = native_bf16_gemv.pack_bf16_weight(head), head.float()
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
        xf = {k: x.float() for k, x in xs.items()}
        variants = {
            "FP8 linears, C": lambda: [native_fp8_gemv.fp8_gemv_bf16(xs[k], p, 0.01, s)
                                       for k, p, _, _, s, _ in layers],
            "FP8 W8A16, C": lambda: [native_fp8_gemv.fp8_gemv_wonly_bf16(xs[k], p, s)
                                     for k, p, _, _, s, _ in layers],
            "int8 W8A16, C": lambda: [native_fp8_gemv.fp8_gemv_wonly_bf16(xs[k], p8, s)
                                      for k, _, _, _, s, p8 in layers],
            "FP8 linears, fp32 matmul": lambda: [F.linear(xf[k], w)
                                                 for k, _, w, _, _, _ in layers],
            "FP8 linears, bf16 matmul": lambda: [F.linear(xs[k], w)
                                                 for k, _, _, w, _, _ in layers],
            "LM head, C bf16": lambda: native_bf16_gemv.bf16_gemv(xs[576], head_rows),
            "LM head, fp32 matmul": lambda: F.linear(xf[576], head32),
            "LM head, bf16 matmul": lambda: F.linear(xs[576], head),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for fn in variants.values():  # warm up
            fn()
        for _ in range(args.reps):
            for name, fn in variants.items():
                t = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t) * 1e3)
        cells = ", ".join(f"{name} {statistics.median(v):.2f}" for name, v in times.items())
        print(f"rows {m}: {cells}", flush=True)


if __name__ == "__main__":
    main()
