"""Serving metrics as vLLM's benchmark_serving defines them.

    TTFT   time to first token: send -> first text chunk
    TPOT   time per output token, per request: (E2EL - TTFT) / (output tokens - 1);
           requests with one output token have none
    ITL    inter-token latency: every gap between text chunks, pooled over requests
    E2EL   end-to-end latency: send -> end of the stream
    throughputs: completed requests, output tokens, and input + output tokens, each
           divided by the run's duration (first send to last completion)
    goodput: completed requests meeting every given SLO (metric <= SLO; a request without
           a TPOT counts as TPOT 0), per second
    steady decode: the window in which every completed request has its first token and
           none has ended (no prompt is being prefilled, all decode together): text chunks
           in it per second (output tokens per second without speculation) and the median
           gap between them; none where the requests never all ran at once
Latencies are reported in milliseconds; percentiles interpolate linearly (numpy's
default).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .client import RequestResult
from .errors import BenchmarkError

SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class LatencyStats:
    mean: float  # ms
    median: float  # ms
    std: float  # ms
    percentiles: dict[str, float]  # "p50" -> ms
    count: int  # samples


@dataclass
class SteadyDecode:
    streams: int  # requests decoding together in the window
    window_s: float
    chunks: int  # text chunks sent in the window (all streams)
    chunk_rate: float  # chunks / window_s
    gap_ms: float  # median gap between a stream's chunks inside the window


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    skipped: int  # not sent: the time bound ran out
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    expected_output_tokens: int  # max_tokens summed over completed requests
    request_throughput: float  # req/s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (input + output) tok/s
    goodput: float | None  # req/s within the SLOs; None without SLOs
    slos_ms: dict[str, float]
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    errors: list[str] = field(default_factory=list)  # first few distinct failure messages
    steady_decode: SteadyDecode | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BenchmarkMetrics":
        """The inverse of to_dict (reads a JSON report's run metrics)."""
        lat = {k: LatencyStats(**d[k]) for k in ("ttft", "tpot", "itl", "e2el")}
        steady = d.get("steady_decode")
        return cls(**{**d, **lat,
                      "steady_decode": SteadyDecode(**steady) if steady else None})


def latency_stats(seconds: list[float], percentiles=DEFAULT_PERCENTILES) -> LatencyStats:
    """Stats in ms of samples given in seconds; all zeros when there are none."""
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    if ms.size == 0:
        return LatencyStats(0.0, 0.0, 0.0, {_key(p): 0.0 for p in percentiles}, 0)
    return LatencyStats(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                        {_key(p): float(np.percentile(ms, p)) for p in percentiles},
                        int(ms.size))


def _key(p: float) -> str:
    return f"p{p:g}"


def tpot_of(r: RequestResult) -> float | None:
    """Seconds per output token after the first; None for a single-token output."""
    if r.output_len <= 1:
        return None
    return (r.e2el - r.ttft) / (r.output_len - 1)


def steady_decode(ok: list[RequestResult]) -> SteadyDecode | None:
    """The steady-decode window of these completed requests (module docstring), or None
    where it is empty or holds fewer chunks than streams."""
    if not ok:
        return None
    begin = max(r.start + r.ttft for r in ok)
    end = min(r.start + r.e2el for r in ok)
    if end <= begin:
        return None
    chunks, gaps = 0, []
    for r in ok:
        t = r.start + r.ttft
        for gap in r.itl:
            t += gap
            if begin < t <= end:
                chunks += 1
                if t - gap >= begin:
                    gaps.append(gap)
    if chunks < len(ok) or not gaps:
        return None
    window = end - begin
    return SteadyDecode(len(ok), window, chunks, chunks / window,
                        float(np.median(gaps)) * 1000.0)


def check_slos(slos_ms: dict[str, float]) -> None:
    for name, value in slos_ms.items():
        if name not in SLO_METRICS:
            raise BenchmarkError(f"unknown SLO metric {name!r}; use {', '.join(SLO_METRICS)} "
                                 "(e.g. --goodput ttft:500 --goodput tpot:50)")
        if not value > 0:
            raise BenchmarkError(f"SLO {name} must be a positive number of ms, not {value}")


def compute_metrics(results: list[RequestResult], duration_s: float, skipped: int = 0,
                    slos_ms: dict[str, float] | None = None,
                    percentiles=DEFAULT_PERCENTILES) -> BenchmarkMetrics:
    slos_ms = dict(slos_ms or {})
    check_slos(slos_ms)
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    if duration_s <= 0:
        raise BenchmarkError("the run took no time; nothing to measure")
    tpots = [t for t in (tpot_of(r) for r in ok) if t is not None]
    inputs = sum(r.prompt_len for r in ok)
    outputs = sum(r.output_len for r in ok)
    goodput = None
    if slos_ms:
        good = 0
        for r in ok:
            got = {"ttft": r.ttft, "tpot": tpot_of(r) or 0.0, "e2el": r.e2el}
            good += all(got[k] * 1000.0 <= v for k, v in slos_ms.items())
        goodput = good / duration_s
    errors = list(dict.fromkeys(r.error for r in failed))[:5]
    return BenchmarkMetrics(
        completed=len(ok), failed=len(failed), skipped=skipped, duration_s=duration_s,
        total_input_tokens=inputs, total_output_tokens=outputs,
        expected_output_tokens=sum(r.expected_output_len for r in ok),
        request_throughput=len(ok) / duration_s, output_throughput=outputs / duration_s,
        total_token_throughput=(inputs + outputs) / duration_s, goodput=goodput,
        slos_ms=slos_ms,
        ttft=latency_stats([r.ttft for r in ok], percentiles),
        tpot=latency_stats(tpots, percentiles),
        itl=latency_stats([g for r in ok for g in r.itl], percentiles),
        e2el=latency_stats([r.e2el for r in ok], percentiles),
        errors=errors, steady_decode=steady_decode(ok))
