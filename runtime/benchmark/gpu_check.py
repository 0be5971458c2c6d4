"""GPU check of the Triton kernels: correctness at real sizes, speed against measured
ceilings and torch, and a short generation through the engine on CUDA.

    python -m qserve.runtime.benchmark.gpu_check --out gpu-report          # on a CUDA machine
    python -m qserve.runtime.benchmark.gpu_check --out /tmp/r --interpret-smoke   # CPU dry run

Writes gpu_check.json and gpu_check.md (atomically) to --out. Ceilings are measured in
the same run: device copy bandwidth (a large copy, read + write bytes) and bf16 / FP8
matmul TFLOP/s. Goals reported: decode attention >= 80% of the copy bandwidth at batch
64 / context 4k (FP8 KV); the Triton FP8 GEMM >= 1.0x torch._scaled_mm (below it the
engine keeps torch._scaled_mm, runtime/execution_backend.py); 16-stream decode of the
engine within 20% of vLLM's CUDA build on the same artifact (gpu_check_vllm.py: where
vLLM is importable on the machine; else reported as not installed). Without CUDA it refuses
(exit 2) unless --interpret-smoke, which runs every check on tiny shapes under the
Triton interpreter (times there are meaningless; the point is that the script works).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

GOALS = {"decode_roofline_fraction": 0.80, "gemm_vs_scaled_mm": 1.0,
         "decode_16_streams_vs_vllm": 0.80}
PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "List three prime numbers:", "Explain what a GPU is in one sentence."]


def _cases(smoke: bool):
    """(kernel name, kwargs) in run order; the first decode case is the goal case."""
    bf16 = torch.bfloat16
    if smoke:
        return [("decode", dict(batch=3, ctx=40, hq=4, hkv=2, d=16)),
                ("decode", dict(batch=1, ctx=300, hq=4, hkv=1, d=16, num_splits=3,
                                window=100, softcap=30.0)),
                ("decode", dict(batch=2, ctx=33, hq=6, hkv=2, d=16, fp8=False)),
                ("decode", dict(batch=2, ctx=70, hq=4, hkv=2, d=16, pv_mode="tf32")),
                ("prefill", dict(batch=2, chunk=20, prefix=0, hq=4, hkv=2, d=16)),
                ("prefill", dict(batch=1, chunk=20, prefix=30, hq=4, hkv=1, d=16, window=25)),
                ("store", dict(tokens=40, hkv=2, d=16)),
                ("gemm", dict(m=5, n=24, k=40, bias=True)),
                ("mla_decode", dict(lens=[1, 37, 50], heads=4, rank=32, rope=8, num_splits=2))]
    return [("decode", dict(batch=64, ctx=4096, hq=32, hkv=8, d=128)),  # goal
            ("decode", dict(batch=64, ctx=4096, hq=32, hkv=8, d=128, pv_mode="tf32", sdpa=False)),
            ("decode", dict(batch=64, ctx=4096, hq=32, hkv=8, d=128, fp8=False)),
            ("decode", dict(batch=1, ctx=32768, hq=32, hkv=8, d=128)),  # split-KV
            ("decode", dict(batch=1, ctx=32768, hq=32, hkv=8, d=128, num_splits=1)),
            ("decode", dict(batch=256, ctx=1024, hq=32, hkv=8, d=128)),
            ("decode", dict(batch=16, ctx=8192, hq=8, hkv=1, d=256, softcap=50.0)),
            ("decode", dict(batch=64, ctx=4096, hq=9, hkv=3, d=64)),  # SmolLM2 shapes
            ("decode", dict(batch=32, ctx=16384, hq=16, hkv=8, d=64, window=4096)),
            ("decode", dict(batch=8, ctx=4096, hq=32, hkv=8, d=128, q_dtype=torch.float32)),
            ("prefill", dict(batch=4, chunk=2048, prefix=0, hq=32, hkv=8, d=128)),
            ("prefill", dict(batch=2, chunk=1024, prefix=7168, hq=32, hkv=8, d=128)),
            ("prefill", dict(batch=2, chunk=2048, prefix=0, hq=8, hkv=1, d=256, window=512)),
            ("prefill", dict(batch=4, chunk=1024, prefix=0, hq=9, hkv=3, d=64, q_dtype=bf16)),
            ("store", dict(tokens=8192, hkv=8, d=128)),
            ("gemm", dict(m=1, n=4096, k=4096)), ("gemm", dict(m=16, n=4096, k=4096)),
            ("gemm", dict(m=128, n=14336, k=4096)), ("gemm", dict(m=1024, n=4096, k=14336)),
            ("gemm", dict(m=4096, n=4096, k=4096)), ("gemm", dict(m=4096, n=14336, k=4096)),
            ("gemm", dict(m=8192, n=8192, k=8192, bias=True)),
            # DeepSeek-V3 MLA decode: latent 512 + rope 64, FP8 pool, 16 / 128 heads
            ("mla_decode", dict(lens=[1024, 2047, 3000, 4096], heads=16)),
            ("mla_decode", dict(lens=[1024, 2047, 3000, 4096], heads=128)),
            ("mla_decode", dict(lens=[4096] * 32, heads=128))]


def _ceilings(timer, device, smoke: bool) -> dict:
    n = (1 << 20) if smoke else (1 << 32)  # bytes copied: 4 GiB on the GPU
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = timer(lambda s=src, d=dst: d.copy_(s))
    del src, dst
    size = 256 if smoke else 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16).t()
    ms_mm = timer(lambda: a @ b)
    res = dict(copy_gbps=2 * n / ms / 1e6, bf16_matmul_tflops=2 * size ** 3 / ms_mm / 1e9)
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        ms8 = timer(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                             out_dtype=torch.bfloat16))
        res["fp8_scaled_mm_tflops"] = 2 * size ** 3 / ms8 / 1e9
    except Exception as exc:
        res["fp8_scaled_mm_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return res


def _run_case(cases_mod, timer, device, name, kw) -> dict:
    fn = {"decode": cases_mod.decode_case, "prefill": cases_mod.prefill_case,
          "store": cases_mod.store_case, "gemm": cases_mod.gemm_case,
          "mla_decode": cases_mod.mla_decode_case}[name]
    started = time.perf_counter()
    try:
        res = fn(timer, device, **kw)
    except Exception as exc:  # one failing case must not hide the others
        res = dict(kernel=name, **{k: str(v) for k, v in kw.items()}, ok=False,
                   error=f"{type(exc).__name__}: {exc}"[:500])
    res["wall_s"] = round(time.perf_counter() - started, 2)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def _goals(results: list[dict], ceilings: dict, e2e: dict | None = None,
           vllm: dict | None = None) -> dict:
    dec = next((r for r in results if r["kernel"] == "decode" and "gbps" in r), None)
    gemms = [r["vs_scaled_mm"] for r in results if "vs_scaled_mm" in r]
    out = {}
    if dec is not None:
        frac = dec["gbps"] / ceilings["copy_gbps"]
        shape = [dec[k] for k in ("batch", "ctx", "hq", "hkv", "d", "kv")]
        by_pv = {r["pv"]: r["gbps"] / ceilings["copy_gbps"] for r in results
                 if "gbps" in r and r["kernel"] == "decode"
                 and [r[k] for k in ("batch", "ctx", "hq", "hkv", "d", "kv")] == shape}
        out["decode_roofline_fraction"] = dict(value=frac, goal=GOALS["decode_roofline_fraction"],
                                               met=frac >= GOALS["decode_roofline_fraction"],
                                               pv=dec["pv"], by_pv_mode=by_pv)
    if gemms:
        worst = min(gemms)
        out["gemm_vs_scaled_mm"] = dict(value=worst, all=gemms, goal=GOALS["gemm_vs_scaled_mm"],
                                        met=worst >= GOALS["gemm_vs_scaled_mm"])
    ours = {r["streams"]: r.get("tokens_per_s") for r in (e2e or {}).get("decode", [])}
    theirs = {r["streams"]: r.get("tokens_per_s") for r in (vllm or {}).get("decode", [])}
    if ours.get(16) and theirs.get(16):
        ratio = ours[16] / theirs[16]
        goal = GOALS["decode_16_streams_vs_vllm"]
        out["decode_16_streams_vs_vllm"] = dict(value=ratio, goal=goal, met=ratio >= goal)
    return out


def _markdown(report: dict) -> str:
    lines = [f"# Triton kernel GPU check ({report['mode']})", "",
             f"device: {report['device']}; torch {report['torch']}, triton {report['triton']}",
             "", "## Ceilings (measured in this run)", ""]
    lines += [f"- {k}: {v:.1f}" if isinstance(v, float) else f"- {k}: {v}"
              for k, v in report["ceilings"].items()]
    lines += ["", "## Goals", ""]
    lines += [f"- {k}: {v['value']:.3f} (goal {v['goal']}) -> {'met' if v['met'] else 'NOT met'}"
              for k, v in report["goals"].items()]
    for kind in ("decode", "prefill", "store_kv", "fp8_gemm", "mla_decode"):
        rows = [r for r in report["results"] if r["kernel"] == kind]
        if not rows:
            continue
        keys = sorted({k for r in rows for k in r} - {"kernel"})
        lines += ["", f"## {kind}", "", "| " + " | ".join(keys) + " |",
                  "|" + "---|" * len(keys)]
        for r in rows:
            cells = [f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                     for k in keys]
            lines.append("| " + " | ".join(cells) + " |")
    e2e = report.get("e2e", {})
    lines += ["", "## End to end", "", "```", json.dumps(e2e, indent=1)[:4000], "```", ""]
    lines += ["## vLLM (CUDA build), same artifact", "", "```",
              json.dumps(report.get("vllm", {}), indent=1)[:2000], "```", ""]
    return "\n".join(lines)


def _write(out_dir: Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("gpu_check.json", json.dumps(report, indent=1, default=str)),
                       ("gpu_check.md", _markdown(report))):
        tmp = out_dir / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out_dir / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qserve.runtime.benchmark.gpu_check",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="directory for the JSON + markdown")
    ap.add_argument("--interpret-smoke", action="store_true",
                    help="no GPU: run the checks on tiny shapes under the Triton interpreter")
    ap.add_argument("--model", default="smollm2-135m",
                    help="model or artifact for the end-to-end generation")
    ap.add_argument("--skip-e2e", action="store_true", help="skip the engine generation")
    ap.add_argument("--seed", type=int, default=None,
                    help="random inputs' seed (default: fresh; recorded in the report)")
    args = ap.parse_args(argv)
    smoke = args.interpret_smoke
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first kernel module is imported
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; this check needs a GPU. For a CPU dry run "
              "of the script use --interpret-smoke.", file=sys.stderr)
        return 2
    import triton

    from ...kernels import gpu_check_cases as cases_mod
    from .gpu_check_e2e import run_e2e
    from .gpu_check_vllm import run_vllm

    device = torch.device("cpu" if smoke else "cuda")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    timer = cases_mod.Timer(cuda=not smoke)
    started = time.perf_counter()
    report = dict(mode="interpret-smoke (CPU, times meaningless)" if smoke else "cuda",
                  device=torch.cuda.get_device_name() if not smoke else platform.processor(),
                  torch=torch.__version__, triton=triton.__version__, seed=seed)
    report["ceilings"] = _ceilings(timer, device, smoke)
    print("ceilings:", report["ceilings"], flush=True)
    results = []
    for name, kw in _cases(smoke):
        res = _run_case(cases_mod, timer, device, name, kw)
        print(json.dumps(res, default=str), flush=True)
        results.append(res)
    report["results"] = results
    report["e2e"] = ({"skipped": "--skip-e2e"} if args.skip_e2e
                     else run_e2e(args.model, device, PROMPTS[:2] if smoke else PROMPTS,
                                  max_tokens=4 if smoke else 32,
                                  streams=() if smoke else (1, 16, 64)))
    # the same artifact and decode workload through vLLM's CUDA build, if importable there
    report["vllm"] = ({"skipped": "--interpret-smoke or --skip-e2e"}
                      if smoke or args.skip_e2e
                      else run_vllm(report["e2e"].get("model", args.model), (1, 16, 64)))
    report["goals"] = _goals(results, report["ceilings"], report["e2e"], report["vllm"])
    report["all_correct"] = all(r.get("ok") for r in results)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    _write(args.out, report)
    print(_markdown(report))
    return 0 if report["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
