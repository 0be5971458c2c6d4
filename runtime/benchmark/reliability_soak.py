"""Soak check: many mixed requests at a fixed concurrency, some clients leaving early.

The mix: chat and completions, streamed and not, max_tokens drawn from a small range,
and a share of clients that leave (a stream closes its connection after a few events, a
non-streamed request is cancelled after a random delay). A warm-up wave runs first, so
that the resident memory measured after it already includes the allocator's and the
kernels' one-time growth; the soak then must not grow it by more than 10%.

Criteria: every request that stayed gets 200 and a finish_reason ([DONE] too when
streamed), nothing answers 5xx, the server drains to zero KV blocks and zero running
requests, and resident memory at the end is within 10% of the post-warm-up value.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import asdict, dataclass

import httpx

from .reliability_client import RequestOutcome, RequestPlan, make_prompt, send_planned
from .reliability_result import CheckResult, percentiles_ms
from .reliability_server import (ServeOptions, drain_detail, rss_bytes, start_server,
                                 wait_drained)

RSS_TOLERANCE = 0.10


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 1000
    concurrency: int = 32
    disconnect_rate: float = 0.2
    min_tokens: int = 8
    max_tokens: int = 64
    warmup: int = 64  # requests before the RSS baseline
    seed: int = 0
    model: str | None = None  # the model name to send; None: none (the server's own)


def plan_requests(n: int, cfg: SoakConfig, seed: int) -> list[RequestPlan]:
    """`n` requests: half chat, half streamed (independently), `disconnect_rate` leaving."""
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        stream = rng.random() < 0.5
        leaves = rng.random() < cfg.disconnect_rate
        plans.append(RequestPlan(
            index=i, api="chat" if rng.random() < 0.5 else "completions", stream=stream,
            max_tokens=rng.randint(cfg.min_tokens, cfg.max_tokens), prompt=make_prompt(rng),
            leave_after_events=rng.randint(1, 6) if leaves and stream else None,
            leave_after_s=rng.uniform(0.05, 2.0) if leaves and not stream else None))
    return plans


async def run_plans(base: str, plans: list[RequestPlan], concurrency: int,
                    model: str | None = None,
                    progress=None) -> tuple[list[RequestOutcome], float]:
    """Send every plan with at most `concurrency` in flight; (outcomes, seconds).
    `progress(message)` hears of every tenth of the plans done."""
    gate = asyncio.Semaphore(concurrency)
    finished = 0
    step = max(1, len(plans) // 10)
    limits = httpx.Limits(max_connections=concurrency + 4,
                          max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def one(plan: RequestPlan) -> RequestOutcome:
            nonlocal finished
            async with gate:
                out = await send_planned(client, base, model, plan)
            finished += 1
            if progress is not None and finished % step == 0:
                progress(f"{finished}/{len(plans)} requests in {time.perf_counter() - t0:.0f}s")
            return out

        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(one(p) for p in plans))
        return list(outcomes), time.perf_counter() - t0


@dataclass
class SoakTally:
    """What the outcomes of a soak add up to."""

    requests: int
    left: int  # clients that left before the answer ended
    survivors: int
    complete: int  # survivors with a full answer
    incomplete: list[dict]  # survivors without one (first few)
    status_5xx: int
    error_events: int
    ttft_s: list[float]  # streamed survivors
    completion_tokens: int


def tally(outcomes: list[RequestOutcome]) -> SoakTally:
    survivors = [o for o in outcomes if not o.left]
    bad = [o for o in survivors if not o.complete]
    return SoakTally(
        requests=len(outcomes), left=len(outcomes) - len(survivors), survivors=len(survivors),
        complete=len(survivors) - len(bad),
        incomplete=[_brief(o) for o in bad[:10]],
        status_5xx=sum(1 for o in outcomes if o.status is not None and o.status >= 500),
        error_events=sum(1 for o in outcomes if o.error_event),
        ttft_s=[o.ttft_s for o in survivors if o.stream and o.ttft_s is not None],
        completion_tokens=sum(o.completion_tokens or 0 for o in survivors))


def _brief(o: RequestOutcome) -> dict:
    d = asdict(o)
    d.pop("timeline")
    return d


def judge_soak(res: CheckResult, t: SoakTally, drained: bool, drain_info: str,
               rss_warm: int, rss_end: int) -> None:
    """Add the soak's criteria to `res`."""
    first = ""
    if t.incomplete:
        bad = t.incomplete[0]
        first = f"; first failure: {bad['error'] or bad['error_event'] or bad['end']}"
    res.require("every survivor completes", t.survivors > 0 and t.complete == t.survivors,
                f"{t.complete} of {t.survivors} requests that stayed got 200 + finish_reason"
                + first)
    res.require("no 5xx", t.status_5xx == 0, f"{t.status_5xx} responses with status 5xx")
    res.require("drained to 0 KV blocks and 0 running", drained, drain_info)
    growth = (rss_end - rss_warm) / rss_warm if rss_warm else float("inf")
    res.require("RSS within 10% of post-warm-up", abs(growth) <= RSS_TOLERANCE,
                f"{rss_warm / 2**20:.0f} MiB after warm-up, {rss_end / 2**20:.0f} MiB at the "
                f"end ({growth * 100:+.1f}%)")


class _RssSampler:
    """Samples a process's RSS once a second in a thread; `peak` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except (OSError, ValueError, ImportError):
                return
            except Exception:  # psutil.NoSuchProcess: the server is gone
                return
            self._stop.wait(1.0)

    def __enter__(self) -> "_RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run_soak(opts: ServeOptions, cfg: SoakConfig, progress=print) -> CheckResult:
    res = CheckResult("soak")
    t0 = time.monotonic()
    with start_server(opts, "soak") as server:
        res.measurements["server_log"] = str(server.log)
        warm = plan_requests(cfg.warmup, SoakConfig(**{**asdict(cfg), "disconnect_rate": 0.0}),
                             cfg.seed + 1)
        progress(f"soak: warm-up, {len(warm)} requests")
        asyncio.run(run_plans(server.base, warm, cfg.concurrency, cfg.model))
        ok, _, _ = wait_drained(server.base)
        rss_warm = rss_bytes(server.pid)
        plans = plan_requests(cfg.requests, cfg, cfg.seed)
        progress(f"soak: {len(plans)} requests at concurrency {cfg.concurrency}")
        with _RssSampler(server.pid) as sampler:
            outcomes, seconds = asyncio.run(run_plans(server.base, plans, cfg.concurrency,
                                                      cfg.model, progress))
        drained, gauges, waited = wait_drained(server.base)
        rss_end = rss_bytes(server.pid)
        alive = server.proc.poll() is None
    t = tally(outcomes)
    res.measurements.update(
        requests=t.requests, survivors=t.survivors, complete=t.complete,
        disconnected=t.left, planned_disconnects=sum(p.leaves for p in plans),
        status_5xx=t.status_5xx, error_events=t.error_events,
        incomplete_samples=t.incomplete, duration_s=round(seconds, 1),
        throughput_rps=round(len(outcomes) / seconds, 2),
        survivor_output_tok_s=round(t.completion_tokens / seconds, 1),
        ttft_ms=percentiles_ms(t.ttft_s), rss_warm_mib=round(rss_warm / 2**20, 1),
        rss_end_mib=round(rss_end / 2**20, 1), rss_peak_mib=round(sampler.peak / 2**20, 1),
        rss_growth_pct=round((rss_end - rss_warm) / rss_warm * 100, 2),
        drain=gauges, drain_wait_s=round(waited, 1), warmup=len(warm),
        status_counts=_counts(outcomes), end_counts=_ends(outcomes))
    if not ok:
        res.notes.append("the server had not drained after the warm-up either")
    judge_soak(res, t, drained, drain_detail(gauges, waited), rss_warm, rss_end)
    res.require("server alive at the end", alive, "running" if alive else "exited")
    res.duration_s = time.monotonic() - t0
    return res


def _counts(outcomes: list[RequestOutcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        k = str(o.status) if o.status is not None else "none"
        counts[k] = counts.get(k, 0) + 1
    return dict(sorted(counts.items()))


def _ends(outcomes: list[RequestOutcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.end or "?"] = counts.get(o.end or "?", 0) + 1
    return dict(sorted(counts.items()))
