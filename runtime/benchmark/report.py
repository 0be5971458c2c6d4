"""The benchmark report: a text table for the terminal and a JSON file (atomic write)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..atomic_file import write_text_atomic
from .client import RequestResult
from .metrics import BenchmarkMetrics

REPORT_VERSION = 1


@dataclass
class RunRecord:
    """One load setting of a benchmark (one point of a concurrency sweep)."""

    concurrency: int | None
    request_rate: float  # inf: all at once
    metrics: BenchmarkMetrics
    results: list[RequestResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        rate = None if self.request_rate == float("inf") else self.request_rate
        t0 = min((r.start for r in self.results), default=0.0)
        return {
            "concurrency": self.concurrency, "request_rate": rate,
            "metrics": self.metrics.to_dict(),
            # per request; "start" in seconds after the run's first send
            "requests": [{**asdict(r), "start": r.start - t0} for r in self.results],
        }


@dataclass
class BenchmarkReport:
    date: str  # ISO 8601, UTC
    endpoint: str
    model: str
    api: str
    workload: str
    workload_params: dict
    tokenizer: str
    runs: list[RunRecord]

    def to_dict(self) -> dict:
        return {"report_version": REPORT_VERSION, "date": self.date, "endpoint": self.endpoint,
                "model": self.model, "api": self.api, "workload": self.workload,
                "workload_params": self.workload_params, "tokenizer": self.tokenizer,
                "runs": [r.to_dict() for r in self.runs]}


def upsert_section(path: str | Path, key: str, body: str, header: str) -> Path:
    """Put `body` between `<!-- begin KEY -->` and `<!-- end KEY -->` in the markdown file
    at `path`, replacing that section if it is there, else appending it (a new file starts
    with `header`); written atomically. Sections under other keys stay as they are."""
    path = Path(path)
    begin, end = f"<!-- begin {key} -->", f"<!-- end {key} -->"
    text = path.read_text("utf-8") if path.is_file() else header
    block = f"{begin}\n{body}{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = (pattern.sub(lambda _: block, text) if pattern.search(text)
            else text.rstrip("\n") + "\n\n" + block + "\n")
    return write_text_atomic(path, text)


def format_table(report: BenchmarkReport) -> str:
    """One column per run; latencies in ms."""
    runs = report.runs
    head = [f"{report.workload} workload, {report.api} API, {report.model} at {report.endpoint}"]

    def load_name(r: RunRecord) -> str:
        rate = "inf" if r.request_rate == float("inf") else f"{r.request_rate:g}/s"
        return f"conc {r.concurrency or '-'} rate {rate}"

    rows: list[tuple[str, list[str]]] = [("load", [load_name(r) for r in runs])]

    def add(label: str, fn) -> None:
        rows.append((label, [fn(r.metrics) for r in runs]))

    add("completed / failed / skipped", lambda m: f"{m.completed} / {m.failed} / {m.skipped}")
    add("duration (s)", lambda m: f"{m.duration_s:.2f}")
    add("input / output tokens", lambda m: f"{m.total_input_tokens} / {m.total_output_tokens}")
    add("request throughput (req/s)", lambda m: f"{m.request_throughput:.3f}")
    add("output throughput (tok/s)", lambda m: f"{m.output_throughput:.2f}")
    add("total throughput (tok/s)", lambda m: f"{m.total_token_throughput:.2f}")
    if any(r.metrics.goodput is not None for r in runs):
        add("goodput (req/s)", lambda m: "-" if m.goodput is None else f"{m.goodput:.3f}")
    if any(r.metrics.steady_decode is not None for r in runs):
        add("steady decode: streams x s", lambda m: "-" if m.steady_decode is None else
            f"{m.steady_decode.streams} x {m.steady_decode.window_s:.1f}")
        add("steady decode (tok/s)", lambda m: "-" if m.steady_decode is None else
            f"{m.steady_decode.chunk_rate:.2f}")
        add("steady decode gap p50 (ms)", lambda m: "-" if m.steady_decode is None else
            f"{m.steady_decode.gap_ms:.2f}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        add(f"{name.upper()} mean (ms)", lambda m, n=name: f"{getattr(m, n).mean:.2f}")
        for key in runs[0].metrics.ttft.percentiles:
            add(f"{name.upper()} {key} (ms)",
                lambda m, n=name, k=key: f"{getattr(m, n).percentiles[k]:.2f}")
    width = max(len(label) for label, _ in rows)
    cols = [max(len(v[i]) for _, v in rows) for i in range(len(runs))]
    lines = head + [f"{label:<{width}}  " + "  ".join(f"{v:>{c}}" for v, c in zip(vals, cols))
                    for label, vals in rows]
    errors = [e for r in runs for e in r.metrics.errors]
    if errors:
        lines.append("errors: " + "; ".join(dict.fromkeys(errors)))
    return "\n".join(lines)
