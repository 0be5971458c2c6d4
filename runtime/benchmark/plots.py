"""PNG plots of a benchmark report: latency distributions, throughput vs concurrency."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import BenchmarkError
from .report import BenchmarkReport

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise BenchmarkError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _samples_ms(run, name: str) -> list[float]:
    ok = [r for r in run.results if r.success]
    if name == "itl":
        return [g * 1000 for r in ok for g in r.itl]
    if name == "tpot":
        return [(r.e2el - r.ttft) / (r.output_len - 1) * 1000 for r in ok if r.output_len > 1]
    return [getattr(r, name) * 1000 for r in ok]


def plot_latencies(report: BenchmarkReport, path: Path) -> Path:
    """Histograms of TTFT, TPOT, ITL and E2EL, one colour per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (name, label) in zip(axes.flat, LATENCIES):
        per_run = [_samples_ms(run, name) for run in report.runs]
        pooled = [x for data in per_run for x in data]
        if not pooled:
            continue
        bins = np.histogram_bin_edges(pooled, bins=40)  # the same bins for every run
        for run, data in zip(report.runs, per_run):
            if data:
                ax.hist(data, bins=bins, alpha=0.55,
                        label=f"concurrency {run.concurrency or '-'}")
        ax.set_title(f"{label} (ms)")
        ax.set_ylabel("count")
        if len(report.runs) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(f"{report.model}: {report.workload} workload ({report.endpoint})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_throughput(report: BenchmarkReport, path: Path) -> Path:
    """Output tokens/s and request TTFT p50 against concurrency (a sweep)."""
    plt = _pyplot()
    runs = sorted((r for r in report.runs if r.concurrency), key=lambda r: r.concurrency)
    xs = [r.concurrency for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r.metrics.output_throughput for r in runs], "o-", label="output tok/s")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens / s")
    ax.set_xscale("log", base=2)
    ax2 = ax.twinx()
    ax2.plot(xs, [r.metrics.tpot.median for r in runs], "s--", color="tab:red",
             label="TPOT p50 (ms)")
    ax2.set_ylabel("TPOT p50 (ms)")
    fig.legend(loc="upper left")
    ax.set_title(f"{report.model}: throughput vs concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(report: BenchmarkReport, prefix: str | Path) -> list[Path]:
    """`PREFIX-latency.png`, and `PREFIX-throughput.png` for a sweep of 2+ concurrencies."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    out = [plot_latencies(report, prefix.with_name(prefix.name + "-latency.png"))]
    if len({r.concurrency for r in report.runs if r.concurrency}) > 1:
        out.append(plot_throughput(report, prefix.with_name(prefix.name + "-throughput.png")))
    return out
