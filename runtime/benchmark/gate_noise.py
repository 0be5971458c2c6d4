"""How far the eval gates move when nothing is quantized: the bf16 source scored against
itself computed another way (fp32 compute, or another thread count), on the gates' own
tasks and statistics. A gate whose threshold lies within this noise of 1.0 cannot settle
any artifact's verdict (docs/eval-gates.md).

    python -m qserve.runtime.benchmark.gate_noise smollm2-135m --dtype float32 --threads 2

Scores MODEL twice on the default gates' task-gated tasks, once in bf16 (the reference,
as `qserve eval` computes it) and once as --dtype / --candidate-threads say, then
prints each gate's statistic ± standard error and margin as `qserve eval` would, plus
the items whose outcome flipped. Minutes: each side runs every item of those tasks
(about 5.5 minutes a side for generation on 2 AVX2 cores).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ...evals.gates import evaluate_gate, load_gates
from ...evals.report import format_margin
from ...evals.runner import run_tasks
from ...evals.task_configs import load_task_config, task_names
from ..atomic_file import write_json_atomic

RELATIVE_TASKS = ("qserve_generation", "qserve_choice")  # gated against the reference


def _flips(a: dict[int, object], b: dict[int, object]) -> tuple[int, int]:
    """(items right in b only, right in a only) for 0/1 per-item metrics."""
    up = sum(1 for d in a if float(b[d]) > float(a[d]))
    down = sum(1 for d in a if float(b[d]) < float(a[d]))
    return up, down


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a built-in model name or a bf16 checkpoint")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                    help="the candidate's compute dtype (default float32)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the reference")
    ap.add_argument("--candidate-threads", type=int, default=None,
                    help="torch threads for the candidate (default: --threads)")
    ap.add_argument("--tasks", default=",".join(RELATIVE_TASKS),
                    help=f"comma-separated tasks (default {','.join(RELATIVE_TASKS)})")
    ap.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    cand_threads = args.candidate_threads or args.threads
    if args.threads < 1 or cand_threads < 1 or (args.limit is not None and args.limit < 1):
        ap.error("--threads, --candidate-threads and --limit must be at least 1.")
    from ...evals.lm_adapter import QserveLM

    tasks = [t for t in args.tasks.split(",") if t]
    unknown = sorted(set(tasks) - set(task_names()))
    if unknown:
        print(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(task_names())}",
              file=sys.stderr)
        return 2
    gates = [g for g in load_gates().gates if g.task in tasks and g.kind is not None]
    if not gates:
        print(f"no default gate with a threshold reads {', '.join(tasks)}", file=sys.stderr)
        return 2
    configs = [load_task_config(t) for t in tasks]
    sides = {}
    for name, dtype, threads in (("reference", "bfloat16", args.threads),
                                 ("candidate", args.dtype, cand_threads)):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        sides[name] = run_tasks(QserveLM(model=args.model, dtype=dtype), None, configs,
                                args.limit)
        print(f"{name}: {dtype}, {threads} threads, {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    rows = []
    print(f"{args.model}: bf16 ({args.threads} threads) against {args.dtype} "
          f"({cand_threads} threads), nothing quantized\n")
    print("| task | metric | n | reference | candidate | statistic ± se | threshold | "
          "margin / se | right only in candidate / only in reference |")
    print("|---|---|---|---|---|---|---|---|---|")
    for g in gates:
        ref = sides["reference"][g.task][g.metric]
        cand = sides["candidate"][g.task][g.metric]
        r = evaluate_gate(g, cand, ref)
        up, down = _flips(ref, cand)
        rows.append({"task": g.task, "metric": g.metric, "n": r.n, "reference": r.reference,
                     "candidate": r.value, "statistic": r.statistic,
                     "statistic_stderr": r.statistic_stderr, "threshold": g.threshold,
                     "margin_in_stderr": r.margin_in_stderr, "gained": up, "lost": down})
        print(f"| {g.task} | {g.metric} | {r.n} | {r.reference:.4f} | {r.value:.4f} | "
              f"{r.statistic:.4f} ± {r.statistic_stderr:.4f} | {g.kind} {g.threshold} | "
              f"{format_margin(r.margin_in_stderr)} | {up} / {down} |")
    if args.json:
        from ..capabilities import probe

        write_json_atomic(args.json, {"machine": probe().one_line(), "model": args.model,
                                      "dtype": args.dtype, "threads": args.threads,
                                      "candidate_threads": cand_threads, "limit": args.limit,
                                      "gates": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
