"""Overload check: a full server must refuse more work at once, politely, and recover.

The server runs with `--max-num-seqs 4 --max-queue 4`, so 8 requests fill it. Eight
long streams hold it full; then extra requests arrive, first one at a time (each one's
latency alone), then as one concurrent burst. Each must be refused with 429 or 503, a
Retry-After header and an OpenAI error body, within 50 ms. Afterwards the held streams
finish and the server drains to zero KV blocks and zero requests in flight.

For scale, a burst of as many GET /health requests is timed too (while the server is
still full): the latency any request sees, whatever the route, at that moment.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from .reliability_client import RequestOutcome, RequestPlan, make_prompt, send_planned
from .reliability_result import CheckResult, percentiles_ms
from .reliability_server import (ServeOptions, drain_detail, openai_error_problem,
                                 parse_prometheus, start_server, wait_drained)

MAX_NUM_SEQS = 4
MAX_QUEUE = 4
REJECT_WITHIN_S = 0.050


@dataclass(frozen=True)
class OverloadConfig:
    hold_tokens: int = 160  # max_tokens of each held stream: long enough to outlast the extras
    sequential: int = 16  # extra requests sent one at a time
    burst: int = 16  # extra requests sent together
    fill_timeout: float = 120.0
    seed: int = 0
    model: str | None = None


def rejection_problem(o: RequestOutcome) -> str | None:
    """None if `o` is a proper refusal: 429/503, Retry-After, an OpenAI error body."""
    if o.status not in (429, 503):
        return f"status {o.status} ({o.end}{': ' + o.error[:120] if o.error else ''})"
    if not o.retry_after:
        return f"status {o.status} without Retry-After"
    problem = openai_error_problem(o.error_body)
    if problem:
        return f"status {o.status} body is not an OpenAI error: {problem}"
    return None


def judge_rejections(res: CheckResult, extras: list[RequestOutcome]) -> None:
    """Add the refusal criteria for the extra requests to `res`."""
    problems = [(o.index, rejection_problem(o)) for o in extras]
    bad = [(i, p) for i, p in problems if p]
    res.require("every extra request refused with 429/503 + Retry-After + OpenAI error",
                bool(extras) and not bad,
                f"{len(extras) - len(bad)} of {len(extras)} proper refusals"
                + (f"; first problem (request {bad[0][0]}): {bad[0][1]}" if bad else ""))
    slowest = max((o.e2e_s for o in extras), default=float("inf"))
    res.require("refused within 50 ms", slowest <= REJECT_WITHIN_S,
                f"slowest refusal {slowest * 1000:.1f} ms")


async def _overload(base: str, cfg: OverloadConfig) -> dict:
    rng = random.Random(cfg.seed)
    held = [RequestPlan(i, "completions" if i % 2 else "chat", True, cfg.hold_tokens,
                        make_prompt(rng)) for i in range(MAX_NUM_SEQS + MAX_QUEUE)]
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits) as client:
        holders = [asyncio.ensure_future(send_planned(client, base, cfg.model, p)) for p in held]
        t0 = time.monotonic()
        in_flight = 0.0
        while time.monotonic() - t0 < cfg.fill_timeout:
            m = parse_prometheus((await client.get(base + "/metrics")).text)
            in_flight = m.get("requests_in_flight", 0.0)
            if in_flight >= len(held) or all(h.done() for h in holders):
                break
            await asyncio.sleep(0.05)
        filled_s = time.monotonic() - t0

        def extra(i: int) -> RequestPlan:
            return RequestPlan(100 + i, "chat" if i % 2 else "completions", i % 4 < 2, 16,
                               make_prompt(rng))

        seq = []
        for i in range(cfg.sequential):
            seq.append(await send_planned(client, base, cfg.model, extra(i), timeout=30))
        burst = await asyncio.gather(*(send_planned(client, base, cfg.model,
                                                    extra(cfg.sequential + i), timeout=30)
                                       for i in range(cfg.burst)))
        health = await asyncio.gather(*(_timed_get(client, base + "/health")
                                        for _ in range(cfg.burst)))
        still = parse_prometheus((await client.get(base + "/metrics")).text)
        held_out = await asyncio.gather(*holders)
    return {"held": list(held_out), "sequential": seq, "burst": list(burst), "health": health,
            "in_flight_when_full": in_flight, "fill_s": filled_s,
            "in_flight_after_extras": still.get("requests_in_flight"),
            "rejected_metric": still.get('requests_total{outcome="rejected"}')}


async def _timed_get(client: httpx.AsyncClient, url: str) -> float:
    t0 = time.perf_counter()
    try:
        await client.get(url, timeout=30)
    except httpx.HTTPError:
        pass
    return time.perf_counter() - t0


def run_overload(opts: ServeOptions, cfg: OverloadConfig) -> CheckResult:
    res = CheckResult("overload")
    t0 = time.monotonic()
    extra_args = ("--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue", str(MAX_QUEUE))
    with start_server(opts, "overload", extra_args) as server:
        res.measurements["server_log"] = str(server.log)
        out = asyncio.run(_overload(server.base, cfg))
        drained, gauges, waited = wait_drained(server.base)
        alive = server.proc.poll() is None
    extras = out["sequential"] + out["burst"]
    res.measurements.update(
        server_args=" ".join(extra_args), held=len(out["held"]),
        in_flight_when_full=out["in_flight_when_full"], fill_s=round(out["fill_s"], 2),
        in_flight_after_extras=out["in_flight_after_extras"],
        rejected=sum(1 for o in extras if o.status in (429, 503)), extras=len(extras),
        statuses={str(s): sum(1 for o in extras if o.status == s)
                  for s in sorted({o.status for o in extras}, key=str)},
        retry_after=sorted({o.retry_after for o in extras if o.retry_after}),
        rejection_latency_ms=percentiles_ms([o.e2e_s for o in extras]),
        sequential_latency_ms=percentiles_ms([o.e2e_s for o in out["sequential"]]),
        burst_latency_ms=percentiles_ms([o.e2e_s for o in out["burst"]]),
        health_burst_latency_ms=percentiles_ms(out["health"]),
        rejected_metric=out["rejected_metric"],
        held_complete=sum(1 for o in out["held"] if o.complete),
        held_failures=[o.error or o.error_event or o.end for o in out["held"] if not o.complete],
        drain=gauges, drain_wait_s=round(waited, 1),
        sample_rejection=next((o.error_body for o in extras if o.error_body), None))
    full = out["in_flight_when_full"] >= len(out["held"])
    res.require("server full before the extras", full,
                f"{out['in_flight_when_full']:g} of {len(out['held'])} in flight after "
                f"{out['fill_s']:.1f}s")
    judge_rejections(res, extras)
    res.require("held streams complete", all(o.complete for o in out["held"]),
                f"{res.measurements['held_complete']} of {len(out['held'])} held streams "
                "finished with [DONE]")
    res.require("drained to 0 KV blocks and 0 in flight", drained, drain_detail(gauges, waited))
    res.require("server alive at the end", alive, "running" if alive else "exited")
    res.duration_s = time.monotonic() - t0
    return res
