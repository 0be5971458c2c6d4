"""`qserve bench`: the click command."""

from __future__ import annotations

import math
from pathlib import Path

import click

from .errors import BenchmarkError
from .workloads import WORKLOADS, WorkloadParams


def _int_list(ctx, param, value: str | None):
    if value is None:
        return (None,)
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: give integers separated by commas, e.g. 1,4,16")
    if not out or min(out) < 1:
        raise click.BadParameter(f"{value!r}: each concurrency must be at least 1")
    return out


def _slos(ctx, param, values):
    out = {}
    for v in values:
        name, _, ms = v.partition(":")
        try:
            out[name.strip().lower()] = float(ms)
        except ValueError:
            raise click.BadParameter(f"{v!r}: write METRIC:MS, e.g. ttft:500") from None
    return out


def _percentiles(ctx, param, value: str):
    try:
        out = tuple(float(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: give numbers separated by commas") from None
    if not all(0 <= p <= 100 for p in out):
        raise click.BadParameter(f"{value!r}: percentiles lie in [0, 100]")
    return out


@click.command(name="bench")
@click.option("--endpoint", required=True,
              help="Server root URL (or its /v1), e.g. http://127.0.0.1:8000.")
@click.option("--model", default=None, help="Model name to send (default: the server's first).")
@click.option("--api", type=click.Choice(["completions", "chat"]), default="completions",
              show_default=True)
@click.option("--api-key", default=None, envvar="QSERVE_API_KEY")
@click.option("--workload", type=click.Choice(list(WORKLOADS)), default="random",
              show_default=True)
@click.option("--num-prompts", type=click.IntRange(min=1), default=None,
              help="Requests to send [default: 64; a trace: all its lines].")
@click.option("--input-len", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--range-ratio", type=float, default=0.0, show_default=True,
              help="Lengths uniform in [L*(1-r), L*(1+r)].")
@click.option("--prefix-len", type=click.IntRange(min=1), default=2000, show_default=True,
              help="shared-prefix: tokens of the shared document.")
@click.option("--question-len", type=click.IntRange(min=1), default=32, show_default=True,
              help="shared-prefix: tokens of each user's own question.")
@click.option("--long-fraction", type=click.FloatRange(0, 1), default=0.25, show_default=True,
              help="mixed: share of long-prompt requests.")
@click.option("--long-input-len", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--long-output-len", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--trace-file", default=None,
              help="trace: JSONL of {timestamp, prompt | input_len, output_len}.")
@click.option("--corpus", default=None, help="Prompt text (.jsonl with \"text\", or plain text).")
@click.option("--tokenizer", default=None,
              help="Size prompts with this model's tokenizer instead of the server's /tokenize.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--concurrency", callback=_int_list, default=None,
              help="Most requests in flight; a comma list runs a sweep (e.g. 1,4,16).")
@click.option("--request-rate", type=float, default=math.inf,
              help="Poisson arrivals per second [default: all at once].")
@click.option("--max-duration", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds after which no new request is sent.")
@click.option("--goodput", "slos", multiple=True, callback=_slos,
              help="SLO as METRIC:MS (ttft, tpot, e2el); repeatable.")
@click.option("--percentiles", callback=_percentiles, default="50,90,99", show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0,
              show_default=True)
@click.option("--out", "out_json", default="bench-report.json", show_default=True,
              help="JSON report (written atomically).")
@click.option("--plots", "plot_prefix", default=None,
              help="PNG prefix [default: the JSON path without .json]; 'none' for no plots.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def bench(endpoint, model, api, api_key, workload, num_prompts, input_len, output_len,
          range_ratio, prefix_len, question_len, long_fraction, long_input_len,
          long_output_len, trace_file, corpus, tokenizer, seed, concurrency, request_rate,
          max_duration, slos, percentiles, temperature, request_timeout, out_json,
          plot_prefix, progress):
    """Benchmark an OpenAI-compatible server (qserve, llama.cpp's server, vLLM).

    Sends streaming requests with exact output lengths (max_tokens + ignore_eos) and
    reports TTFT, TPOT, ITL and E2EL percentiles, throughputs and goodput, as a table, a
    JSON file and PNG plots.
    """
    from ..atomic_file import write_json_atomic
    from .plots import write_plots
    from .report import format_table
    from .runner import BenchConfig, run_benchmark

    if num_prompts is None:
        num_prompts = 10**9 if workload == "trace" else 64
    params = WorkloadParams(num_prompts, input_len, output_len, range_ratio, seed, prefix_len,
                            question_len, long_fraction, long_input_len, long_output_len,
                            trace_file)
    cfg = BenchConfig(endpoint, workload, params, concurrency, request_rate, max_duration,
                      model, api, api_key, temperature, tokenizer, corpus, slos, percentiles,
                      request_timeout, progress)
    try:
        report = run_benchmark(cfg)
        click.echo(format_table(report))
        path = write_json_atomic(out_json, report.to_dict())
        click.echo(f"report: {path}", err=True)
        if (plot_prefix or "").lower() != "none":
            prefix = plot_prefix or str(Path(out_json).with_suffix(""))
            for png in write_plots(report, prefix):
                click.echo(f"plot: {png}", err=True)
    except BenchmarkError as e:
        raise click.ClickException(str(e)) from None


if __name__ == "__main__":
    bench()
