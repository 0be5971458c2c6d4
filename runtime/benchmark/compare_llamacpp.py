"""qserve against llama.cpp's own server on the same model, same threads, same prompts.

    python -m qserve.runtime.benchmark.compare_llamacpp [--model smollm2-135m] [--threads 2]
        [--out docs/bench-llamacpp.md] [--no-profile] [--from-reports DIR] [--add-variants DIR]
        [--draft-artifact DIR] [--cases stream1,streams16,...] [--rounds N]
        [--recipe builtin|default|FILE]

Builds `llama-server` once from the llama-cpp-python sdist (see llamacpp_build), then runs
it and `qserve serve` one after the other on the built-in model's GGUF (qserve serves
its FP8 artifact quantized from that GGUF), with the same thread count and the same
prompts (same tokenizer, same seeds), and writes a markdown table of ratios. `--recipe`
chooses the artifact qserve serves: the model's built-in one (what `qserve serve MODEL`
serves, the default), or one quantized here with the default recipe (all FP8: W8A8, FP8
KV cache) or a recipe file, kept in the cache. qserve is
profiled with py-spy during its 16-stream run. Each bench report (JSON) is kept in the
cache directory under bench/. `--rounds N` runs the two servers N times, alternating, and
the page shows medians over the rounds and the median of the per-round ratios: on a shared
machine whose speed drifts over minutes, one round of each can be off by 30%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from qserve.kernels.cache import cache_root
from qserve.runtime.formats.sources import BUILTIN_MODELS, DEFAULT_MODEL, resolve_source
from qserve.kernels import cpu_class
from qserve.kernels.cpu_class import cpuinfo_field, read_cpuinfo
from qserve.runtime.capabilities import cpu_flags, parse_cpu_flags

from ..atomic_file import write_json_atomic
from .compare_report import (HIDDEN_SPEC_ARGS, HIDDEN_SPEC_LABEL, NO_REUSE_LABEL, PREFILL_CAP,
                             PREFILL_CAP_LABEL, PROFILED_CASE, SPEC_ARGS, SPEC_LABEL, CaseResult,
                             kv_budget_rows, write_markdown)
from .errors import BenchmarkError
from .metrics import BenchmarkMetrics
from .llamacpp_build import cmake_flags, ensure_llama_server, find_llama_server
from .profiler import PySpy, summarize
from .prompt_tokenizer import LocalTokenizer
from .runner import BenchConfig, run_benchmark
from .server_process import ServerProcess, free_port
from .workloads import WorkloadParams


@dataclass(frozen=True)
class CompareCase:
    key: str
    title: str
    workload: str
    params: WorkloadParams
    concurrency: int


CASES = [
    CompareCase("streams16", "16 concurrent streams (random, 128 in / 128 out, 16 requests)",
                "random", WorkloadParams(num_prompts=16, input_len=128, output_len=128), 16),
    CompareCase("stream1", "1 stream (random, 128 in / 128 out, 6 requests)",
                "random", WorkloadParams(num_prompts=6, input_len=128, output_len=128, seed=5),
                1),
    CompareCase("shared", "shared prefix: 16 users, one 2,000-token document + own 32-token "
                "question, 32 out", "shared-prefix",
                WorkloadParams(num_prompts=16, prefix_len=2000, question_len=32,
                               output_len=32), 16),
    CompareCase("distinct", "no reuse possible: 16 different ~2,040-token documents, 32 out",
                "random", WorkloadParams(num_prompts=16, input_len=2040, output_len=32,
                                         seed=1), 16),
    CompareCase("mixed", "mixed at concurrency 8: 24 requests, 75% 64 in / 64 out, 25% "
                "1,024 in / 32 out", "mixed",
                WorkloadParams(num_prompts=24, input_len=64, output_len=64, long_fraction=0.25,
                               long_input_len=1024, long_output_len=32, seed=2), 8),
]
MACHINE_FILE = "machine.json"  # in a report folder: the CPU it was measured on, llama.cpp's build


@dataclass(frozen=True)
class QserveVariant:
    """qserve alone with other serve options on some cases (results label = file prefix)."""
    label: str
    args: tuple[str, ...]
    cases: tuple[str, ...]
    model: str | None = None  # what it serves (None: the compared model's artifact)


VARIANTS = (
    # prefix caching off: the shared-prefix case again, for the reuse ratio
    QserveVariant(NO_REUSE_LABEL, ("--no-enable-prefix-caching",), ("shared",)),
    # prompt tokens capped in steps that decode: the mixed case again, for ITL p99 / p50
    QserveVariant(PREFILL_CAP_LABEL, ("--max-prefill-tokens-with-decodes", str(PREFILL_CAP)),
                  ("mixed",)),
    # n-gram speculation: the one-stream case again, against llama.cpp's single stream
    QserveVariant(SPEC_LABEL, SPEC_ARGS, ("stream1",)),
)


def cpu_description() -> str | None:
    """"MODEL NAME, N cores, AVX-512 (BF16), AMX" from /proc/cpuinfo (None elsewhere): what
    the kernels and llama.cpp's build can use on the machine a page section comes from."""
    info = read_cpuinfo()
    if not info:
        return None
    flags = parse_cpu_flags(info)
    isa = ("AVX-512" + (" (BF16)" if "avx512_bf16" in flags else "")
           if "avx512f" in flags else "no AVX-512")
    amx = "AMX" if "amx_bf16" in flags else "no AMX"
    name = cpuinfo_field(info, ("model name",)) or "unknown CPU"
    klass = cpu_class.cap()  # both servers then run as that class (kernels/cpu_class.py)
    run_as = f", run as {klass} by {cpu_class.ENV_VAR}" if klass else ""
    return f"{name}, {os.cpu_count()} cores, {isa}, {amx}{run_as}"


def case_keys(text: str | None) -> tuple[str, ...] | None:
    """--cases: comma-separated CASES keys (None: all); BenchmarkError for unknown ones."""
    if not text:
        return None
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    known = [c.key for c in CASES]
    bad = [k for k in keys if k not in known]
    if bad or not keys:
        raise BenchmarkError(f"--cases {text!r}: unknown case {', '.join(bad) or '(none)'}; "
                             f"choose from {', '.join(known)}.")
    return keys


def llama_server_cmd(binary: Path, gguf: Path, port: int | str, threads: int) -> list[str]:
    # 16 slots, each with room for the 2,000-token shared-prefix requests
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads), "--parallel", "16",
            "--ctx-size", str(16 * 2304)]


def qserve_cmd(model: str, port: int | str, threads: int,
               extra: tuple[str, ...] = ()) -> list[str]:
    # speed only: the eval gates (quality) are not this benchmark's business
    return [sys.executable, "-m", "qserve.runtime.cli", "serve", model, "--host", "127.0.0.1",
            "--port", str(port), "--threads", str(threads), "--allow-ungated",
            "--log-level", "warning", *extra]


def served_artifact(model: str, recipe: str) -> str:
    """What qserve serves for --recipe: the model (its built-in artifact) for "builtin",
    else an artifact quantized with the default recipe ("default") or the recipe file, in
    the cache under bench/artifacts (made once per recipe)."""
    if recipe == "builtin":
        return model
    from qserve.quantize.builtin_artifact import made_with
    from qserve.quantize.pipeline import quantize
    from qserve.quantize.recipe import Recipe, RecipeError, load_recipe

    try:
        r = Recipe() if recipe == "default" else load_recipe(recipe)
    except RecipeError as e:
        raise BenchmarkError(f"--recipe {recipe}: {e}") from None
    name = "default" if recipe == "default" else Path(recipe).stem
    path = cache_root() / "bench" / "artifacts" / f"{model}-{name}"
    if not made_with(path, r):
        print(f"quantizing {model} with the {name} recipe into {path}", file=sys.stderr)
        quantize(model, path, r, force=True)
    return str(path)


def round_suffix(rnd: int) -> str:
    """What a round adds to its reports' and logs' file names (round 1 keeps plain names)."""
    return "" if rnd == 1 else f".r{rnd}"


def report_name(label: str, case: str, rnd: int = 1) -> str:
    """A bench report's file name in a report folder."""
    return f"{label}-{case}{round_suffix(rnd)}.json"


def run_cases(server: ServerProcess, label: str, tok, out_dir: Path, profile: bool,
              keys: tuple[str, ...] | None = None,
              rnd: int = 1) -> tuple[dict[str, CaseResult], list | None]:
    results, spots = {}, None
    for case in [c for c in CASES if keys is None or c.key in keys]:
        print(f"[{label}] {case.title}", file=sys.stderr)
        # llama.cpp sends nothing while a slot waits for its prompt: allow long silences
        cfg = BenchConfig(server.base, case.workload, case.params, (case.concurrency,),
                          progress=sys.stderr.isatty(), request_timeout=3600.0)
        raw = out_dir / f"profile-{label}.txt"
        if profile and case.key == PROFILED_CASE:
            with PySpy(server.pid, raw):
                report = run_benchmark(cfg, tokenizer=tok)
            spots = summarize(raw.read_text())
        else:
            report = run_benchmark(cfg, tokenizer=tok)
        write_json_atomic(out_dir / report_name(label, case.key, rnd), report.to_dict())
        m = report.runs[0].metrics
        if m.failed or m.completed != case.params.num_prompts:
            raise BenchmarkError(f"[{label}] {case.key}: {m.completed} completed, {m.failed} "
                                 f"failed: {m.errors}")
        if m.total_output_tokens != m.expected_output_tokens:
            raise BenchmarkError(f"[{label}] {case.key}: {m.total_output_tokens} output tokens,"
                                 f" expected {m.expected_output_tokens} (ignore_eos ignored?)")
        results[case.key] = CaseResult(case.title, m)
    return results, spots


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(BUILTIN_MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/bench-llamacpp.md")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--build-jobs", type=int, default=2)
    ap.add_argument("--from-reports", default=None, metavar="DIR",
                    help="Only rewrite the page from the bench reports kept in DIR.")
    ap.add_argument("--add-variants", default=None, metavar="DIR",
                    help="Only run qserve's variant runs (prefix caching off on the "
                         "shared-prefix case, the prefill cap on the mixed case, n-gram "
                         "speculation on the one-stream case) into the reports kept in DIR, "
                         "then rewrite the page.")
    ap.add_argument("--draft-artifact", default=None, metavar="DIR",
                    help="Also serve this artifact (the same model, quantized with `--draft "
                         "hidden_draft`) with its hidden-state draft on the one-stream case.")
    ap.add_argument("--recipe", default="builtin", metavar="builtin|default|FILE",
                    help="What qserve serves: the model's built-in artifact (default), or "
                         "the model quantized with the default recipe (all FP8) or this "
                         "recipe file.")
    ap.add_argument("--rounds", type=int, default=1,
                    help="Run llama.cpp and qserve this many times, alternating (medians).")
    ap.add_argument("--cases", default=None, metavar="KEYS",
                    help="Only these workloads, comma-separated (default: all): "
                         + ", ".join(c.key for c in CASES) + ".")
    args = ap.parse_args(argv)
    try:
        if args.rounds < 1:
            raise BenchmarkError(f"--rounds {args.rounds}: give 1 or more.")
        args.case_keys = case_keys(args.cases)
        if Path(args.out).is_dir():  # checked before the servers run, not after
            raise BenchmarkError(f"--out {args.out} is a folder; give the markdown file the "
                                 "page is written to (default docs/bench-llamacpp.md).")
        if args.draft_artifact and not (Path(args.draft_artifact) / "qserve.json").is_file():
            raise BenchmarkError(f"--draft-artifact {args.draft_artifact}: not an artifact "
                                 "folder (no qserve.json); make one with `qserve quantize "
                                 f"{args.model} --out DIR --draft hidden_draft`.")
        args.served = args.model if args.from_reports else served_artifact(args.model,
                                                                             args.recipe)
        if args.from_reports:
            render(Path(args.from_reports), args)
        elif args.add_variants:
            out_dir = Path(args.add_variants)
            if not out_dir.is_dir():
                raise BenchmarkError(f"{out_dir} is not a folder of bench reports; pass the "
                                     "folder an earlier run of this command wrote (printed "
                                     "at its end).")
            _run_variants(args, out_dir, LocalTokenizer(args.model))
            render(out_dir, args)
        else:
            render(_compare(args), args)
    except BenchmarkError as e:
        sys.exit(f"error: {e}")


def _compare(args) -> Path:
    """Run both servers; returns the folder of bench reports."""
    build = ensure_llama_server(args.build_jobs)
    gguf = BUILTIN_MODELS[args.model].locate()
    tok = LocalTokenizer(args.model)  # the same prompts for both servers
    stamp = datetime.datetime.now(datetime.timezone.utc)
    out_dir = cache_root() / "bench" / f"{args.model}-{stamp:%Y%m%dT%H%M%S}"
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / MACHINE_FILE, {
        "cpu": cpu_description(), "recipe": args.recipe,
        "llama_cpp": {"version": build.version, "cmake_flags": list(build.cmake_flags)}})
    for rnd in range(1, args.rounds + 1):
        suffix = round_suffix(rnd)
        port = free_port()
        with ServerProcess("llama-server",
                           llama_server_cmd(build.binary, gguf, port, args.threads), port,
                           out_dir / f"llama-server{suffix}.log") as server:
            run_cases(server, "llama.cpp", tok, out_dir, False, args.case_keys, rnd)
        port = free_port()
        with ServerProcess("qserve serve", qserve_cmd(args.served, port, args.threads), port,
                           out_dir / f"qserve{suffix}.log",
                           env={"OMP_NUM_THREADS": str(args.threads)},
                           startup_timeout=1800) as server:
            run_cases(server, "qserve", tok, out_dir, args.profile and rnd == 1,
                      args.case_keys, rnd)
    _run_variants(args, out_dir, tok)
    return out_dir


def _run_variants(args, out_dir: Path, tok) -> None:
    variants = list(VARIANTS)
    if args.draft_artifact:  # the one-stream case again, with the artifact's hidden-state draft
        variants.append(QserveVariant(HIDDEN_SPEC_LABEL, HIDDEN_SPEC_ARGS, ("stream1",),
                                      args.draft_artifact))
    for v in variants:
        cases = tuple(c for c in v.cases if args.case_keys is None or c in args.case_keys)
        if not cases:
            continue
        port = free_port()
        with ServerProcess("qserve serve",
                           qserve_cmd(v.model or args.served, port, args.threads, v.args),
                           port, out_dir / f"{v.label}.log",
                           env={"OMP_NUM_THREADS": str(args.threads)},
                           startup_timeout=1800) as server:
            run_cases(server, v.label, tok, out_dir, False, cases)


def load_results(out_dir: Path, rnd: int = 1) -> dict[str, dict[str, CaseResult]]:
    """Complete runs (every request answered) of each server and case found in out_dir, in
    round `rnd`."""
    results: dict[str, dict[str, CaseResult]] = {"llama.cpp": {}, "qserve": {},
                                                 **{v.label: {} for v in VARIANTS},
                                                 HIDDEN_SPEC_LABEL: {}}
    for case in CASES:
        for label in results:
            path = out_dir / report_name(label, case.key, rnd)
            if not path.is_file():
                continue
            m = BenchmarkMetrics.from_dict(json.loads(path.read_text())["runs"][0]["metrics"])
            if m.completed == case.params.num_prompts and not m.failed:
                results[label][case.key] = CaseResult(case.title, m)
    return results


def load_rounds(out_dir: Path) -> list[dict[str, dict[str, CaseResult]]]:
    """load_results of every round found in out_dir, round 1 first."""
    rounds, rnd = [load_results(out_dir)], 2
    while any(out_dir.glob(f"qserve-*{round_suffix(rnd)}.json")):
        rounds.append(load_results(out_dir, rnd))
        rnd += 1
    return rounds


def render(out_dir: Path, args) -> None:
    rounds = load_rounds(out_dir)
    results = rounds[0]
    if not results["qserve"] or not results["llama.cpp"]:
        raise BenchmarkError(f"{out_dir}: no complete bench reports of both servers")
    dates = [json.loads(p.read_text())["date"] for p in out_dir.glob("*-*.json")]
    stamp = datetime.datetime.fromisoformat(min(dates))
    raw = out_dir / "profile-qserve.txt"
    spots = summarize(raw.read_text()) if raw.is_file() else None
    config = json.loads((resolve_source(args.model).checkpoint_dir / "config.json").read_text())
    gguf = BUILTIN_MODELS[args.model].locate()
    machine = out_dir / MACHINE_FILE  # absent in report folders of earlier versions
    recorded = json.loads(machine.read_text()) if machine.is_file() else {}
    cpu = recorded.get("cpu")
    llama = recorded.get("llama_cpp")  # absent in earlier versions: this CPU's build
    if llama is None:
        flags = cmake_flags(cpu_flags())
        build = find_llama_server(flags)
        llama = {"version": build.version if build else "?", "cmake_flags": flags}
    recipe = recorded.get("recipe", "builtin")  # absent in earlier versions: the built-in one
    write_markdown(Path(args.out), model=args.model, date=stamp, threads=args.threads, cpu=cpu,
                   recipe=recipe,
                   cases=",".join(args.case_keys) if args.case_keys else None,
                   llama_version=llama["version"], cmake_flags=llama["cmake_flags"],
                   llama_cmd=llama_server_cmd(Path("llama-server"), Path(gguf.name), "PORT",
                                              args.threads),
                   qserve_cmd=qserve_cmd(args.model if recipe == "builtin" else "ARTIFACT",
                                         "PORT", args.threads)[3:],
                   results=results, kv_rows=kv_budget_rows(config), spots=spots,
                   rounds=rounds)
    print(f"wrote {args.out} from the bench reports in {out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
