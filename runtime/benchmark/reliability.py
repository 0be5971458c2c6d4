"""The reliability suite: does the server stay correct under abuse, load and shutdown?

    python -m qserve.runtime.benchmark.reliability [--checks fuzz,soak,overload,sigterm,
        quantize-interrupt] [--artifact smollm2-135m] [--requests 1000] [--concurrency 32]
        [--disconnect-rate 0.2] [--fuzz-examples 25] [--json OUT.json] [--threads 2]

Checks (each starts its own `qserve serve` on a free loopback port):
    fuzz                schemathesis over GET /openapi.json: no 5xx, OpenAI error bodies
    soak                mixed load with clients leaving early: survivors complete, no 5xx,
                        KV drains to 0, RSS flat
    overload            a full server (--max-num-seqs 4 --max-queue 4) refuses extras with
                        429/503 + Retry-After within 50 ms, then drains
    sigterm             SIGTERM mid-stream: every stream finishes or ends with an error
                        event, new requests refused, exit 0
    quantize-interrupt  SIGINT / SIGKILL mid-quantize leave no artifact; the next run
                        removes the stale temp folder and completes

Prints a summary table, writes the full results as JSON (atomically) with --json, and
exits 1 if any check fails (2 on bad arguments). It is a benchmark, not a unit test:
at the defaults it takes tens of minutes on a small CPU.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import click  # noqa: E402

from ...kernels.native_build import cpuinfo_field, read_cpuinfo  # noqa: E402
from ..formats.sources import DEFAULT_MODEL  # noqa: E402
from .errors import BenchmarkError  # noqa: E402
from .reliability_fuzz import run_fuzz  # noqa: E402
from .reliability_overload import OverloadConfig, run_overload  # noqa: E402
from .reliability_quantize import QuantizeConfig, run_quantize_interrupt  # noqa: E402
from .reliability_result import (CheckResult, ReliabilityReport, summary_table,  # noqa: E402
                                 write_json_atomic)
from .reliability_server import ServeOptions  # noqa: E402
from .reliability_sigterm import SigtermConfig, run_sigterm  # noqa: E402
from .reliability_soak import SoakConfig, run_soak  # noqa: E402

CHECKS = ("fuzz", "soak", "overload", "sigterm", "quantize-interrupt")


def parse_checks(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in CHECKS]
    if unknown or not names:
        raise click.BadParameter(f"unknown check(s) {', '.join(unknown) or '(none given)'}; "
                                 f"choose from {','.join(CHECKS)}", param_hint="--checks")
    return list(dict.fromkeys(names))


def cpu_name() -> str:
    return cpuinfo_field(read_cpuinfo(), ("model name", "Model name")) or "unknown CPU"


def run_check(name: str, fn, *args, **kwargs) -> CheckResult:
    """Run one check; a check that cannot run becomes a failed result, not a crash, so
    the remaining checks still run."""
    t0 = time.monotonic()
    try:
        return fn(*args, **kwargs)
    except (BenchmarkError, OSError, RuntimeError, ValueError) as e:
        return CheckResult(name, error=f"{type(e).__name__}: {e}"[:2000],
                           duration_s=time.monotonic() - t0)


@click.command()
@click.option("--checks", "checks_text", default=",".join(CHECKS), show_default=True,
              help="Comma-separated checks to run.")
@click.option("--artifact", default=DEFAULT_MODEL, show_default=True,
              help="What `qserve serve` serves: a built-in name or an artifact/checkpoint dir.")
@click.option("--requests", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Soak requests.")
@click.option("--concurrency", type=click.IntRange(min=1), default=32, show_default=True,
              help="Soak requests in flight.")
@click.option("--disconnect-rate", type=click.FloatRange(0.0, 1.0), default=0.2,
              show_default=True, help="Share of soak clients that leave early.")
@click.option("--max-tokens", "max_tokens_range", default="8,64", show_default=True,
              help="Soak max_tokens range MIN,MAX (drawn uniformly).")
@click.option("--fuzz-examples", type=click.IntRange(min=1), default=25, show_default=True,
              help="Generated requests per operation and mode (schema-valid, -invalid).")
@click.option("--quantize-source", default=DEFAULT_MODEL, show_default=True,
              help="What quantize-interrupt quantizes (built-in name or HF checkpoint dir).")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True,
              help="CPU threads of each server and quantize run.")
@click.option("--serve-arg", "serve_args", multiple=True,
              help="Extra `qserve serve` option for every check (repeat; e.g. "
                   "--serve-arg=--dtype --serve-arg=fp32).")
@click.option("--model", default=None,
              help="Model name sent in requests (default: none, the server's own).")
@click.option("--work-dir", default=None,
              help="Where server logs and the quantize outputs go (default: a new temp dir).")
@click.option("--json", "json_out", default=None, help="Write all results to this JSON file.")
@click.option("--seed", type=int, default=0, show_default=True)
def main(checks_text, artifact, requests, concurrency, disconnect_rate, max_tokens_range,
         fuzz_examples, quantize_source, threads, serve_args, model, work_dir, json_out, seed):
    """Run the reliability checks against `qserve serve ARTIFACT`; exit 1 if any fails."""
    checks = parse_checks(checks_text)
    try:
        lo, hi = (int(x) for x in max_tokens_range.split(","))
        if not 1 <= lo <= hi:
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"{max_tokens_range!r}: give MIN,MAX with 1 <= MIN <= MAX",
                                 param_hint="--max-tokens") from None
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="qserve-reliability-"))
    work.mkdir(parents=True, exist_ok=True)
    click.echo(f"reliability: {', '.join(checks)} on {artifact}; logs in {work}", err=True)
    opts = ServeOptions(artifact, threads, tuple(serve_args), work)

    def say(msg: str) -> None:
        click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)

    runners = {
        "fuzz": lambda: run_fuzz(opts, fuzz_examples, seed),
        "soak": lambda: run_soak(opts, SoakConfig(requests, concurrency, disconnect_rate, lo,
                                                  hi, min(concurrency, requests), seed,
                                                  model), say),
        "overload": lambda: run_overload(opts, OverloadConfig(seed=seed, model=model)),
        "sigterm": lambda: run_sigterm(opts, SigtermConfig(seed=seed, model=model)),
        "quantize-interrupt": lambda: run_quantize_interrupt(
            QuantizeConfig(quantize_source, work, threads), say),
    }
    results = []
    for name in checks:
        say(f"{name}: starting")
        r = run_check(name, runners[name])
        say(f"{name}: {'PASS' if r.passed else 'FAIL'} in {r.duration_s:.0f}s")
        results.append(r)
    report = ReliabilityReport(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        cpu=cpu_name(), threads=threads, artifact=artifact,
        config={"checks": checks, "requests": requests, "concurrency": concurrency,
                "disconnect_rate": disconnect_rate, "max_tokens": [lo, hi],
                "fuzz_examples": fuzz_examples, "quantize_source": quantize_source,
                "serve_args": list(serve_args), "seed": seed, "work_dir": str(work)},
        checks=results)
    click.echo(summary_table(results))
    if json_out:
        write_json_atomic(json_out, report.to_dict())
        click.echo(f"results: {json_out}", err=True)
    sys.exit(0 if report.passed else 1)


if __name__ == "__main__":
    main()
