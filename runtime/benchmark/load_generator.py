"""The load generator: sends a workload at a fixed concurrency or a Poisson request rate.

Arrival times: a trace's own timestamps; else, with a finite `request_rate`, exponential
gaps (a Poisson process, seeded); else all at once. `concurrency` caps the requests in
flight in every case. `max_duration` bounds the run: requests not yet sent by then are
skipped (and counted), those in flight finish.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass

from ..http_client import HttpClient
from .client import ClientConfig, RequestResult, send
from .errors import BenchmarkError
from .workloads import RequestSpec


@dataclass(frozen=True)
class LoadConfig:
    concurrency: int | None = None  # most requests in flight; None: no cap
    request_rate: float = math.inf  # requests per second (Poisson); inf: all at once
    max_duration: float | None = None  # seconds; stop sending new requests after this
    seed: int = 0
    progress: bool = True


@dataclass
class LoadResult:
    results: list[RequestResult]  # the requests that were sent, in workload order
    duration: float  # seconds from the first send to the last completion
    skipped: int  # requests not sent because max_duration ran out


def arrival_times(specs: list[RequestSpec], cfg: LoadConfig) -> list[float]:
    """Seconds after the start at which each request may be sent."""
    if cfg.request_rate <= 0:
        raise BenchmarkError(f"--request-rate must be positive, not {cfg.request_rate}")
    if all(s.arrival is not None for s in specs):
        return [float(s.arrival) for s in specs]
    if math.isinf(cfg.request_rate):
        return [0.0] * len(specs)
    rng = random.Random(cfg.seed)
    t, out = 0.0, []
    for _ in specs:
        out.append(t)
        t += rng.expovariate(cfg.request_rate)
    return out


async def _run(specs: list[RequestSpec], client_cfg: ClientConfig,
               cfg: LoadConfig) -> LoadResult:
    if cfg.concurrency is not None and cfg.concurrency < 1:
        raise BenchmarkError(f"--concurrency must be at least 1, not {cfg.concurrency}")
    times = arrival_times(specs, cfg)
    gate = asyncio.Semaphore(cfg.concurrency or len(specs))
    results: list[RequestResult | None] = [None] * len(specs)
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), desc="requests", unit="req", file=sys.stderr,
                   leave=False)
    http = HttpClient(user_agent="qserve-bench")
    start = time.perf_counter()
    end = start

    async def one(i: int) -> None:
        nonlocal end
        delay = times[i] - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            if cfg.max_duration is not None and time.perf_counter() - start > cfg.max_duration:
                return
            results[i] = await send(http, client_cfg, specs[i])
            end = max(end, time.perf_counter())
        if bar is not None:
            bar.update(1)

    try:
        await asyncio.gather(*(one(i) for i in range(len(specs))))
    finally:
        await http.close()
    if bar is not None:
        bar.close()
    sent = [r for r in results if r is not None]
    return LoadResult(sent, end - start, len(specs) - len(sent))


def run_load(specs: list[RequestSpec], client_cfg: ClientConfig, cfg: LoadConfig) -> LoadResult:
    """Send `specs` and wait for all answers (blocking)."""
    return asyncio.run(_run(specs, client_cfg, cfg))
